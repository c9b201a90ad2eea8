"""Soak of the FSDP2 drop-in: a small model trained for thousands of steps, with the process's
resources sampled on the way -- do they stay flat, and do the losses stay equal to stock's?

    python bench/soak.py                                   # CPU: W=2, 2,000 steps x 4 modes
    python bench/soak.py --steps 200 --modes stock eager   # shorter, two modes
    python bench/soak.py --device cuda                     # GPU: the W processes share cuda:0
    python bench/soak.py --summarize out.jsonl             # the summary of a recorded run again

Modes (each in fresh processes, one after the other; ``--parallel``: all at once): ``stock`` (FSDP2's own collectives),
``eager`` (``tide_triton.fsdp.enable(model)``), ``prepared`` (``enable(model, prepared=True)``),
``slot_reuse`` (``enable(model, slot_reuse=True)``).  The model is ``examples/train_llama.py``'s
Llama (``--dim``, ``--layers``; attention biases, a (1, heads, head_dim) query gain and a tied
output: the parameters that break naive layouts), ``fully_shard`` per block and at the root,
bf16 parameters / fp32 reduce, AdamW; every rank draws its own batch per step
(``train_llama.batch``).  The W ranks are spawned by the tests' launcher (``tests/_dist.py``:
multiprocessing ``spawn``, the rendezvous ``TCPStore`` in this process, a gloo group); on the
CPU the drop-in moves data through its host transport (``/dev/shm``), on CUDA through its VMM
heaps, every rank on cuda:0 (``--gpu-per-rank``: rank r on ``cuda:r % n``).

Every ``--every`` steps each rank records, between steps (after ``zero_grad``): the loss, its
RSS (``/proc/self/statm``), open file descriptors (``/proc/self/fd``), OS threads
(``/proc/self/task``), its ``/dev/shm`` use -- ``shm_named``: entries in ``/dev/shm`` whose name
carries this process's pid (tide_triton's heap files are ``tide_triton.<pid>.<hex>.<rank>``,
unlinked once every peer opened them; torch's are ``torch_<pid>_...``), ``shm_held`` /
``shm_held_bytes``: the ``/dev/shm`` files this process holds open or mapped (unlinked ones
included) and their bytes; ``dev_shm_entries`` / ``dev_shm_bytes``: the whole directory (shared
with every other process of the machine: informative only) -- ``tide_triton.fsdp.heap_bytes``,
and on CUDA ``torch.cuda.memory_allocated`` / ``memory_reserved`` and the device's used memory
(``mem_get_info``, shared by the ranks of a GPU: informative only).  At the end each rank
records every step's loss and a SHA-256 of its parameter shards.

Output: one JSON line per record (``--out``), then a summary (printed, and appended as one
line ``{"kind": "summary", ...}``).  Warm-up: the samples at steps <= ``--warmup`` x steps
(10%).  A series is *flat* when, after warm-up, no sample exceeds the first post-warm-up sample
by more than its tolerance (:data:`TOLERANCE`: 0 for counts and for tide_triton's heap and
torch's allocated and reserved bytes, which are exact between steps; 8 MiB or 2% for the RSS,
the larger -- malloc's arenas and the allocator's caches move by a few MiB; a leak of 5 KiB a
step crosses it within 2,000 steps, smaller ones show in the slope); the summary gives each
series' first / last / max post-warm-up values, its max drift (max - first post-warm-up) and
slope (least squares, units per 1,000 steps).  Losses: compared
with stock's at every step, bit for bit (the drop-in sums the fp32 reduction of W=2 ranks
exactly as gloo does; at W > 2 or on a GPU the summation order differs, so they agree to fp32
rounding, which training then amplifies: the summary gives the first step that differs and the
largest difference).  Exit status 1 when a judged series is not flat or, at W=2 on the CPU, a
loss differs from stock's.
"""
from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import math
import os
import re
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterable, Sequence

_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(_HERE)
for _p in (_ROOT, os.path.join(_ROOT, "examples"), os.path.join(_ROOT, "tests")):
    if _p not in sys.path:  # this tree's tide_triton, the examples' model, the tests' launcher
        sys.path.insert(0, _p)

from _dist import report, run_multiprocess  # noqa: E402

MODES = ("stock", "eager", "prepared", "slot_reuse")
"""What ``enable`` is called with in each mode (stock: not called)."""
ENABLE_KW = {"eager": {}, "prepared": {"prepared": True}, "slot_reuse": {"slot_reuse": True}}

MIB = 1 << 20
TOLERANCE: dict[str, tuple[float, float]] = {
    # series: (absolute, relative to the first post-warm-up sample); flat when max - first <= max of both
    "rss": (8 * MIB, 0.02),
    "fds": (0, 0),
    "threads": (0, 0),
    "shm_named": (0, 0),
    "shm_held": (0, 0),
    "shm_held_bytes": (0, 0),
    "heap_bytes": (0, 0),
    "cuda_allocated": (0, 0),
    "cuda_reserved": (0, 0),
}
"""The series judged flat or not, and their tolerances (the other recorded fields are informative)."""

MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


@dataclass
class SoakConfig:
    steps: int = 2000
    every: int = 20
    warmup: float = 0.1
    """Fraction of the steps that is warm-up: samples at steps <= warmup * steps are not judged."""
    dim: int = 16
    layers: int = 2
    vocab: int = 32
    batch: int = 2
    seq: int = 8
    lr: float = 1e-3
    device: str = "cpu"
    gpu_per_rank: bool = False
    timeout_s: float = 120.0
    """The process group's deadline (tide_triton's groups keep their default)."""
    leak: str | None = None
    """Tests of the soak itself: leak these resources, one each per step (:class:`_Leak`)."""
    env: dict = field(default_factory=dict)
    """Set in the ranks' environment."""

    def llama(self):
        from train_llama import LlamaConfig

        return LlamaConfig(vocab=self.vocab, dim=self.dim, n_layers=self.layers, n_heads=4,
                           hidden=(8 * self.dim) // 3 + 1, tied=True, bias=True, head_gain=True)


# --------------------------------------------------------------------------- samples
_PAGE = os.sysconf("SC_PAGE_SIZE")
_SHM = "/dev/shm"


def _pid_token(pid: int) -> re.Pattern:
    return re.compile(rf"(^|[._-]){pid}([._-]|$)")


def shm_use(pid: int | None = None) -> dict[str, int]:
    """This process's ``/dev/shm`` use: entries named with its pid, files held open or mapped
    (count, bytes: a file's size when open, else its mapped length), the whole directory."""
    pid = os.getpid() if pid is None else pid
    token = _pid_token(pid)
    named = entries = total = 0
    try:
        with os.scandir(_SHM) as it:
            for e in it:
                entries += 1
                try:
                    total += e.stat(follow_symlinks=False).st_size
                except OSError:  # removed meanwhile
                    pass
                named += bool(token.search(e.name))
    except OSError:
        pass
    held: dict[int, int] = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            if not os.readlink(f"/proc/self/fd/{fd}").startswith(_SHM + "/"):
                continue
            st = os.stat(f"/proc/self/fd/{fd}")
        except OSError:  # the listing's own descriptor, or closed meanwhile
            continue
        held[st.st_ino] = st.st_size
    mapped: dict[int, int] = {}
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split(None, 5)
            if len(parts) == 6 and parts[5].startswith(_SHM + "/"):
                lo, hi = (int(x, 16) for x in parts[0].split("-"))
                ino = int(parts[4])
                mapped[ino] = mapped.get(ino, 0) + hi - lo
    for ino, n in mapped.items():
        held.setdefault(ino, n)
    return {"shm_named": named, "shm_held": len(held), "shm_held_bytes": sum(held.values()),
            "dev_shm_entries": entries, "dev_shm_bytes": total}


def sample(model: Any = None, device: Any = None) -> dict[str, int]:
    """The process's resources now (see the module's docstring)."""
    with open("/proc/self/statm") as f:
        rss = int(f.read().split()[1]) * _PAGE
    out = {"rss": rss, "fds": len(os.listdir("/proc/self/fd")), "threads": len(os.listdir("/proc/self/task")),
           "py_threads": threading.active_count(), **shm_use()}
    if model is not None:
        import tide_triton

        out["heap_bytes"] = tide_triton.fsdp.heap_bytes(model)
    if device is not None and device.type == "cuda":
        import torch

        free, total = torch.cuda.mem_get_info(device)
        out.update(cuda_allocated=torch.cuda.memory_allocated(device), cuda_reserved=torch.cuda.memory_reserved(device),
                   cuda_used=total - free)
    return out


class _Leak:
    """Leaks of resources, one of each kind per step, injected to show the soak catches them:
    ``kinds`` is a comma-separated subset of ``shm`` (a /dev/shm file named as tide_triton
    names its heaps, never unlinked), ``fd`` (a descriptor never closed), ``thread``."""

    KINDS = ("shm", "fd", "thread")

    def __init__(self, kinds: str | None) -> None:
        self.kinds = [k for k in (kinds or "").split(",") if k]
        if any(k not in self.KINDS for k in self.kinds):
            raise ValueError(f"leak must name kinds among {self.KINDS}, comma-separated, got {kinds!r}")
        self.n = 0
        self.paths: list[str] = []
        self.fds: list[int] = []
        self.stop = threading.Event()

    def step(self) -> None:
        self.n += 1
        if "shm" in self.kinds:
            path = f"{_SHM}/tide_triton.{os.getpid()}.soakleak{self.n:06d}.0"
            with open(path, "wb") as f:
                f.truncate(4096)
            self.paths.append(path)
        if "fd" in self.kinds:
            self.fds.append(os.open(os.devnull, os.O_RDONLY))
        if "thread" in self.kinds:
            threading.Thread(target=self.stop.wait, daemon=True).start()

    def close(self) -> None:
        self.stop.set()
        for path in self.paths:
            os.unlink(path)
        for fd in self.fds:
            os.close(fd)


# --------------------------------------------------------------------------- one rank
def params_digest(model: Any) -> str:
    """SHA-256 over this rank's parameter shards, in name order (equal digests: equal bits)."""
    import torch

    h = hashlib.sha256()
    for name, p in sorted(model.named_parameters()):
        local = p.detach().to_local() if hasattr(p, "to_local") else p.detach()
        h.update(name.encode())
        h.update(local.cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def losses_digest(losses: Sequence[float]) -> str:
    """SHA-256 of the losses' JSON (a record without the losses still compares with stock's)."""
    return hashlib.sha256(json.dumps(list(losses)).encode()).hexdigest()


def rank_device(rank: int, cfg: SoakConfig):
    import torch

    if cfg.device == "cpu":
        return torch.device("cpu")
    n = torch.cuda.device_count()
    if n < 1:
        raise RuntimeError("--device cuda: no CUDA device is visible to torch; leave --device out for the CPU")
    return torch.device("cuda", rank % n if cfg.gpu_per_rank else 0)


def train(rank: int, world: int, mode: str, cfg: SoakConfig, emit: Callable[[dict], None],
          label: str | None = None) -> None:
    """Train ``cfg.steps`` steps in ``mode`` inside an initialised process group, emitting a
    sample every ``cfg.every`` steps (and at step 0, before training) and a final record,
    each under ``"mode": label`` (default: ``mode``)."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from train_llama import Llama, batch, bf16_policy, loss_fn, shard

    import tide_triton

    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    device = rank_device(rank, cfg)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    llama = cfg.llama()
    torch.manual_seed(0)
    model = Llama(llama).to(device)
    shard(model, init_device_mesh(device.type, (world,)), bf16_policy())
    tide = mode != "stock"
    if tide:  # the drop-in's own group, as a user gets it
        report = tide_triton.fsdp.enable(model, **ENABLE_KW[mode])
        stock = {k: v for k, v in report.items() if v is not None}
        if stock:
            raise RuntimeError(f"{mode}: modules left on stock FSDP2: {stock}")
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    leak = _Leak(cfg.leak)
    base = {"kind": "sample", "mode": label or mode, "enable": mode, "rank": rank, "world": world}
    losses: list[float] = []
    t0 = time.perf_counter()
    emit({**base, "step": 0, "loss": None, "t": 0.0, **sample(model if tide else None, device)})
    try:
        for step in range(1, cfg.steps + 1):
            loss = loss_fn(model, batch(llama, step, rank, cfg.batch, cfg.seq, device))
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())  # a device sync on CUDA: the sample sees the step done
            leak.step()
            if step % cfg.every == 0 or step == cfg.steps:
                if tide and device.type == "cuda":
                    tide_triton.synchronize(_group(model))
                emit({**base, "step": step, "loss": losses[-1], "t": round(time.perf_counter() - t0, 3),
                      **sample(model if tide else None, device)})
        final = {**base, "kind": "final", "steps": cfg.steps, "losses": losses, "losses_sha256": losses_digest(losses),
                 "params_sha256": params_digest(model),
                 "seconds": round(time.perf_counter() - t0, 2)}
        if tide:
            final["stats"] = tide_triton.fsdp.stats(model)
        emit(final)
    finally:
        leak.close()
    if tide:
        group = _group(model)
        tide_triton.fsdp.disable(model)
        group.close()


def _group(model: Any) -> Any:
    """The tide_triton group ``enable`` gave the model's root parameter group."""
    from tide_triton.fsdp._torch_adapter import param_groups
    from tide_triton.fsdp.install import group_state

    return group_state(param_groups(model)[0]).group


# --------------------------------------------------------------------------- launcher
def _rank(rank: int, world: int, mode: str, cfg: SoakConfig) -> None:
    """One rank of ``run_mode`` (a child of the tests' ``run_multiprocess``): its records go
    to the parent as they are made."""
    train(rank, world, mode, cfg, report)


def run_mode(mode: str, world: int, cfg: SoakConfig, on_record: Callable[[dict], None],
             wall_s: float = 86400.0) -> list[dict]:
    """Spawn ``world`` ranks training ``mode`` (``run_multiprocess``: a gloo group, the
    store in this process, ``cfg.env`` in theirs); ``on_record`` sees every record as it comes.
    Returns the records; raises ``RuntimeError`` naming the ranks that failed, died or did not
    finish within ``wall_s`` (their survivors killed)."""
    records: list[dict] = []

    def take(_rank: int, record: dict) -> None:
        records.append(record)
        on_record(record)

    run_multiprocess(_rank, world, mode, cfg, timeout=wall_s, pg_timeout=cfg.timeout_s, env=cfg.env,
                     on_message=take)
    return records


# --------------------------------------------------------------------------- summary
def _slope_per_1000(xs: Sequence[float], ys: Sequence[float]) -> float:
    n = len(xs)
    if n < 2:
        return 0.0
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    return 0.0 if sxx == 0 else 1000.0 * sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx


def series_summary(samples: Sequence[dict], key: str, warm_step: float) -> dict | None:
    """Flatness of one series after warm-up (module docstring), or None if not recorded."""
    pts = [(s["step"], s[key]) for s in samples if key in s and s["step"] > warm_step]
    if not pts:
        return None
    steps, vals = zip(*pts)
    first = vals[0]
    absolute, relative = TOLERANCE.get(key, (0, 0))
    tol = max(absolute, relative * abs(first))
    drift = max(vals) - first
    at = steps[vals.index(max(vals))]
    return {"start": next(s[key] for s in samples if key in s), "first": first, "last": vals[-1], "max": max(vals),
            "max_drift": drift, "at_step": at, "per_1000_steps": round(_slope_per_1000(steps, vals), 3),
            "tolerance": tol, "flat": drift <= tol}


def compare_losses(mine: Sequence[float], stock: Sequence[float]) -> dict:
    n = min(len(mine), len(stock))
    diffs = [i for i in range(n) if mine[i] != stock[i]]
    worst = max((abs(mine[i] - stock[i]) for i in diffs), default=0.0)
    return {"steps": n, "equal": not diffs and len(mine) == len(stock),
            "first_diff_step": diffs[0] + 1 if diffs else None, "steps_differing": len(diffs), "max_abs_diff": worst}


def summarize(records: Iterable[dict], warmup: float = 0.1) -> dict:
    """Per mode and rank: each judged series' flatness (:func:`series_summary`), the losses
    against stock's at every step, the parameter digest against stock's, the time."""
    records = list(records)
    finals = {(r["mode"], r["rank"]): r for r in records if r["kind"] == "final"}
    out: dict = {"kind": "summary", "modes": {}}
    for (mode, rank), fin in sorted(finals.items(), key=lambda kv: (MODES.index(kv[0][0]) if kv[0][0] in MODES else 99,
                                                                     kv[0][1])):
        warm_step = warmup * fin["steps"]
        samples = sorted((r for r in records if r["kind"] == "sample" and r["mode"] == mode and r["rank"] == rank),
                         key=lambda r: r["step"])
        row: dict = {"steps": fin["steps"], "seconds": fin["seconds"], "warmup_steps": math.floor(warm_step),
                     "series": {}}
        for key in TOLERANCE:
            s = series_summary(samples, key, warm_step)
            if s is not None:
                row["series"][key] = s
        row["flat"] = all(s["flat"] for s in row["series"].values())
        stock = finals.get(("stock", rank))
        if stock is not None and mode != "stock":
            if "losses" in fin and "losses" in stock:
                row["losses_vs_stock"] = compare_losses(fin["losses"], stock["losses"])
            else:  # a record kept without the per-step losses: their digests
                row["losses_vs_stock"] = {"steps": fin["steps"], "first_diff_step": None, "max_abs_diff": None,
                                          "equal": fin["losses_sha256"] == stock["losses_sha256"]}
            row["params_equal_stock"] = fin["params_sha256"] == stock["params_sha256"]
        if "stats" in fin:
            row["stats_total"] = {k: sum((v or {}).get(k, 0) for v in fin["stats"].values())
                                  for k in ("all_gathers", "reduce_scatters", "prepared_runs", "prepared_binds",
                                            "slot_all_gathers", "staged_reduce_scatters")}
        out["modes"].setdefault(mode, {})[rank] = row
    return out


def _mib(x: float) -> str:
    return f"{x / MIB:.1f}"


def _span(series: dict, key: str) -> str:
    """A count series after warm-up: its value, or first->last (+max drift)."""
    if key not in series:
        return "-"
    v = series[key]
    if v["max_drift"] == 0 and v["last"] == v["first"]:
        return f"{v['first']}"
    return f"{v['first']}->{v['last']} (+{v['max_drift']})"


def format_summary(summary: dict) -> str:
    lines = ["mode        rank steps   s     loss=stock  params=stock  rss MiB first/last/max drift (per 1k)   "
             "fds  threads  shm held/bytes/named  heap  flat"]
    for mode, ranks in summary["modes"].items():
        for rank, row in ranks.items():
            s = row["series"]
            lv = row.get("losses_vs_stock")
            loss = "-" if lv is None else "yes" if lv["equal"] else f"no@{lv['first_diff_step']} ({lv['max_abs_diff']})"
            par = "-" if "params_equal_stock" not in row else ("yes" if row["params_equal_stock"] else "no")
            r = s["rss"]
            rss = f"{_mib(r['first'])}/{_mib(r['last'])}/+{_mib(r['max_drift'])} ({_mib(r['per_1000_steps'])})"

            shm = f"{_span(s, 'shm_held')}/{_span(s, 'shm_held_bytes')}/{_span(s, 'shm_named')}"
            lines.append(f"{mode:<11} {rank:>4} {row['steps']:>5} {row['seconds']:>6.0f} {loss:<11} {par:<13} "
                         f"{rss:<38} {_span(s, 'fds'):<4} {_span(s, 'threads'):<8} {shm:<20} {_span(s, 'heap_bytes')} "
                         f"{'yes' if row['flat'] else 'NO: ' + ', '.join(k for k, v in s.items() if not v['flat'])}")
    return "\n".join(lines)


def versions() -> dict:
    import platform
    import subprocess

    import torch
    import triton

    try:
        commit = subprocess.run(["git", "-C", _ROOT, "rev-parse", "--short=12", "HEAD"], capture_output=True,
                                text=True, timeout=10).stdout.strip()
        dirty = bool(subprocess.run(["git", "-C", _ROOT, "status", "--porcelain", "--untracked-files=no"],
                                    capture_output=True, text=True, timeout=10).stdout.strip())
    except (OSError, subprocess.SubprocessError):
        commit, dirty = "", False
    out = {"torch": torch.__version__, "triton": triton.__version__, "python": platform.python_version(),
           "commit": commit + ("+dirty" if dirty else ""), "cpus": os.cpu_count(),
           "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}
    if torch.cuda.is_available():
        out["gpu"] = torch.cuda.get_device_name(0)
    return out


# --------------------------------------------------------------------------- CLI
def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    ap.add_argument("--world", type=int, default=2, help="processes (ranks)")
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--every", type=int, default=20, help="steps between samples")
    ap.add_argument("--warmup", type=float, default=0.1, help="fraction of the steps not judged (default 0.1)")
    ap.add_argument("--dim", type=int, default=SoakConfig.dim)
    ap.add_argument("--layers", type=int, default=SoakConfig.layers)
    ap.add_argument("--vocab", type=int, default=SoakConfig.vocab)
    ap.add_argument("--batch", type=int, default=SoakConfig.batch, help="sequences per rank")
    ap.add_argument("--seq", type=int, default=SoakConfig.seq)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--gpu-per-rank", action="store_true", help="rank r on cuda:r %% n (default: all on cuda:0)")
    ap.add_argument("--parallel", action="store_true",
                    help="run the modes at once (W processes each) instead of one after the other")
    ap.add_argument("--out", default="soak.jsonl", help="JSON lines (appended)")
    ap.add_argument("--summarize", metavar="JSONL", help="only print the summary of a recorded run")
    a = ap.parse_args(argv)
    if a.summarize:
        with open(a.summarize) as f:
            recs = [json.loads(line) for line in f if line.strip()]
        print(format_summary(summarize((r for r in recs if r["kind"] in ("sample", "final")), a.warmup)))
        return 0
    if a.steps < 1 or a.every < 1 or a.world < 2 or not 0 <= a.warmup < 1:
        ap.error("need --steps >= 1, --every >= 1, --world >= 2 and 0 <= --warmup < 1")
    if a.dim % 8:
        ap.error(f"--dim must be a multiple of 8 (4 heads of an even size), got {a.dim}")
    env = {"TIDE_TRITON_CPU_KERNELS": os.environ.get("TIDE_TRITON_CPU_KERNELS", "torch")}
    if a.device == "cuda":
        env.update(MULTICAST_OFF, CUDA_DEVICE_MAX_CONNECTIONS="8", CUDA_MODULE_LOADING="LAZY")
    cfg = SoakConfig(steps=a.steps, every=a.every, warmup=a.warmup, dim=a.dim, layers=a.layers, vocab=a.vocab,
                     batch=a.batch, seq=a.seq, device=a.device, gpu_per_rank=a.gpu_per_rank, env=env)
    head = {"kind": "config", **versions(), "world": a.world, "modes": a.modes, "argv": sys.argv[1:],
            **{k: v for k, v in asdict(cfg).items() if k != "env"}}
    print(json.dumps(head), flush=True)
    records: list[dict] = []
    with open(a.out, "a") as out:
        out.write(json.dumps(head) + "\n")

        lock = threading.Lock()

        def on_record(r: dict) -> None:
            with lock:
                out.write(json.dumps(r) + "\n")
                out.flush()
            if r["kind"] == "sample" and r["rank"] == 0 and r["step"] % (10 * a.every) == 0:
                print(f"{r['mode']:<10} step {r['step']:>5}  loss {r['loss'] if r['loss'] is not None else '-':<20} "
                      f"rss {_mib(r['rss'])} MiB  fds {r['fds']}  threads {r['threads']}  shm held {r['shm_held']} "
                      f"({_mib(r['shm_held_bytes'])} MiB)  {r['t']:.0f} s", flush=True)

        def one(mode: str) -> list[dict]:
            t0 = time.perf_counter()
            recs = run_mode(mode, a.world, cfg, on_record)
            print(f"{mode}: {a.steps} steps in {time.perf_counter() - t0:.0f} s", flush=True)
            return recs

        if a.parallel:  # every mode's ranks at once (each still its own processes)
            from concurrent.futures import ThreadPoolExecutor

            with ThreadPoolExecutor(len(a.modes)) as ex:
                for recs in list(ex.map(one, a.modes)):
                    records += recs
        else:
            for mode in a.modes:
                records += one(mode)
        summary = summarize(records, a.warmup)
        summary["config"] = head
        out.write(json.dumps(summary) + "\n")
    print(format_summary(summary))
    # bit-equal losses are the promise only where the math is stock's: W=2 on the CPU
    exact = a.device == "cpu" and a.world == 2
    return 0 if all(row["flat"] and (not exact or row.get("losses_vs_stock", {"equal": True})["equal"])
                    for ranks in summary["modes"].values() for row in ranks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
