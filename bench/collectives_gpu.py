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
the row; the single-process mode's rank threads capture at once, see ``_captured``).
``--new-grads``: every reduce-scatter reads gradients at new addresses (FSDP2's
reduce-scatter each step), timing the preparation a call then needs.  ``--profile DIR``: one
more call of each collective profiled (every rank; traces into DIR), each collective printed
against its device-time floor (its bytes at the copy ceiling plus its kernels' time), and
under torchrun how the ranks' GPU work lies in time (processes sharing a GPU take turns:
contexts time-slice):

    torchrun --standalone --nproc-per-node 2 bench/collectives_gpu.py --share-gpu --captured --profile /tmp/prof
    python bench/collectives_gpu.py --share-gpu --world-sizes 2 --captured   # no --profile here
"""
from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import statistics
import sys
import threading
import time

# The threads mode's ranks' streams must not share hardware queues (see
# tide_triton.group.single_process.hardware_queues); a process per rank (torchrun) keeps the default:
# more queues cost the GPU's capacity for contexts
# (docs/constraints.md#contexts-per-gpu-and-hardware-queues).
if "RANK" not in os.environ:
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "32")
    os.environ.setdefault("CUDA_MODULE_LOADING", "EAGER")  # and no lazy kernel load may sync the context

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:  # script_tools beside it, also where the tests load this file
    sys.path.insert(0, _HERE)

import torch  # noqa: E402
from script_tools import collective_bytes  # noqa: E402

import tide_triton as tt  # noqa: E402
from tide_triton.executors import recorded as run_graph  # noqa: E402
from tide_triton.runtime import envs  # noqa: E402
from tide_triton.bench.measure import GcPasses, copy_ceiling, env_info  # noqa: E402
from tide_triton.plan.workloads import layer_shapes  # noqa: E402


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


_counting = threading.local()
"""The counter of the :func:`driver_calls` running in this thread (rank threads count at once)."""


def _count_replays() -> None:
    """Make ``RunGraph.replay`` count one call into this thread's :func:`driver_calls` counter
    where it launches through torch (``CUDAGraph.replay``: one graph launch the transport's
    counter does not see; a launch through the transport is counted there); installed once, by
    the first count."""
    real = run_graph.RunGraph.replay
    if getattr(real, "counts_replays", False):
        return

    def counted(self, *a, **k):
        counter = getattr(_counting, "counter", None)
        if counter is not None and not (self.exec_handle is not None and hasattr(a[0] if a else None,
                                                                                  "launch_graph_exec")):
            counter.calls += 1
        return real(self, *a, **k)

    counted.counts_replays = True
    run_graph.RunGraph.replay = counted


def driver_calls(g, fn) -> int:
    """CUDA driver calls of one ``fn()`` on group ``g``'s transport (after its first call); a
    prepared run replayed from its recording (``tide_triton.executors.recorded``) counts its graph
    launch once, made through the transport or (older torch) through ``CUDAGraph.replay``."""
    t = g.transport(torch.device("cuda", torch.cuda.current_device()))
    parts = [t._streams, t._copies, t._copy_graphs, t._flags, t._waits]  # every part that calls the driver
    counter = _CountCalls(parts[0]._cu)
    for part in parts:
        part._cu = counter
    _count_replays()
    _counting.counter = counter
    try:
        fn()
    finally:
        for part in parts:
            part._cu = counter._cu
        _counting.counter = None
    return counter.calls


APART = False
"""``--apart``: gaps of varying size between the tensors (no run of equal shapes at a constant
pitch, so no strided copy: one descriptor per parameter and rank, as for tensors allocated
one by one)."""


def back_to_back(shapes, dtype, device, fill=None, shifts: int = 1) -> list[torch.Tensor]:
    """Tensors of ``shapes`` carved one after another out of one buffer, as FSDP2 allocates
    its padded all-gather outputs and a flat gradient buffer (runs of equal shapes then take
    one strided copy per rank); with :data:`APART`, 64-192 elements apart.  ``shifts > 1``:
    a list of that many such sets, set ``k`` shifted by ``k * SHIFT_ELEMS`` elements in one
    buffer (:data:`NEW_GRADS`)."""
    numels = [int(torch.Size(s).numel()) for s in shapes]
    gaps = [64 * (1 + i % 3) if APART else 0 for i in range(len(shapes))]
    total = sum(numels) + sum(gaps) + (shifts - 1) * SHIFT_ELEMS
    flat = (torch.randn(total, device=device) if fill is None
            else torch.full((total,), fill, device=device)).to(dtype)
    sets = []
    for k in range(shifts):
        out, o = [], k * SHIFT_ELEMS
        for s, n, gap in zip(shapes, numels, gaps):
            out.append(flat[o:o + n].view(s))
            o += n + gap
        sets.append(out)
    return sets[0] if shifts == 1 else sets


NEW_GRADS = False
"""``--new-grads``: every reduce-scatter reads its gradients at new addresses, as FSDP2's
reduce-scatter reads autograd's fresh gradients every step: each call takes the next of
several sets of views shifted by :data:`SHIFT_ELEMS` elements in one buffer (made before the
timing), so every call prepares its copies and reductions again -- the eager call's cache
misses, a prepared collective binds the new set as the FSDP2 drop-in does (``_run_on``)."""
SHIFT_ELEMS = 256  # 512 bytes of bf16: the 16-byte alignment stays


PREPARED = False
"""``--prepared``: time ``run()`` of ``tt.prepare_reduce_scatter`` / ``tt.prepare_all_gather``
(prepared once before the timed calls) instead of the eager calls."""
UNCHECKED = False
"""``--unchecked``: prepared runs skip their address check (``run(check_addresses=False)``)."""


WARMUP = 3
"""Untimed calls before the timed ones: the steady state starts at the third call on a set of
addresses (copy lists replay as graphs from their second use, a prepared run is recorded at
its second run and replayed from its third; the first launch of a graph uploads it)."""

TIMEOUT_S = 120.0
"""``--timeout-s``: every group's deadline (waits on peers, on GPU work)."""

RS_PUSH = "auto"
"""``--rs-push``: the groups' ``GroupOptions.rs_push`` (how a reduce-scatter pushes its slices)."""

STAGE_TIMES: str | None = None
"""``--stage-times FILE``: rank 0's host time per stage appended there (one process per rank)."""

CAPTURED = False
"""``--captured``: prepared runs captured into a CUDA graph each (after one run outside the
capture); the timed call is ``graph.replay()``."""


def _calls(g, grads, shards, bshards, params, names, threads: bool = False, barrier=None):
    """The two timed collectives of a rank, as ``(name, fn)``: eager, prepared runs, or
    replays of captured prepared runs (``threads``: the single-process mode, whose rank threads
    capture at the same time, see :func:`_captured`, between two waits on ``barrier``: no rank
    may instantiate its graph while another rank's stream waits for it -- docs/collectives.md).
    With :data:`NEW_GRADS` ``grads`` is a list of sets of views (``back_to_back``'s shifts): the
    first to prepare with, then one set per reduce-scatter call."""
    sync = barrier.wait if barrier is not None else (lambda: None)
    first, sets = (grads[0], iter(grads[1:])) if NEW_GRADS else (grads, None)
    if PREPARED or CAPTURED:  # collective: every rank prepares both, in this order
        rs = tt.prepare_reduce_scatter(first, shards, group=g, op="avg")
        ag = tt.prepare_all_gather(bshards, params, group=g)
        if not CAPTURED:  # new addresses: bound as the FSDP2 drop-in binds them (_run_on)
            rs_run, ag_run = ((lambda: rs.run(check_addresses=False)), (lambda: ag.run(check_addresses=False))
                              ) if UNCHECKED else (rs.run, ag.run)
            return [(names[0], (lambda: rs._run_on(next(sets), shards)) if NEW_GRADS else rs_run),
                    (names[1], ag_run)]
        out = []
        for name, p in ((names[0], rs), (names[1], ag)):
            p.run()  # bound, its kernels loaded: what a capture needs first
            sync()  # every rank's run enqueued whole: nothing waits for a flag not yet enqueued
            out.append((name, _captured(p.run, threads).replay))
            sync()  # every graph instantiated before any rank enqueues again
        # Once a group has a captured run, its eager-launched prepared runs end joined (the
        # caller's stream waits for the peers' reads): timed too, the cost of that join.
        return out + [(names[0] + "_joined", rs.run), (names[1] + "_joined", ag.run)]
    return [(names[0], lambda: tt.reduce_scatter(next(sets) if NEW_GRADS else grads, shards, group=g, op="avg")),
            (names[1], lambda: tt.all_gather(bshards, params, group=g))]


def _captured(run, threads: bool) -> "torch.cuda.CUDAGraph":
    """``run()`` captured into a CUDA graph.  One process per rank: ``torch.cuda.graph``.  The
    single-process mode's rank threads capture at the same time, each on a stream of its own:
    ``torch.cuda.graph`` would synchronize the device (refused while another thread captures)
    and its default capture mode refuses other threads' driver calls, so the capture is begun
    and ended directly, in ``thread_local`` mode (each thread's own calls are checked)."""
    graph = torch.cuda.CUDAGraph()
    if not threads:
        with torch.cuda.graph(graph):
            run()
        return graph
    side, caller = torch.cuda.Stream(), torch.cuda.current_stream()
    side.wait_stream(caller)
    with torch.cuda.stream(side):
        graph.capture_begin(capture_error_mode="thread_local")
        try:
            run()
        finally:
            graph.capture_end()
    caller.wait_stream(side)
    return graph


def _shifts(iters: int) -> int:
    """Sets of gradient views a row needs: one, or with :data:`NEW_GRADS` one per call of the
    row (warm-up, timed calls, driver-call count, profiled call) and one to prepare with."""
    return iters + 8 if NEW_GRADS else 1


def timed_calls(fn, iters: int, profile_path: str | None, title: str,
                stages_path: str | None = None) -> tuple[float, float, float]:
    """``iters`` back-to-back calls of ``fn`` (under a cProfile when ``profile_path``, with
    stage timers when ``stages_path``: :mod:`stage_times`, appended there):
    (start time, host ms per call -- the enqueue, pacing waits included -- and this thread's
    CPU ms per call), both means; the medians and the garbage collector's share are printed."""
    host, cpu = [], []
    with _host_profile(profile_path, title), _stage_times(stages_path, title, iters), GcPasses() as clock:
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
    groups = tt.local_groups(W, timeout_s=TIMEOUT_S, ring_bytes=ring_bytes, devices=devs, rs_push=RS_PUSH)
    grads = [back_to_back(shapes, torch.bfloat16, devs[r], shifts=_shifts(iters)) for r in range(W)]
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
        for name, fn in _calls(g, grads[r], shards[r], bshards[r], params[r], ("reduce_scatter", "all_gather"),
                               threads=True, barrier=barrier):
            for _ in range(WARMUP):
                fn()
            tt.synchronize(g, timeout_s=TIMEOUT_S)
            barrier.wait()
            t0, host, cpu = timed_calls(fn, iters, host_profile if r == 0 else None,
                                        f"{model} W={W} {name} (rank 0's thread)")
            tt.synchronize(g, timeout_s=TIMEOUT_S)
            barrier.wait()
            if r == 0:
                times[name] = (time.perf_counter() - t0) / iters * 1e3
                times[name + "_host"], times[name + "_cpu"] = host, cpu
            calls = driver_calls(g, fn)  # every rank makes the call; rank 0's count is kept
            tt.synchronize(g, timeout_s=TIMEOUT_S)
            barrier.wait()
            if r == 0:
                times[name + "_calls"] = calls
            if profile:  # one more call, the process's GPU activity (every rank's) profiled
                barrier.wait()
                if r == 0:
                    prof_ctx[0] = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])
                    prof_ctx[0].__enter__()
                barrier.wait()
                fn()
                tt.synchronize(g, timeout_s=TIMEOUT_S)
                barrier.wait()
                if r == 0:
                    prof_ctx[0].__exit__(None, None, None)
                    times[name + "_busy"] = _device_busy(
                        prof_ctx[0], os.path.join(profile, f"{model}-W{W}-{name}-threads-trace.json"),
                        f"{model} W={W} {name} (every rank: one process)")

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
    extra: dict = {}
    for short, name in (("rs", "reduce_scatter"), ("ag", "all_gather")):
        if name + "_joined" in times:  # --captured: prepared runs of a group that has captured runs
            extra[f"{short}_joined_ms"], extra[f"{short}_joined_host_ms"] = times[name + "_joined"], \
                times[name + "_joined_host"]
        busy = times.get(name + "_busy")
        if busy is not None:  # every rank's activity: the floor's kernel term is already summed
            busy.pop("intervals", None)
            extra.update({f"{short}_{k}": v for k, v in busy.items()}, kernels_all_ranks=True)
    return dict(**extra, model=model, world_size=W, rs_ms=times["reduce_scatter"], ag_ms=times["all_gather"],
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
    g = tt.init(timeout_s=TIMEOUT_S, ring_bytes=ring_bytes, rs_push=RS_PUSH)
    grads = back_to_back(shapes, torch.bfloat16, dev, shifts=_shifts(iters))
    shards = back_to_back(layout.shard_shapes(rank, padded=True), torch.float32, dev, 0.0)
    bshards = back_to_back(layout.shard_shapes(rank, padded=True), torch.bfloat16, dev, 0.0)
    params = back_to_back(layout.padded_shapes, torch.bfloat16, dev, 0.0)
    row: dict = {}
    for name, fn in _calls(g, grads, shards, bshards, params, ("rs", "ag")):
        for _ in range(WARMUP):
            fn()
        tt.synchronize(g, timeout_s=TIMEOUT_S)
        dist.barrier()
        t0, host, cpu = timed_calls(fn, iters, host_profile if rank == 0 else None, f"{model} W={W} {name} (rank 0)",
                                    STAGE_TIMES if rank == 0 else None)
        tt.synchronize(g, timeout_s=TIMEOUT_S)
        dist.barrier()
        row[name + "_ms"] = (time.perf_counter() - t0) / iters * 1e3
        row[name + "_host_ms"], row[name + "_host_cpu_ms"] = host, cpu  # this rank's; the slowest is reported
        row[name + "_driver_calls"] = driver_calls(g, fn)
        tt.synchronize(g, timeout_s=TIMEOUT_S)
        dist.barrier()
        if profile:
            busy = _profiled_call(fn, g, rank, os.path.join(profile, f"{model}-W{W}-{name}-rank{{rank}}-trace.json"),
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


def _profiled_call(fn, g, rank: int, trace: str, title: str) -> dict:
    """One more call of ``fn`` on every rank, each under ``torch.profiler`` (CUDA activity), its
    trace into ``trace`` (``{rank}`` filled in): rank 0's busy times (:func:`_device_busy`,
    printed) and, on rank 0, how all ranks' activity lies in time (:func:`ranks_overlap`,
    printed; ``all_*`` keys)."""
    import torch.distributed as dist

    prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])
    prof.__enter__()
    dist.barrier()
    fn()
    tt.synchronize(g, timeout_s=TIMEOUT_S)
    dist.barrier()
    prof.__exit__(None, None, None)
    if rank == 0:
        busy = _device_busy(prof, trace.format(rank=rank), title)
    else:
        prof.export_chrome_trace(trace.format(rank=rank))
        with open(trace.format(rank=rank)) as f:
            busy = busy_of_events(json.load(f).get("traceEvents", []))
        busy.pop("kinds")
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, busy.pop("intervals"))
    if rank:
        return {}
    both = ranks_overlap(every)
    print(f"  all {len(every)} ranks: span {both['span_ms']:.2f} ms, busy {both['busy_ms']:.2f} ms (summed over "
          f"ranks), some rank active {both['active_ms']:.2f} ms, two or more at once {both['concurrent_ms']:.2f} ms",
          flush=True)
    return {**busy, **{f"all_{k}": v for k, v in both.items()}}


@contextlib.contextmanager
def _stage_times(path: str | None, title: str, per: int):
    """Wall time per stage of the library's host work inside the block (:mod:`stage_times`),
    per call, appended to ``path`` (nothing when ``path`` is None)."""
    if path is None:
        yield
        return
    from stage_times import StageTimes

    with StageTimes() as st:
        yield
    with open(path, "a") as f:
        f.write(st.table(per, title))


@contextlib.contextmanager
def _host_profile(path: str | None, title: str):
    """cProfile of this thread's host work inside the block, the top functions by own time and
    by cumulative time appended to ``path`` (nothing when ``path`` is None)."""
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
        pstats.Stats(prof, stream=buf).sort_stats("cumulative").print_stats(90)
        with open(path, "a") as f:
            f.write(f"==== {title}\n{buf.getvalue()}\n")


def _device_busy(prof, trace: str, title: str) -> dict:
    """Busy time per kind of GPU activity the profiler saw (printed), written as a Chrome trace
    to ``trace``; the sums of :func:`busy_of_events`."""
    prof.export_chrome_trace(trace)
    with open(trace) as f:
        events = json.load(f).get("traceEvents", [])
    busy = busy_of_events(events)
    print(f"profile {title}: span {busy['span_ms']:.2f} ms", flush=True)
    for kind, (n, ms) in busy.pop("kinds").items():
        print(f"  {kind}: {n} x, {ms:.3f} ms busy")
    return busy


COPY_KERNELS = ("memcpy", "memset")
"""Kernel names the CUDA driver runs copies as (a graph's memcpy nodes, e.g.
``memcpy32_post``, ``memcpyDtoD2D_aligned_smalldiffpitch``): copies, not the collective's
own kernels -- but they occupy SMs."""


def busy_of_events(events: list) -> dict:
    """A profiled call's GPU activity from its Chrome trace events: ``kernel_ms`` (the
    collective's own kernels: accumulation, casts), ``copy_ms`` (memcpy / memset activities and
    the copy kernels of :data:`COPY_KERNELS`), ``copy_kernel_ms`` (the part of ``copy_ms`` that
    ran as kernels, on SMs), ``span_ms`` (first activity to last), ``intervals`` (start, end) in
    the trace's microseconds, and ``kinds`` ({kind: (count, ms)}, largest first).  Busy times
    are summed, so overlapping activities add up."""
    import collections

    busy: collections.Counter = collections.Counter()
    count: collections.Counter = collections.Counter()
    intervals = []
    for e in events:
        cat = e.get("cat", "")
        if cat not in ("kernel", "gpu_memcpy", "gpu_memset") or "dur" not in e:
            continue
        kind = cat if cat != "kernel" else ("kernel:" + e.get("name", "")[:40])
        busy[kind] += e["dur"]
        count[kind] += 1
        intervals.append((float(e["ts"]), float(e["ts"]) + float(e["dur"])))
    copy_kernels = sum(us for k, us in busy.items()
                       if k.startswith("kernel:") and k[7:].lower().startswith(COPY_KERNELS))
    kernels = sum(us for k, us in busy.items() if k.startswith("kernel:")) - copy_kernels
    span = (max(e for _, e in intervals) - min(s for s, _ in intervals)) if intervals else 0.0
    return {"kernel_ms": kernels / 1e3, "copy_ms": (sum(busy.values()) - kernels) / 1e3,
            "copy_kernel_ms": copy_kernels / 1e3, "span_ms": span / 1e3, "intervals": intervals,
            "kinds": {k: (count[k], us / 1e3) for k, us in busy.most_common(12)}}


def ranks_overlap(per_rank: list[list[tuple[float, float]]]) -> dict:
    """How the ranks' GPU activity in one profiled call lies in time (intervals in
    microseconds of one clock): ``span_ms`` (first activity of any rank to the last),
    ``busy_ms`` (each rank's active time, summed), ``active_ms`` (time some rank is active) and
    ``concurrent_ms`` (time two ranks or more are active at once).  Ranks that share a GPU as
    processes take turns (contexts time-slice): ``concurrent_ms`` near 0, and ``span_ms -
    active_ms`` is the time no rank's work ran."""
    points = []
    busy = 0.0
    for ivs in per_rank:
        merged: list[list[float]] = []
        for s, e in sorted(ivs):
            if merged and s <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], e)
            else:
                merged.append([s, e])
        for s, e in merged:
            busy += e - s
            points += [(s, 1), (e, -1)]
    if not points:
        return {"span_ms": 0.0, "busy_ms": 0.0, "active_ms": 0.0, "concurrent_ms": 0.0}
    points.sort(key=lambda p: (p[0], p[1]))  # an end before a start at the same instant
    active = concurrent = 0.0
    depth, last = 0, points[0][0]
    for t, d in points:
        if depth >= 1:
            active += t - last
        if depth >= 2:
            concurrent += t - last
        depth, last = depth + d, t
    return {"span_ms": (points[-1][0] - points[0][0]) / 1e3, "busy_ms": busy / 1e3, "active_ms": active / 1e3,
            "concurrent_ms": concurrent / 1e3}


def _print_floor(row: dict, ceiling_gbps: float) -> None:
    """Each collective against its device-time floor: the bytes it moves (read + written, all
    ranks) at the copy ceiling of this run, plus its kernels' time (rank 0's, times the ranks
    that share a GPU: their kernels take turns on it; copy kernels count as copies).  Adds
    ``<name>_floor_ms`` to ``row``.  With every rank profiled (``<name>_all_*``), also the
    measured time against the ranks' summed GPU work in that call."""
    sharing = row["world_size"] if row.get("share_gpu") and not row.get("kernels_all_ranks") else 1
    for name in ("rs", "ag"):
        if f"{name}_kernel_ms" not in row:
            continue
        copy_floor = row[f"{name}_bytes"] / (ceiling_gbps * 1e9) * 1e3
        floor = row[f"{name}_floor_ms"] = copy_floor + sharing * row[f"{name}_kernel_ms"]
        print(f"floor {row['model']} W={row['world_size']} {name}: {floor:.2f} ms (copies at the ceiling "
              f"{copy_floor:.2f} + kernels {sharing} x {row[f'{name}_kernel_ms']:.2f}); measured "
              f"{row[f'{name}_ms']:.2f} ms = {row[f'{name}_ms'] / floor:.2f} x the floor; rank 0's profiled "
              f"call: span {row[f'{name}_span_ms']:.2f} ms, copies busy {row[f'{name}_copy_ms']:.2f} ms "
              f"({row.get(f'{name}_copy_kernel_ms', 0.0):.2f} ms of it as copy kernels on SMs)", flush=True)
        if f"{name}_all_busy_ms" in row:  # every rank profiled: what the ranks' GPU work alone takes
            busy = row[f"{name}_all_busy_ms"]
            at_once, span = row[f"{name}_all_concurrent_ms"], row[f"{name}_all_span_ms"]
            print(f"  {name}: all ranks' GPU work {busy:.2f} ms (summed; {at_once:.2f} ms of it at once) in a span "
                  f"of {span:.2f} ms; measured = {row[f'{name}_ms'] / busy:.2f} x that work", flush=True)


def _plot(ap: argparse.ArgumentParser, path: str, rows: list[dict]) -> None:
    from script_tools import plot_collective_rows

    from tide_triton.bench.cli import plot_or_exit

    plot_or_exit(ap, path, plot_collective_rows, rows)


def main() -> None:
    import faulthandler
    import sys

    from tide_triton.bench.cli import Progress

    faulthandler.dump_traceback_later(float(os.environ.get("TIDE_HANG_DUMP_S", "1e9")), exit=True,
                                      file=sys.stderr)
    ap = argparse.ArgumentParser(prog="python bench/collectives_gpu.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--world-sizes", nargs="+", type=int, default=[2, 4])
    ap.add_argument("--models", nargs="+", default=["llama-3.1-70b", "qwen3-30b-a3b", "synthetic-moe-256e"])
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--ring-bytes", type=int, nargs="+", default=[256 << 20])
    ap.add_argument("--profile", default=None,
                    help="folder: one more call of each collective per row under torch.profiler (every rank; "
                         "traces into the folder), printed against the device-time floor (bytes at the copy "
                         "ceiling + kernel time)")
    ap.add_argument("--host-profile", default=None, metavar="FILE",
                    help="append a cProfile of rank 0's timed calls (top functions by own time) to FILE")
    ap.add_argument("--rs-push", default="auto", choices=["auto", "copy_engine", "kernel"],
                    help="GroupOptions.rs_push: the reduce-scatter's pushes by copy descriptors or the segment kernel")
    ap.add_argument("--stage-times", default=None, metavar="FILE",
                    help="append rank 0's wall time per stage of the library's host work (bench/stage_times.py: "
                         "timers on chosen functions, no profiler) per timed call to FILE")
    ap.add_argument("--share-gpu", action="store_true",
                    help="every rank on cuda:0 (default: rank r on cuda:r %% number of GPUs)")
    ap.add_argument("--prepared", action="store_true",
                    help="time run() of prepared collectives (tt.prepare_reduce_scatter / prepare_all_gather)")
    ap.add_argument("--captured", action="store_true",
                    help="time replays of prepared runs captured into CUDA graphs (torch.cuda.graph)")
    ap.add_argument("--unchecked", action="store_true",
                    help="with --prepared: run(check_addresses=False), without the check that no tensor moved")
    ap.add_argument("--new-grads", action="store_true",
                    help="every reduce-scatter reads gradients at new addresses (FSDP2's reduce-scatter each step): "
                         "the cost of preparing them each call")
    ap.add_argument("--apart", action="store_true",
                    help="tensors apart (no strided copies: a descriptor per parameter and rank)")
    ap.add_argument("--timeout-s", type=float, default=120.0,
                    help="the groups' deadline for every wait on a peer or on GPU work (a stall ends in an error "
                         "naming the rank after this long)")
    ap.add_argument("--json", default=None, help="append one JSON row per (model, W, ring) to this file")
    ap.add_argument("--plot", default=None, metavar="FILE", help="draw time and bandwidth against W into FILE")
    ap.add_argument("--from", dest="from_rows", nargs="+", default=None, metavar="ROWS.jsonl",
                    help="with --plot: plot recorded rows (this script's and nccl_baseline.py's) without running")
    args = ap.parse_args()
    global APART, PREPARED, CAPTURED
    global NEW_GRADS, TIMEOUT_S, UNCHECKED, STAGE_TIMES, RS_PUSH
    STAGE_TIMES, RS_PUSH = args.stage_times, args.rs_push
    APART, PREPARED, CAPTURED, NEW_GRADS = args.apart, args.prepared, args.captured, args.new_grads
    UNCHECKED = args.unchecked
    TIMEOUT_S = args.timeout_s
    if NEW_GRADS and CAPTURED:
        ap.error("--new-grads times calls on new addresses; a captured graph replays fixed ones (drop --captured)")
    if args.unchecked and (not args.prepared or args.captured or args.new_grads):
        ap.error("--unchecked times run(check_addresses=False) of prepared runs: use it with --prepared alone")
    if args.from_rows:
        from tide_triton.bench.cli import recorded_rows

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
    elif args.profile and args.captured:
        # Seen on the H200: the profiler started in one rank thread while the
        # others replayed their graphs left a rank's GPU work unfinished (a flag wait never met).
        ap.error("--profile with --captured needs one process per rank (torchrun): profiling graph replays "
                 "of the single-process mode's rank threads hung")
    else:
        lead = True
        if args.profile:
            os.makedirs(args.profile, exist_ok=True)
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
        f"{info['date']} | copy ceiling {ceiling:.0f} GB/s (read + write, cuda:0, this run) | {launch} | "
        f"TIDE_TRITON_RUN_GRAPHS={envs.run_graphs()}, TIDE_TRITON_COPY_GRAPHS={envs.copy_graphs()}"
        f"{'' if torchrun else ' (auto makes no graphs with several ranks in this process)'}")
    say("| model | W | ring | reduce_scatter bf16->fp32 (ms) | of ceiling | host enqueue / CPU (ms) | driver calls | "
        "all_gather bf16 (ms) | of ceiling | host enqueue / CPU (ms) | driver calls | FSDP2 fp32 RS input / rank |")
    say("|---|---|---|---|---|---|---|---|---|---|---|---|", flush=True)
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
                    row = run(model, W, args.iters, ring, args.profile, args.share_gpu, args.host_profile)
            except Exception as e:  # noqa: BLE001 - one failed row must not lose the others
                say(f"| {model} | {W} | {ring >> 20} MiB | failed: {type(e).__name__}: {e} |", flush=True)
                continue
            row["ceiling_gbps"] = ceiling
            row["tensors_apart"] = APART
            row["new_grads"] = NEW_GRADS
            row["prepared"] = PREPARED or CAPTURED
            row["rs_push"] = RS_PUSH
            row["captured"] = CAPTURED
            row["address_check"] = not UNCHECKED  # prepared runs: run(check_addresses=...)
            in_process = 1 if torchrun else W  # the graph modes in effect (envs.graphs_in_process)
            row["copy_graphs"] = envs.copy_graphs(ranks_in_process=in_process)
            row["run_graphs"] = envs.run_graphs(ranks_in_process=in_process)
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
            if "rs_kernel_ms" in row:  # --profile: issue 15's device-time floor
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
