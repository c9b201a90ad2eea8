"""Collective timings in two launch modes.  Single-process multi-rank mode (default: one
thread per rank, each with its own heap and copy stream, so ranks' work overlaps as on a
node; the ranks share one interpreter lock, so host cost grows with W^2), or one process per
rank as users run it (under ``torchrun``: the world size is torchrun's).  Rank r runs on
``cuda:r % torch.cuda.device_count()`` (the torchrun convention); ``--share-gpu`` puts every
rank on cuda:0 (how the recorded one-GPU runs were made).

    python bench/collectives_gpu.py [--world-sizes 2 4] [--models llama-3.1-70b qwen3-30b-a3b synthetic-moe-256e]
    torchrun --nproc-per-node 2 bench/collectives_gpu.py --share-gpu --models qwen3-30b-a3b --json rows.jsonl
    python bench/collectives_gpu.py --json rows.jsonl --plot collectives.png
    python bench/collectives_gpu.py --plot collectives.png --from rows.jsonl [nccl_rows.jsonl]

``--plot`` draws time and bandwidth against world size for tide_triton and, where the rows
have them (``bench/nccl_baseline.py --json`` rows passed to ``--from``), for NCCL on FSDP2's
path, with the device-copy ceiling measured in the same run as a line (needs matplotlib:
``pip install 'tide_triton[bench]'``).

reduce_scatter: bf16 full gradients -> fp32 shards (avg); all_gather: bf16 shards -> bf16
parameters; shards and parameters padded (FSDP2's layout), every list allocated back to
back.  Time per collective is the wall time of ``iters`` back-to-back collectives on every
rank divided by ``iters`` (all ranks start together, end with a synchronize).  Host
enqueue: the host time of those calls (pacing waits included); host CPU: the CPU time of
the calling thread over them (``time.thread_time``: the host's own work, without the waits
it sleeps through).  ``--host-profile FILE``: a cProfile of rank 0's calls.  Driver calls: CUDA driver
calls one collective of rank 0 makes once prepared (counted on one extra call, on the
transport's driver module: copies, stream memory operations, stream queries), the number
that must not grow with the parameter count.  ``--prepared``: ``run()`` of prepared
collectives; ``--captured``: ``replay()`` of prepared runs captured into a CUDA graph each
(issue 15's device-time floor: the "of ceiling" column), and then ``run()`` of the same
prepared collectives, which end joined once their group has a captured run (printed below
the row).  ``--profile DIR`` under torchrun:
one more call of each collective profiled on rank 0, and each collective printed against its
device-time floor (its bytes at the copy ceiling plus its kernels' time):

    torchrun --standalone --nproc-per-node 2 bench/collectives_gpu.py --share-gpu --captured --profile /tmp/prof
"""
from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import statistics
import threading
import time

# The threads mode's ranks' streams must not share hardware queues (see
# tide_triton.group._enough_hardware_queues); a process per rank (torchrun) keeps the default:
# more queues cost the GPU's capacity for contexts (bench/context_limit.py).
if "RANK" not in os.environ:
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "32")
    os.environ.setdefault("CUDA_MODULE_LOADING", "EAGER")  # and no lazy kernel load may sync the context

import torch  # noqa: E402

import tide_triton as tt
from tide_triton.measure import GcPasses, copy_ceiling, env_info
from tide_triton.report import collective_bytes
from tide_triton.workloads import layer_shapes


def rank_devices(W: int, share_gpu: bool) -> list[torch.device]:
    """Rank r on cuda:r % n (every rank on cuda:0 with ``share_gpu``)."""
    n = torch.cuda.device_count()
    return [torch.device("cuda", 0 if share_gpu else r % n) for r in range(W)]


class _CountCalls:
    """The driver module with every ``cu*`` function call counted (bench only)."""

    def __init__(self, cu) -> None:
        self._cu, self.calls = cu, 0

    def __getattr__(self, name: str):
        f = getattr(self._cu, name)
        if not (name.startswith("cu") and callable(f)):
            return f

        def counted(*a, **k):
            self.calls += 1
            return f(*a, **k)
        return counted


def driver_calls(g, fn) -> int:
    """CUDA driver calls of one ``fn()`` on group ``g``'s transport (after its first call)."""
    sig = g.transport(torch.device("cuda", torch.cuda.current_device()))._sig
    counter = sig._cu = _CountCalls(sig._cu)
    try:
        fn()
    finally:
        sig._cu = counter._cu
    return counter.calls


APART = False
"""``--apart``: gaps of varying size between the tensors (no run of equal shapes at a constant
pitch, so no strided copy: one descriptor per parameter and rank, as for tensors allocated
one by one)."""


def back_to_back(shapes, dtype, device, fill=None) -> list[torch.Tensor]:
    """Tensors of ``shapes`` carved one after another out of one buffer, as FSDP2 allocates
    its padded all-gather outputs and a flat gradient buffer (runs of equal shapes then take
    one strided copy per rank); with :data:`APART`, 64-192 elements apart."""
    numels = [int(torch.Size(s).numel()) for s in shapes]
    gaps = [64 * (1 + i % 3) if APART else 0 for i in range(len(shapes))]
    total = sum(numels) + sum(gaps)
    flat = (torch.randn(total, device=device) if fill is None
            else torch.full((total,), fill, device=device)).to(dtype)
    out, o = [], 0
    for s, n, gap in zip(shapes, numels, gaps):
        out.append(flat[o:o + n].view(s))
        o += n + gap
    return out


PREPARED = False
"""``--prepared``: time ``run()`` of ``tt.prepare_reduce_scatter`` / ``tt.prepare_all_gather``
(prepared once before the timed calls) instead of the eager calls."""


CAPTURED = False
"""``--captured``: prepared runs captured into a CUDA graph each (after one run outside the
capture); the timed call is ``graph.replay()``."""


def _calls(g, grads, shards, bshards, params, names):
    """The two timed collectives of a rank, as ``(name, fn)``: eager, prepared runs, or
    replays of captured prepared runs (one process per rank only)."""
    if PREPARED or CAPTURED:  # collective: every rank prepares both, in this order
        rs = tt.prepare_reduce_scatter(grads, shards, group=g, op="avg")
        ag = tt.prepare_all_gather(bshards, params, group=g)
        if not CAPTURED:
            return [(names[0], rs.run), (names[1], ag.run)]
        out = []
        for name, p in ((names[0], rs), (names[1], ag)):
            p.run()  # bound, its kernels loaded: what a capture needs first
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                p.run()
            out.append((name, graph.replay))
        # Once a group has a captured run, its eager-launched prepared runs end joined (the
        # caller's stream waits for the peers' reads): timed too, the cost of that join.
        return out + [(names[0] + "_joined", rs.run), (names[1] + "_joined", ag.run)]
    return [(names[0], lambda: tt.reduce_scatter(grads, shards, group=g, op="avg")),
            (names[1], lambda: tt.all_gather(bshards, params, group=g))]


def timed_calls(fn, iters: int, profile_path: str | None, title: str) -> tuple[float, float, float]:
    """``iters`` back-to-back calls of ``fn`` (under a cProfile when ``profile_path``):
    (start time, host ms per call -- the enqueue, pacing waits included -- and this thread's
    CPU ms per call), both means; the medians and the garbage collector's share are printed."""
    host, cpu = [], []
    with _host_profile(profile_path, title), GcPasses() as clock:
        t0 = time.perf_counter()
        for _ in range(iters):
            a, c = time.perf_counter(), time.thread_time()
            fn()
            host.append((time.perf_counter() - a) * 1e3)
            cpu.append((time.thread_time() - c) * 1e3)
    print(f"[host] {title}: enqueue median {statistics.median(host):.2f} / mean {statistics.mean(host):.2f} ms, "
          f"CPU median {statistics.median(cpu):.2f} / mean {statistics.mean(cpu):.2f} ms per call; "
          f"GC passes {clock.count} (full: {clock.full}), {clock.seconds * 1e3:.2f} ms in all", flush=True)
    return t0, statistics.mean(host), statistics.mean(cpu)


def run(model: str, W: int, iters: int, ring_bytes: int, profile: str | None = None,
        share_gpu: bool = False, host_profile: str | None = None) -> dict:
    devs = rank_devices(W, share_gpu)
    shapes = layer_shapes(model)
    layout = tt.ShardLayout(shapes, W)
    groups = tt.local_groups(W, timeout_s=120, ring_bytes=ring_bytes, devices=devs)
    grads = [back_to_back(shapes, torch.bfloat16, devs[r]) for r in range(W)]
    shards = [back_to_back(layout.shard_shapes(r, padded=True), torch.float32, devs[r], 0.0) for r in range(W)]
    bshards = [back_to_back(layout.shard_shapes(r, padded=True), torch.bfloat16, devs[r], 0.0) for r in range(W)]
    params = [back_to_back(layout.padded_shapes, torch.bfloat16, devs[r], 0.0) for r in range(W)]
    barrier = threading.Barrier(W)
    prof_ctx: list = [None]
    times: dict = {}
    errors: list = []

    def rank_main(r: int) -> None:
        try:
            torch.cuda.set_device(devs[r])
            with torch.cuda.stream(torch.cuda.Stream(devs[r])):  # every rank its own compute stream
                rank_body(r)
        except BaseException as e:  # noqa: BLE001
            errors.append((r, repr(e)))
            barrier.abort()

    def rank_body(r: int) -> None:
        g = groups[r]
        for name, fn in _calls(g, grads[r], shards[r], bshards[r], params[r], ("reduce_scatter", "all_gather")):
            fn()
            tt.synchronize(g, timeout_s=120)
            barrier.wait()
            t0, host, cpu = timed_calls(fn, iters, host_profile if r == 0 else None,
                                        f"{model} W={W} {name} (rank 0's thread)")
            tt.synchronize(g, timeout_s=120)
            barrier.wait()
            if r == 0:
                times[name] = (time.perf_counter() - t0) / iters * 1e3
                times[name + "_host"], times[name + "_cpu"] = host, cpu
            calls = driver_calls(g, fn)  # every rank makes the call; rank 0's count is kept
            tt.synchronize(g, timeout_s=120)
            barrier.wait()
            if r == 0:
                times[name + "_calls"] = calls
            if profile and name == "reduce_scatter":
                barrier.wait()
                if r == 0:
                    prof_ctx[0] = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])
                    prof_ctx[0].__enter__()
                barrier.wait()
                fn()
                tt.synchronize(g, timeout_s=120)
                barrier.wait()
                if r == 0:
                    prof_ctx[0].__exit__(None, None, None)

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(W)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    for g in groups:
        g.close()
    if errors:
        raise RuntimeError(errors)
    numel = sum(layout.numels)
    moved = collective_bytes(numel, W)  # read + written, all ranks together (see its docstring)
    rs_bytes, ag_bytes = moved["rs"], moved["ag"]
    if prof_ctx[0] is not None:
        _profile_summary(prof_ctx[0], profile, f"{model} W={W} ring={ring_bytes >> 20} MiB")
    return dict(model=model, world_size=W, rs_ms=times["reduce_scatter"], ag_ms=times["all_gather"],
                rs_host_ms=times["reduce_scatter_host"], ag_host_ms=times["all_gather_host"],
                rs_host_cpu_ms=times["reduce_scatter_cpu"], ag_host_cpu_ms=times["all_gather_cpu"],
                rs_driver_calls=times["reduce_scatter_calls"], ag_driver_calls=times["all_gather_calls"],
                launch="threads", staging_bytes=ring_bytes, fsdp_rs_input_bytes=4 * sum(layout.padded_numels),
                layer_numel=numel, rs_bytes=rs_bytes, ag_bytes=ag_bytes,
                gpus_used=len({d.index for d in devs}), share_gpu=share_gpu)


def run_dist(model: str, iters: int, ring_bytes: int, share_gpu: bool = False,
             host_profile: str | None = None, profile: str | None = None) -> dict | None:
    """One process per rank (under torchrun, gloo bootstrap): the row on rank 0, None elsewhere.
    ``profile`` (a folder): one more call of each collective under ``torch.profiler`` on rank 0
    -- its kernels' and copies' device time (``<name>_kernel_ms``, ``<name>_copy_ms``, the
    span) for the device-time floor, and the trace into the folder."""
    import torch.distributed as dist

    rank, W = dist.get_rank(), dist.get_world_size()
    dev = rank_devices(W, share_gpu)[rank]
    torch.cuda.set_device(dev)
    shapes = layer_shapes(model)
    layout = tt.ShardLayout(shapes, W)
    g = tt.init(timeout_s=120, ring_bytes=ring_bytes)
    grads = back_to_back(shapes, torch.bfloat16, dev)
    shards = back_to_back(layout.shard_shapes(rank, padded=True), torch.float32, dev, 0.0)
    bshards = back_to_back(layout.shard_shapes(rank, padded=True), torch.bfloat16, dev, 0.0)
    params = back_to_back(layout.padded_shapes, torch.bfloat16, dev, 0.0)
    row: dict = {}
    for name, fn in _calls(g, grads, shards, bshards, params, ("rs", "ag")):
        fn()
        tt.synchronize(g, timeout_s=120)
        dist.barrier()
        t0, host, cpu = timed_calls(fn, iters, host_profile if rank == 0 else None, f"{model} W={W} {name} (rank 0)")
        tt.synchronize(g, timeout_s=120)
        dist.barrier()
        row[name + "_ms"] = (time.perf_counter() - t0) / iters * 1e3
        row[name + "_host_ms"], row[name + "_host_cpu_ms"] = host, cpu  # this rank's; the slowest is reported
        row[name + "_driver_calls"] = driver_calls(g, fn)
        tt.synchronize(g, timeout_s=120)
        dist.barrier()
        if profile:
            busy = _profiled_call(fn, g, rank == 0, os.path.join(profile, f"{model}-W{W}-{name}-trace.json"),
                                  f"{model} W={W} {name} (rank 0)")
            row.update({f"{name}_{k}": v for k, v in busy.items()})
    rows: list = [None] * W
    dist.all_gather_object(rows, row)
    g.close()
    if rank:
        return None
    numel = sum(layout.numels)
    moved = collective_bytes(numel, W)
    out = {k: max(r[k] for r in rows) if all(k in r for r in rows) else rows[0][k] for k in rows[0]}
    return dict(model=model, world_size=W, **out, launch="torchrun", staging_bytes=ring_bytes,
                fsdp_rs_input_bytes=4 * sum(layout.padded_numels), layer_numel=numel, rs_bytes=moved["rs"],
                ag_bytes=moved["ag"], gpus_used=1 if share_gpu else min(W, torch.cuda.device_count()),
                share_gpu=share_gpu)


def _profiled_call(fn, g, lead: bool, trace: str, title: str) -> dict:
    """One more call of ``fn`` on every rank, under ``torch.profiler`` (CUDA activity) on the
    lead rank: its device busy times (:func:`_device_busy`; empty on the other ranks)."""
    import torch.distributed as dist

    prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) if lead else None
    if prof is not None:
        prof.__enter__()
    dist.barrier()
    fn()
    tt.synchronize(g, timeout_s=120)
    dist.barrier()
    if prof is None:
        return {}
    prof.__exit__(None, None, None)
    return _device_busy(prof, trace, title)


@contextlib.contextmanager
def _host_profile(path: str | None, title: str):
    """cProfile of this thread's host work inside the block, the top functions by own time
    appended to ``path`` (nothing when ``path`` is None)."""
    if path is None:
        yield
        return
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    try:
        yield
    finally:
        prof.disable()
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(30)
        with open(path, "a") as f:
            f.write(f"==== {title}\n{buf.getvalue()}\n")


def _profile_summary(prof, path: str, title: str) -> None:
    """Busy time per kind of GPU activity in one reduce-scatter (all ranks): kernels, copies,
    and the span from the first activity to the last."""
    _device_busy(prof, os.path.join(path, "rs_trace.json"), title)


def _device_busy(prof, trace: str, title: str) -> dict:
    """Busy time per kind of GPU activity the profiler saw (printed), written as a Chrome trace
    to ``trace``: ``kernel_ms`` (every kernel), ``copy_ms`` (memcpy and memset), ``span_ms``
    (first activity to last).  Busy times are summed, so overlapping activities add up."""
    import collections

    prof.export_chrome_trace(trace)
    with open(trace) as f:
        events = json.load(f).get("traceEvents", [])
    busy = collections.Counter()
    count = collections.Counter()
    lo, hi = float("inf"), 0.0
    for e in events:
        cat = e.get("cat", "")
        if cat not in ("kernel", "gpu_memcpy", "gpu_memset") or "dur" not in e:
            continue
        kind = cat if cat != "kernel" else ("kernel:" + e.get("name", "")[:40])
        busy[kind] += e["dur"]
        count[kind] += 1
        lo, hi = min(lo, e["ts"]), max(hi, e["ts"] + e["dur"])
    print(f"profile {title}: span {(hi - lo) / 1e3 if busy else 0:.2f} ms")
    for kind, us in busy.most_common(12):
        print(f"  {kind}: {count[kind]} x, {us / 1e3:.3f} ms busy")
    kernel = sum(us for k, us in busy.items() if k.startswith("kernel:"))
    return {"kernel_ms": kernel / 1e3, "copy_ms": (sum(busy.values()) - kernel) / 1e3,
            "span_ms": (hi - lo) / 1e3 if busy else 0.0}


def _print_floor(row: dict, ceiling_gbps: float) -> None:
    """Each collective against its device-time floor: the bytes it moves (read + written, all
    ranks) at the copy ceiling of this run, plus its kernels' time (rank 0's, times the ranks
    that share a GPU: their kernels take turns on it).  Adds ``<name>_floor_ms`` to ``row``."""
    sharing = row["world_size"] if row.get("share_gpu") else 1
    for name in ("rs", "ag"):
        if f"{name}_kernel_ms" not in row:
            continue
        copy_floor = row[f"{name}_bytes"] / (ceiling_gbps * 1e9) * 1e3
        floor = row[f"{name}_floor_ms"] = copy_floor + sharing * row[f"{name}_kernel_ms"]
        print(f"floor {row['model']} W={row['world_size']} {name}: {floor:.2f} ms (copies at the ceiling "
              f"{copy_floor:.2f} + kernels {sharing} x {row[f'{name}_kernel_ms']:.2f}); measured "
              f"{row[f'{name}_ms']:.2f} ms = {row[f'{name}_ms'] / floor:.2f} x the floor; rank 0's profiled "
              f"call: span {row[f'{name}_span_ms']:.2f} ms, copies busy {row[f'{name}_copy_ms']:.2f} ms", flush=True)


def _plot(ap: argparse.ArgumentParser, path: str, rows: list[dict]) -> None:
    from tide_triton.report import plot_collective_rows

    try:
        plot_collective_rows(rows, path)
    except (RuntimeError, ValueError) as e:
        ap.exit(2, f"{ap.prog}: error: --plot {path}: {e}\n")
    print(f"plot written to {path}")


def main() -> None:
    import faulthandler
    import sys

    from tide_triton._cli import Progress

    faulthandler.dump_traceback_later(float(os.environ.get("TIDE_HANG_DUMP_S", "1e9")), exit=True,
                                      file=sys.stderr)
    ap = argparse.ArgumentParser(prog="python bench/collectives_gpu.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--world-sizes", nargs="+", type=int, default=[2, 4])
    ap.add_argument("--models", nargs="+", default=["llama-3.1-70b", "qwen3-30b-a3b", "synthetic-moe-256e"])
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--ring-bytes", type=int, nargs="+", default=[256 << 20])
    ap.add_argument("--profile", default=None,
                    help="folder: profile one reduce-scatter of the first row (single-process mode); under "
                         "torchrun one more call of each collective per row on rank 0, printed against the "
                         "device-time floor (bytes at the copy ceiling + kernel time)")
    ap.add_argument("--host-profile", default=None, metavar="FILE",
                    help="append a cProfile of rank 0's timed calls (top functions by own time) to FILE")
    ap.add_argument("--share-gpu", action="store_true",
                    help="every rank on cuda:0 (default: rank r on cuda:r %% number of GPUs)")
    ap.add_argument("--prepared", action="store_true",
                    help="time run() of prepared collectives (tt.prepare_reduce_scatter / prepare_all_gather)")
    ap.add_argument("--captured", action="store_true",
                    help="time replays of prepared runs captured into CUDA graphs (torch.cuda.graph)")
    ap.add_argument("--apart", action="store_true",
                    help="tensors apart (no strided copies: a descriptor per parameter and rank)")
    ap.add_argument("--json", default=None, help="append one JSON row per (model, W, ring) to this file")
    ap.add_argument("--plot", default=None, metavar="FILE", help="draw time and bandwidth against W into FILE")
    ap.add_argument("--from", dest="from_rows", nargs="+", default=None, metavar="ROWS.jsonl",
                    help="with --plot: plot recorded rows (this script's and nccl_baseline.py's) without running")
    args = ap.parse_args()
    global APART, PREPARED, CAPTURED
    APART, PREPARED, CAPTURED = args.apart, args.prepared, args.captured
    if args.from_rows:
        from tide_triton._cli import recorded_rows

        _plot(ap, args.plot, recorded_rows(ap, args.from_rows, args.plot))
        return
    if not torch.cuda.is_available():
        ap.error("no CUDA device is visible to torch: this benchmark needs a GPU (plot recorded rows with "
                 "--plot FILE --from ROWS.jsonl)")
    torchrun = "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ)
    if torchrun:
        import torch.distributed as dist

        dist.init_process_group("gloo")
        if args.profile and dist.get_rank() == 0:
            os.makedirs(args.profile, exist_ok=True)
        args.world_sizes = [dist.get_world_size()]
        lead = dist.get_rank() == 0
    elif args.captured:  # torch.cuda.graph synchronizes the device: other rank threads may be capturing
        ap.error("--captured runs one process per rank (torchrun), not in the single-process mode")
    else:
        lead = True
    dev = torch.device("cuda", 0)
    info = env_info(dev)
    ceiling = copy_ceiling(dev, 4 << 30).gbps() if lead else 0.0  # device copy, read + write, this run
    if torchrun:
        dist.barrier()  # the other ranks wait: the ceiling is measured on an idle GPU
    torch.cuda.empty_cache()
    n_gpu = 1 if args.share_gpu else min(torch.cuda.device_count(), max(args.world_sizes))
    launch = "one process per rank (torchrun)" if torchrun else "single process, one thread per rank"
    say = print if lead else (lambda *a, **k: None)
    say(f"{info['gpu']} x {n_gpu} used | torch {info['torch']} | triton {info['triton']} | git {info['git_sha']} | "
        f"{info['date']} | copy ceiling {ceiling:.0f} GB/s (read + write, cuda:0, this run) | {launch}")
    say("| model | W | ring | reduce_scatter bf16->fp32 (ms) | of ceiling | host enqueue / CPU (ms) | driver calls | "
        "all_gather bf16 (ms) | of ceiling | host enqueue / CPU (ms) | driver calls | FSDP2 fp32 RS input / rank |")
    say("|---|---|---|---|---|---|---|---|---|---|---|---|", flush=True)
    first = True
    rows: list[dict] = []
    cases = list(itertools.product(args.models, args.world_sizes, args.ring_bytes))
    with Progress(len(cases) if lead else 0, "collectives") as progress:
        for model, W, ring in cases:
            if lead:
                progress.step(f"{model} W={W} ring {ring >> 20} MiB")
            try:
                if torchrun:  # a failure here is every rank's (the group raises everywhere)
                    row = run_dist(model, args.iters, ring, args.share_gpu, args.host_profile, args.profile)
                    if row is None:
                        continue
                else:
                    row = run(model, W, args.iters, ring, args.profile if first else None, args.share_gpu,
                              args.host_profile)
            except Exception as e:  # noqa: BLE001 - one failed row must not lose the others
                say(f"| {model} | {W} | {ring >> 20} MiB | failed: {type(e).__name__}: {e} |", flush=True)
                continue
            first = False
            row["ceiling_gbps"] = ceiling
            row["tensors_apart"] = APART
            row["prepared"] = PREPARED or CAPTURED
            row["captured"] = CAPTURED
            row["copy_graphs"] = os.environ.get("TIDE_TRITON_COPY_GRAPHS", "auto")
            rs_frac = row["rs_bytes"] / (row["rs_ms"] * 1e-3) / 1e9 / ceiling
            ag_frac = row["ag_bytes"] / (row["ag_ms"] * 1e-3) / 1e9 / ceiling
            print(f"| {model} | {W} | {ring >> 20} MiB | {row['rs_ms']:.2f} | {rs_frac:.1%} | "
                  f"{row['rs_host_ms']:.2f} / {row['rs_host_cpu_ms']:.2f} | {row['rs_driver_calls']} | "
                  f"{row['ag_ms']:.2f} | {ag_frac:.1%} | "
                  f"{row['ag_host_ms']:.2f} / {row['ag_host_cpu_ms']:.2f} | {row['ag_driver_calls']} | "
                  f"{row['fsdp_rs_input_bytes'] / 2**20:.0f} MiB |", flush=True)
            if "rs_joined_ms" in row:  # --captured: prepared runs of a group that has captured runs
                print(f"prepared runs ending joined (the group has captured runs): reduce_scatter "
                      f"{row['rs_joined_ms']:.2f} ms (host {row['rs_joined_host_ms']:.2f}), all_gather "
                      f"{row['ag_joined_ms']:.2f} ms (host {row['ag_joined_host_ms']:.2f})", flush=True)
            if "rs_kernel_ms" in row:  # --profile under torchrun: issue 15's device-time floor
                _print_floor(row, ceiling)
            rows.append({**row, **info})
            if args.json:
                with open(args.json, "a") as f:
                    f.write(json.dumps(rows[-1]) + "\n")
            torch.cuda.empty_cache()
    if args.plot and rows:
        _plot(ap, args.plot, rows)
    if torchrun:
        import torch.distributed as dist

        dist.destroy_process_group()


if __name__ == "__main__":
    main()
