"""What a user runs today: FSDP2's collective path on torch.distributed (NCCL) -- the baseline
tide_triton's collectives are compared with.

    python bench/nccl_baseline.py --world-sizes 2 4 8 --models llama-3.1-70b qwen3-30b-a3b --json out.jsonl
    # CPU smoke run (logic only, times mean nothing):
    python bench/nccl_baseline.py --backend gloo --device cpu --world-sizes 2 --models tiny

The script spawns W processes itself for every W (multiprocessing 'spawn', MASTER_ADDR /
MASTER_PORT on a free local port), rank r on ``cuda:r % number of GPUs`` (the torchrun
convention); ``--share-gpu`` puts every rank on cuda:0, as the recorded one-GPU runs did.  Children get
``NCCL_MULTI_RANK_GPU_ENABLE=1`` (several ranks per GPU needs NCCL >= 2.30; older NCCL fails
with "Duplicate GPU detected") and keep ``NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
NVSHMEM_DISABLE_NVLS=1`` (forced to those values, never unset: no multicast objects).

Per model layer, the tensors are per-parameter, as FSDP2 holds them: unsharded bf16 grads with
the layer's shapes, padded bf16 shards ``(c, *rest)`` with ``c = ceil(dim0 / W)``, padded
unsharded bf16 parameter storage ``(W*c, *rest)``.  Timed (each ``op``):

a. FSDP2's reduce-scatter path with ``reduce_dtype=fp32``: ``torch.ops.fsdp.chunk_cat`` (or the
   same thing emulated: each grad padded to W*c rows, viewed (W, -1), concatenated along dim 1)
   from the bf16 grads into an fp32 (W, F) buffer, then ``dist.reduce_scatter_tensor(out_fp32,
   in_fp32, op=AVG)`` -- ``rs32.chunk_cat``, ``rs32.reduce_scatter``, ``rs32.total``;
b. NCCL's own bf16 reduce-scatter of the same layer (chunk_cat into a bf16 buffer, bf16
   reduce_scatter_tensor AVG) -- ``rs16.*``;
c. FSDP2's all-gather path: ``ag.copy_in`` (FSDP2's all_gather_copy_in body:
   ``_foreach_copy_`` of the padded shards into this rank's slice of the flat output),
   ``ag.all_gather`` (bf16 ``all_gather_into_tensor``, in place), ``ag.copy_out``
   (``torch.ops.fsdp.split_with_sizes_copy`` -- else ``torch.split_with_sizes_copy`` -- of the
   (W, F) output, split dim 1 by the padded shard numels S_p, into the parameters viewed (W, S_p)),
   ``ag.total`` (all three).
   With gloo (CPU smoke) AVG does not exist: SUM is used and the row says so.

Timing: on each rank, CUDA events on the rank's own stream around each call; ``warmup`` calls,
then ``iters`` timed calls, each preceded by a barrier (a 1-element all_reduce + synchronize, so
all ranks start together); the rank's median.  A row reports rank 0's median and the max of the
ranks' medians.  Processes sharing a GPU time-slice (no MPS): their kernels do not run at once.

d. SM time of one call of each path, on rank 0 (all ranks run the call, rank 0 alone under
   ``torch.profiler.profile(activities=[CUDA])``): the chrome trace is exported to a temp file and
   parsed by :func:`sm_time_from_trace` (importable: ``from bench.nccl_baseline import
   sm_time_from_trace``; interference.py reuses it for tide_triton's kernels):

       SM-seconds = sum over kernels k of dur_k * min(ctas_k, n_SM) / n_SM

   ctas_k = grid_x * grid_y * grid_z of the kernel event's ``args["grid"]``; n_SM = the device's
   multiprocessor count.  It is the fraction of the GPU's SMs a kernel occupies times its duration,
   summed: the GPU-equivalent time the kernels hold SMs (reported in µs, "SM µs").  Upper bound of
   sorts: a kernel with fewer CTAs than SMs is counted as holding ctas_k SMs for its whole
   duration; a persistent NCCL kernel spinning on a peer (or descheduled while the GPU time-slices
   to another process) counts for all that time -- which is what it costs a GEMM next to it.
   Copy-engine work (``gpu_memcpy`` events) holds no SM and is reported separately.

NCCL version: the parent prints ``torch.cuda.nccl.version()`` and the runtime version of the
loaded libnccl (``ncclGetVersion`` via ctypes on the path found in /proc/self/maps); every row
carries both.  Several ranks on one GPU need NCCL >= 2.30: if the runtime NCCL is older and
ranks would share a GPU, or a rank fails with "Duplicate GPU detected", the W is reported as
failed with a message saying how to load a newer NCCL: ``LD_PRELOAD=/path/to/libnccl.so.2`` in
the environment of this script (never by replacing the files of torch's installed package).
"""
from __future__ import annotations

import argparse
import ctypes
import datetime as _dt
import faulthandler
import json
import math
import os
import queue as _queue
import socket
import statistics
import sys
import tempfile
import time
import traceback
from typing import Any, Callable, Sequence

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

import torch  # noqa: E402

# A tiny shape set for the CPU smoke run: 2-D, 1-D, 3-D, dim 0 below W, a prime dim 0.
TINY_SHAPES: tuple[tuple[int, ...], ...] = ((64, 48), (7, 48), (48,), (3, 5, 4), (1, 6, 8), (13,))

FORCED_ENV = {
    "NCCL_MULTI_RANK_GPU_ENABLE": "1",
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}

NOT_SWAPPED = ("NCCL refused several ranks on one GPU: load NCCL >= 2.30 for this script with "
               "LD_PRELOAD=/path/to/libnccl.so.2 in its environment (never by replacing torch's own files), "
               "and check that NCCL_MULTI_RANK_GPU_ENABLE=1 reaches the ranks; or run at most one rank per GPU")


# --------------------------------------------------------------------------- helpers (importable)
def shapes_of(model: str) -> tuple[tuple[int, ...], ...]:
    if model == "tiny":
        return TINY_SHAPES
    from tide_triton.plan.workloads import layer_shapes

    return layer_shapes(model)


def _ctas(grid: Any) -> int | None:
    if isinstance(grid, (list, tuple)) and grid:
        try:
            return int(math.prod(int(g) for g in grid))
        except (TypeError, ValueError):
            return None
    if isinstance(grid, (int, float)):
        return int(grid)
    return None


def sm_time_from_trace(path: str, n_sm: int, name_filter: Callable[[str], bool] | None = None) -> dict:
    """SM time of the kernels in a torch.profiler chrome trace (``export_chrome_trace``).

    ``SM µs = sum_k dur_k * min(ctas_k, n_sm) / n_sm`` over events with ``cat == "kernel"``
    (``dur`` in µs, ``ctas_k`` the product of ``args["grid"]``; a kernel event without a grid
    counts as holding every SM).  Returns ``sm_us``, ``kernel_us`` (sum of durations),
    ``n_kernels``, ``memcpy_us`` / ``n_memcpy`` (copy-engine events, no SM), and ``kernels``: per
    kernel name, count, total dur, total SM µs, CTAs and ``blocks per SM`` (if the trace has it).
    ``name_filter`` keeps only kernels whose name it accepts."""
    if n_sm <= 0:
        raise ValueError(f"n_sm must be > 0, got {n_sm}")
    with open(path) as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    sm_us = kernel_us = memcpy_us = 0.0
    n_k = n_m = 0
    per: dict[str, dict] = {}
    for e in events:
        if not isinstance(e, dict) or e.get("ph") not in (None, "X"):
            continue
        cat = str(e.get("cat", "")).lower()
        dur = float(e.get("dur", 0.0) or 0.0)
        if cat == "gpu_memcpy":
            memcpy_us += dur
            n_m += 1
            continue
        if cat != "kernel":
            continue
        name = str(e.get("name", "?"))
        if name_filter is not None and not name_filter(name):
            continue
        args = e.get("args", {}) or {}
        ctas = _ctas(args.get("grid"))
        held = n_sm if ctas is None else min(ctas, n_sm)
        s = dur * held / n_sm
        sm_us += s
        kernel_us += dur
        n_k += 1
        k = per.setdefault(name, {"name": name, "count": 0, "dur_us": 0.0, "sm_us": 0.0, "ctas": ctas,
                                  "blocks_per_sm": args.get("blocks per SM")})
        k["count"] += 1
        k["dur_us"] += dur
        k["sm_us"] += s
    kernels = sorted(per.values(), key=lambda k: -k["sm_us"])
    return {"sm_us": sm_us, "kernel_us": kernel_us, "n_kernels": n_k, "memcpy_us": memcpy_us,
            "n_memcpy": n_m, "kernels": kernels}


def profile_sm_time(fn: Callable[[], None], device: torch.device,
                    name_filter: Callable[[str], bool] | None = None) -> dict:
    """Run ``fn`` once under the CUDA profiler (synchronising the device at the end) and
    return :func:`sm_time_from_trace` of it.  On CPU: ``{"sm_us": None, ...}`` after running
    ``fn`` under a CPU profile (the export and parse are exercised; there are no kernels)."""
    from torch.profiler import ProfilerActivity, profile

    gpu = device.type == "cuda"
    acts = [ProfilerActivity.CUDA] if gpu else [ProfilerActivity.CPU]
    fd, path = tempfile.mkstemp(suffix=".json", prefix="tide_sm_trace_")
    os.close(fd)
    try:
        with profile(activities=acts) as prof:
            fn()
            if gpu:
                torch.cuda.synchronize(device)
        prof.export_chrome_trace(path)
        n_sm = torch.cuda.get_device_properties(device).multi_processor_count if gpu else 1
        res = sm_time_from_trace(path, n_sm, name_filter)
        res["n_sm"] = n_sm
        if not gpu:
            res["sm_us"] = None
        return res
    finally:
        try:
            os.unlink(path)
        except OSError:
            pass


def short_kernel_names(res: dict, n: int = 4, width: int = 48) -> str:
    names = []
    for k in res.get("kernels", [])[:n]:
        nm = k["name"]
        nm = nm if len(nm) <= width else nm[: width - 1] + "…"
        names.append(f"{nm} x{k['count']} ({k['ctas']} CTAs)")
    more = len(res.get("kernels", [])) - n
    return "; ".join(names) + (f"; +{more} more" if more > 0 else "")


def nccl_versions() -> dict:
    """``torch.cuda.nccl.version()`` and the runtime version of the libnccl in effect in this
    process (ctypes ``ncclGetVersion`` on the library in ``LD_PRELOAD``, else on the first
    found in /proc/self/maps)."""
    out: dict = {}
    try:
        v = torch.cuda.nccl.version()
        out["nccl_torch"] = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
    except Exception as e:  # noqa: BLE001
        out["nccl_torch"] = f"n/a ({type(e).__name__}: {e})"
    # A library in LD_PRELOAD is the one every NCCL symbol binds to (bench/gpu_env.sh's
    # with_nccl); torch's own libnccl is then mapped too, often first in /proc/self/maps.
    preloaded = [p for p in os.environ.get("LD_PRELOAD", "").replace(":", " ").split()
                 if os.path.basename(p).startswith("libnccl") and os.path.exists(p)]
    path = preloaded[0] if preloaded else None
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                parts = line.split()
                if path is None and len(parts) >= 6 and os.path.basename(parts[-1]).startswith("libnccl"):
                    path = parts[-1]
                    break
    except OSError:
        pass
    out["libnccl_path"] = path or "none mapped (NCCL statically linked into torch, or no CUDA build)"
    out["nccl_runtime"] = "n/a"
    if path:
        try:
            lib = ctypes.CDLL(path)
            code = ctypes.c_int(0)
            rc = lib.ncclGetVersion(ctypes.byref(code))
            c = code.value
            if rc != 0:
                out["nccl_runtime"] = f"ncclGetVersion returned {rc}"
            elif c >= 10000:  # NCCL >= 2.9: major*10000 + minor*100 + patch
                out["nccl_runtime"] = f"{c // 10000}.{(c % 10000) // 100}.{c % 100}"
            else:
                out["nccl_runtime"] = f"{c // 1000}.{(c % 1000) // 100}.{c % 100}"
            out["nccl_runtime_code"] = c
        except Exception as e:  # noqa: BLE001
            out["nccl_runtime"] = f"n/a ({type(e).__name__}: {e})"
    return out


def _version_tuple(s: str) -> tuple[int, ...] | None:
    try:
        return tuple(int(x) for x in s.split(".")[:3])
    except (ValueError, AttributeError):
        return None


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --------------------------------------------------------------------------- FSDP2 ops
def _register_fsdp_ops() -> None:
    """torch.ops.fsdp.* exist once FSDP2's collectives module is imported."""
    try:
        import torch.distributed.fsdp._fully_shard._fsdp_collectives  # noqa: F401
    except Exception:  # noqa: BLE001
        pass


def _chunk_cat_fn() -> tuple[Callable, str]:
    _register_fsdp_ops()
    op = getattr(getattr(torch.ops, "fsdp", None), "chunk_cat", None)
    try:
        if op is not None:
            op.default  # noqa: B018  (resolves the overload: raises if not registered)
            return (lambda ts, W, out: op(ts, dim=0, num_chunks=W, out=out)), "torch.ops.fsdp.chunk_cat"
    except Exception:  # noqa: BLE001
        pass

    def emulate(ts: Sequence[torch.Tensor], W: int, out: torch.Tensor) -> None:
        # each grad padded to W*c rows, viewed (W, -1), concatenated along dim 1 (cast to out's dtype)
        col = 0
        for t in ts:
            rows = t.shape[0]
            rowlen = t.numel() // rows if rows else math.prod(t.shape[1:])
            c = -(-rows // W)
            per = c * rowlen
            dst = out[:, col: col + per].view(W, c, rowlen) if per else None
            flat = t.reshape(rows, rowlen)
            for k in range(W if per else 0):
                r = max(0, min(rows - k * c, c))
                dst[k, :r].copy_(flat[k * c: k * c + r])
                dst[k, r:].zero_()
            col += per

    return emulate, "emulated chunk_cat (pad, view (W,-1), cat dim 1)"


def _split_copy_fn() -> tuple[Callable, str]:
    _register_fsdp_ops()
    op = getattr(getattr(torch.ops, "fsdp", None), "split_with_sizes_copy", None)
    try:
        if op is not None:
            op.default  # noqa: B018
            return (lambda src, sizes, outs: op(src, sizes, dim=1, out=outs)), "torch.ops.fsdp.split_with_sizes_copy"
    except Exception:  # noqa: BLE001
        pass
    return (lambda src, sizes, outs: torch.split_with_sizes_copy(src, sizes, dim=1, out=outs)), \
        "torch.split_with_sizes_copy"


# --------------------------------------------------------------------------- ranks
class _Rank:
    def __init__(self, rank: int, W: int, dev: torch.device, a: dict) -> None:
        import torch.distributed as dist

        self.dist, self.rank, self.W, self.dev, self.a = dist, rank, W, dev, a
        self.gpu = dev.type == "cuda"
        self.flag = torch.ones(1, device=dev)
        self.avg = a["backend"] == "nccl"
        self.op = dist.ReduceOp.AVG if self.avg else dist.ReduceOp.SUM

    def barrier(self) -> None:
        self.dist.all_reduce(self.flag, op=self.dist.ReduceOp.MAX)
        if self.gpu:
            torch.cuda.synchronize(self.dev)

    def all_ok(self, ok: bool) -> bool:
        t = torch.tensor([1.0 if ok else 0.0], device=self.dev)
        self.dist.all_reduce(t, op=self.dist.ReduceOp.MIN)
        return bool(t.item() == 1.0)

    def time_ms(self, fn: Callable[[], None]) -> float:
        for _ in range(self.a["warmup"]):
            fn()
        times = []
        for _ in range(self.a["iters"]):
            self.barrier()
            if self.gpu:
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s.record()
                fn()
                e.record()
                e.synchronize()
                times.append(s.elapsed_time(e))
            else:
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)

    def profile(self, fn: Callable[[], None]) -> dict | None:
        """All ranks run fn once; rank 0 under the profiler."""
        self.barrier()
        res = None
        if self.rank == 0:
            res = profile_sm_time(fn, self.dev)
        else:
            fn()
            if self.gpu:
                torch.cuda.synchronize(self.dev)
        self.barrier()
        return res


def _model_rows(R: _Rank, model: str, send: Callable[..., None]) -> None:
    W, dev, rank = R.W, R.dev, R.rank
    from tide_triton.plan.layout import ShardLayout

    shapes = shapes_of(model)
    layout = ShardLayout(shapes, W)
    F = layout.flat_shard_numel
    Sp = list(layout.padded_shard_numels)
    chunk_cat, cc_name = _chunk_cat_fn()
    split_copy, sc_name = _split_copy_fn()
    prof = R.a["profile"]

    def part(name: str, setup: Callable[[], Any], run: Callable[[Any], dict]) -> None:
        """setup (allocations, no collective) -> every rank agrees it succeeded -> run.
        A failed setup on any rank skips the part on every rank (nobody waits in a
        collective); a failure inside run is reported (a rank stuck in a collective is
        caught by the hang guard)."""
        err = None
        state = None
        try:
            state = setup()
        except Exception as e:  # noqa: BLE001
            err = f"{type(e).__name__}: {e}"
            send("error", model=model, part=name, error=f"setup: {err}", tb=traceback.format_exc(limit=3))
        if not R.all_ok(err is None):
            if err is None:
                send("error", model=model, part=name, error="skipped: another rank failed its setup")
        else:
            try:
                for op, val in run(state).items():
                    send("value", model=model, op=op, value=val)
            except Exception as e:  # noqa: BLE001
                send("error", model=model, part=name, error=f"{type(e).__name__}: {e}",
                     tb=traceback.format_exc(limit=3))
        del state
        if R.gpu:
            torch.cuda.synchronize(dev)
            torch.cuda.empty_cache()

    def rs_setup(dtype: torch.dtype) -> Callable[[], dict]:
        def setup() -> dict:
            grads = [torch.randn(s, device=dev, dtype=torch.bfloat16) for s in shapes]
            rs_in = torch.empty(W * F, dtype=dtype, device=dev)
            return dict(grads=grads, rs_in=rs_in, rs_out=torch.empty(F, dtype=dtype, device=dev))
        return setup

    def rs_run(dtype: torch.dtype, tag: str) -> Callable[[dict], dict]:
        def run(st: dict) -> dict:
            grads, rs_in, rs_out = st["grads"], st["rs_in"], st["rs_out"]
            v = rs_in.view(W, -1)
            cc = lambda: chunk_cat(grads, W, v)  # noqa: E731
            red = lambda: R.dist.reduce_scatter_tensor(rs_out, rs_in, op=R.op)  # noqa: E731

            def both() -> None:
                cc()
                red()

            out = {f"{tag}.chunk_cat": {"ms": R.time_ms(cc), "impl": cc_name},
                   f"{tag}.reduce_scatter": {"ms": R.time_ms(red),
                                             "impl": f"reduce_scatter_tensor {str(dtype)[6:]} "
                                                     f"{'AVG' if R.avg else 'SUM (gloo: no AVG)'}"},
                   f"{tag}.total": {"ms": R.time_ms(both), "impl": "chunk_cat + reduce_scatter_tensor"}}
            if prof:
                res = R.profile(both)
                if res is not None:
                    out[f"{tag}.sm"] = {"sm": res}
            return out
        return run

    def ag_setup() -> dict:
        shards = [torch.randn(s, device=dev, dtype=torch.bfloat16) for s in layout.shard_shapes(rank, padded=True)]
        params = [torch.empty(s, dtype=torch.bfloat16, device=dev) for s in layout.padded_shapes]
        return dict(shards=shards, params=params, ag_out=torch.empty(W * F, dtype=torch.bfloat16, device=dev))

    def ag_run(st: dict) -> dict:
        ag_out = st["ag_out"]
        ag_in = ag_out.narrow(0, rank * F, F)
        dsts = list(torch.split(ag_in, Sp))
        srcs = [x.view(-1) for x in st["shards"]]
        outs = [p.view(W, -1) for p in st["params"]]
        v = ag_out.view(W, -1)

        def copy_in() -> None:
            with torch.no_grad():
                torch._foreach_copy_(dsts, srcs)

        gather = lambda: R.dist.all_gather_into_tensor(ag_out, ag_in)  # noqa: E731
        copy_out = lambda: split_copy(v, Sp, outs)  # noqa: E731

        def total() -> None:
            copy_in()
            gather()
            copy_out()

        out = {"ag.copy_in": {"ms": R.time_ms(copy_in), "impl": "_foreach_copy_ (all_gather_copy_in)"},
               "ag.all_gather": {"ms": R.time_ms(gather), "impl": "all_gather_into_tensor bf16"},
               "ag.copy_out": {"ms": R.time_ms(copy_out), "impl": sc_name},
               "ag.total": {"ms": R.time_ms(total), "impl": "copy-in + all_gather + copy-out"}}
        if prof:
            res = R.profile(total)
            if res is not None:
                out["ag.sm"] = {"sm": res}
        return out

    part("rs32", rs_setup(torch.float32), rs_run(torch.float32, "rs32"))
    part("rs16", rs_setup(torch.bfloat16), rs_run(torch.bfloat16, "rs16"))
    part("ag", ag_setup, ag_run)


def _worker(rank: int, W: int, a: dict, port: int, q: Any) -> None:
    import warnings

    warnings.filterwarnings("ignore", category=FutureWarning)  # all_gather_into_tensor (torch >= 2.12)
    faulthandler.dump_traceback_later(a["timeout"], exit=True, file=sys.stderr)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), **FORCED_ENV)

    def send(kind: str, **kw: Any) -> None:
        q.put({"kind": kind, "rank": rank, **kw})

    try:
        import torch.distributed as dist

        dev = (torch.device("cuda", 0 if a["share_gpu"] else rank % torch.cuda.device_count())
               if a["device"] == "cuda" else torch.device("cpu"))
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
        kw: dict = dict(backend=a["backend"], rank=rank, world_size=W,
                        timeout=_dt.timedelta(seconds=a["timeout"]))
        if a["backend"] == "nccl":
            kw["device_id"] = dev  # eager NCCL init: a refused GPU sharing fails here
        dist.init_process_group(**kw)
        R = _Rank(rank, W, dev, a)
        R.barrier()  # first collective: NCCL must accept W ranks on this GPU
        if rank == 0:
            send("versions", **nccl_versions())
    except Exception as e:  # noqa: BLE001
        msg = f"{type(e).__name__}: {e}"
        if "duplicate gpu" in msg.lower() or "invalid usage" in msg.lower():
            msg = f"{NOT_SWAPPED}. ({msg.strip()[:400]})"
        send("fatal", error=msg, tb=traceback.format_exc(limit=4))
        send("done")
        return
    for model in a["models"]:
        try:
            _model_rows(R, model, send)
        except Exception as e:  # noqa: BLE001
            send("error", model=model, part="*", error=f"{type(e).__name__}: {e}")
    send("done")
    try:
        dist.barrier() if a["backend"] == "gloo" else R.barrier()
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001
        pass
    faulthandler.cancel_dump_traceback_later()


def run_world(W: int, a: dict) -> tuple[dict, list[str], dict]:
    """Spawn W ranks; returns ({(model, op): {rank: value}}, errors, versions from rank 0)."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, W, a, port, q), daemon=False) for r in range(W)]
    for p in procs:
        p.start()
    vals: dict = {}
    errors: list[str] = []
    versions: dict = {}
    done: set[int] = set()
    deadline = time.monotonic() + a["timeout"] + 60
    while len(done) < W:
        try:
            m = q.get(timeout=1.0)
        except _queue.Empty:
            if time.monotonic() > deadline:
                errors.append(f"W={W}: timed out after {a['timeout'] + 60:.0f} s "
                              f"(ranks not done: {sorted(set(range(W)) - done)})")
                break
            dead = [r for r, p in enumerate(procs) if not p.is_alive() and r not in done]
            if dead:
                time.sleep(2.0)  # let queued messages arrive
                while True:
                    try:
                        m = q.get_nowait()
                    except _queue.Empty:
                        break
                    _absorb(m, vals, errors, versions, done)
                dead = [r for r in dead if r not in done]
                if dead:
                    errors.append(f"W={W}: rank(s) {dead} exited without finishing "
                                  f"(exit codes {[procs[r].exitcode for r in dead]})")
                    break
            continue
        _absorb(m, vals, errors, versions, done)
    for p in procs:
        p.join(30)
    for p in procs:
        if p.is_alive():
            p.terminate()
            p.join(10)
        if p.is_alive():
            p.kill()
            p.join(5)
    return vals, errors, versions


def _absorb(m: dict, vals: dict, errors: list[str], versions: dict, done: set) -> None:
    k = m["kind"]
    if k == "done":
        done.add(m["rank"])
    elif k == "versions":
        versions.update({x: y for x, y in m.items() if x not in ("kind", "rank")})
    elif k == "value":
        vals.setdefault((m["model"], m["op"]), {})[m["rank"]] = m["value"]
    elif k == "fatal":
        errors.append(f"rank {m['rank']}: {m['error']}")
        done.add(m["rank"])
        print(m.get("tb", ""), file=sys.stderr)
    elif k == "error":
        errors.append(f"rank {m['rank']} {m['model']} {m['part']}: {m['error']}")
        if m.get("tb"):
            print(m["tb"], file=sys.stderr)


# --------------------------------------------------------------------------- CLI
def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world-sizes", nargs="+", type=int, default=[2, 4, 8])
    ap.add_argument("--models", nargs="+", default=["llama-3.1-70b", "qwen3-30b-a3b"],
                    help="layer shape sets from tide_triton.plan.workloads, or 'tiny'")
    ap.add_argument("--backend", default="nccl", choices=["nccl", "gloo"])
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--no-profile", action="store_true", help="skip the SM-time rows (d)")
    ap.add_argument("--timeout", type=float, default=300.0,
                    help="per world size: collective timeout and hang guard of every rank (s)")
    ap.add_argument("--share-gpu", action="store_true",
                    help="every rank on cuda:0 (needs NCCL >= 2.30; default: rank r on cuda:r %% number of GPUs)")
    ap.add_argument("--json", default=None, help="append result rows (with env info) to this JSON-lines file")
    args = ap.parse_args(argv)
    faulthandler.dump_traceback_later(len(args.world_sizes) * (args.timeout + 120) + 60, exit=True)

    for k, v in FORCED_ENV.items():
        os.environ[k] = v
    from tide_triton.bench.measure import env_info

    dev = torch.device(args.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device is visible to torch; use --backend gloo --device cpu for the "
                 "CPU smoke run")
    info = env_info(dev)
    vers = nccl_versions()
    print(f"{info['gpu']} | torch {info['torch']} | triton {info['triton']} | CUDA {info['cuda']} | "
          f"git {info['git_sha']} | {info['date']}")
    print(f"NCCL: torch.cuda.nccl.version() = {vers['nccl_torch']} | runtime ncclGetVersion = "
          f"{vers['nccl_runtime']} | library {vers['libnccl_path']}")
    print("env for the ranks: " + " ".join(f"{k}={v}" for k, v in FORCED_ENV.items()))
    rt = _version_tuple(vers["nccl_runtime"]) or _version_tuple(vers["nccl_torch"])
    n_gpu = torch.cuda.device_count() if dev.type == "cuda" else 0
    shares = args.share_gpu or any(W > n_gpu for W in args.world_sizes)  # several ranks on one GPU
    too_old = args.backend == "nccl" and shares and rt is not None and rt < (2, 30)
    if too_old:
        print(f"ERROR: NCCL {'.'.join(map(str, rt))} is loaded; several ranks on one GPU need NCCL >= 2.30 "
              f"with NCCL_MULTI_RANK_GPU_ENABLE=1. {NOT_SWAPPED}.", file=sys.stderr)
    a = dict(models=args.models, backend=args.backend, device=args.device, share_gpu=args.share_gpu, iters=args.iters,
             warmup=args.warmup, profile=not args.no_profile, timeout=args.timeout)

    ops = ["rs32.chunk_cat", "rs32.reduce_scatter", "rs32.total", "rs16.chunk_cat", "rs16.reduce_scatter",
           "rs16.total", "ag.copy_in", "ag.all_gather", "ag.copy_out", "ag.total"]
    time_lines = ["| model | W | op | implementation | rank 0 median (ms) | max over ranks (ms) |",
                  "|---|---|---|---|---|---|"]
    sm_lines = ["| model | W | path (one call, rank 0) | SM µs (GPU-equivalent) | kernel µs | kernels | "
                "copy-engine µs | kernel names |", "|---|---|---|---|---|---|---|---|"]
    all_errors: list[str] = []
    rc = 0
    for W in args.world_sizes:
        if too_old and W > 1 and (args.share_gpu or W > n_gpu):
            all_errors.append(f"W={W}: skipped, {NOT_SWAPPED}")
            rc = 1
            continue
        t0 = time.perf_counter()
        try:
            vals, errors, rvers = run_world(W, a)
        except Exception as e:  # noqa: BLE001
            vals, errors, rvers = {}, [f"W={W}: {type(e).__name__}: {e}"], {}
        print(f"[W={W}: {time.perf_counter() - t0:.1f} s]", flush=True)
        for e in errors:
            print(f"  ERROR {e}", flush=True)
        all_errors += errors
        if any(NOT_SWAPPED in e for e in errors):
            rc = 1
        if rvers:
            vers = {**vers, **{f"rank0_{k}": v for k, v in rvers.items()}}
        rows = []
        for model in args.models:
            for op in ops + ["rs32.sm", "rs16.sm", "ag.sm"]:
                per = vals.get((model, op))
                if not per:
                    continue
                row = dict(script="nccl_baseline", model=model, world_size=W, op=op, backend=args.backend,
                           share_gpu=args.share_gpu, gpus_used=1 if args.share_gpu else min(W, max(n_gpu, 1)),
                           device=args.device, iters=args.iters, warmup=args.warmup, **vers, **info)
                if op.endswith(".sm"):
                    res = per.get(0, {}).get("sm")
                    if res is None:
                        continue
                    row.update(sm_us=res["sm_us"], kernel_us=res["kernel_us"], n_kernels=res["n_kernels"],
                               memcpy_us=res["memcpy_us"], n_sm=res.get("n_sm"), kernels=res["kernels"])
                    sm = "n/a (CPU)" if res["sm_us"] is None else f"{res['sm_us']:.1f}"
                    sm_lines.append(f"| {model} | {W} | {op[:-3]} | {sm} | {res['kernel_us']:.1f} | "
                                    f"{res['n_kernels']} | {res['memcpy_us']:.1f} | {short_kernel_names(res)} |")
                else:
                    ms = {r: v["ms"] for r, v in per.items()}
                    impl = next(iter(per.values()))["impl"]
                    row.update(impl=impl, rank0_ms=ms.get(0), max_ms=max(ms.values()),
                               per_rank_ms=[ms.get(r) for r in range(W)], ranks_reported=len(ms))
                    r0 = f"{ms[0]:.3f}" if 0 in ms else "n/a"
                    time_lines.append(f"| {model} | {W} | {op} | {impl} | {r0} | {max(ms.values()):.3f}"
                                      f"{'' if len(ms) == W else f' ({len(ms)}/{W} ranks)'} |")
                rows.append(row)
        if args.json and rows:
            try:
                with open(args.json, "a") as f:
                    for row in rows:
                        f.write(json.dumps(row, default=str) + "\n")
            except OSError as e:
                print(f"  ERROR writing {args.json}: {e}")
    print()
    print("\n".join(time_lines))
    print()
    print("SM time: SM µs = sum_k dur_k * min(ctas_k, n_SM) / n_SM over the call's kernels (rank 0)")
    print("\n".join(sm_lines))
    if all_errors:
        print(f"\n{len(all_errors)} error(s):")
        for e in all_errors:
            print(f"  {e}")
    if args.json:
        print(f"rows appended to {args.json}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
