"""GEMM interference with one process per rank (``bench/interference.py`` under torchrun):
the victim GEMM on rank 0's GPU while every rank loops a reduce-scatter -- tide_triton's, or
NCCL's on FSDP2's path -- so that both are measured in the same run, as users run them.

    torchrun --nproc-per-node 2 bench/interference.py --backgrounds tide nccl [--share-gpu]
    TRITON_INTERPRET=1 torchrun --nproc-per-node 2 bench/interference.py --dry-run --backgrounds tide nccl

Rank r on ``cuda:LOCAL_RANK % GPUs`` (``--share-gpu``: every rank on cuda:0; NCCL then needs
>= 2.30, ``NCCL_MULTI_RANK_GPU_ENABLE=1``, given through ``LD_PRELOAD``).  Backgrounds:

* ``tide``: ``tide_triton.reduce_scatter`` (bf16 grads -> fp32 shards, avg) of the layer on a
  ``tide_triton.init()`` group (one per process);
* ``nccl``: FSDP2's reduce-scatter path -- ``chunk_cat`` of the bf16 grads into an fp32
  (W, F) buffer, then ``dist.reduce_scatter_tensor`` (AVG) on the NCCL process group (the CPU
  dry run: gloo, SUM).

Per background: calibration (every rank runs ``--bg-warmup`` iterations, each waited for; the
median of all but the first is the iteration alone), then rank 0 sizes the run to cover 1.5x
the GEMM window alone and every rank runs exactly that many iterations back to back (so no rank
stops early and leaves its peers in a collective).  Rank 0 runs its own in a thread while its
main thread times the GEMMs behind the stream gate once the first iteration is done.  Coverage
and progress come from rank 0's iterations (CUDA events on its GPU's clock); the other ranks
run in lockstep through the collective.
"""
from __future__ import annotations

import contextlib
import math
import os
import statistics
import traceback
from typing import Any, Callable

import torch

import interference_parts as base


def _device(args: Any) -> torch.device:
    if args.dry_run:
        return torch.device("cpu")
    local = int(os.environ.get("LOCAL_RANK", 0))
    dev = torch.device("cuda", 0 if args.share_gpu else local % torch.cuda.device_count())
    torch.cuda.set_device(dev)
    return dev


def _make(kind: str, tt: Any, shapes: Any, rank: int, W: int, device: torch.device, args: Any,
          rs_push: str | None = None):
    """(step, done, close, implementation) of one rank's background (``rs_push``: the tide
    group's ``GroupOptions.rs_push``)."""
    import torch.distributed as dist

    grads = [torch.randn(s, device=device).to(torch.bfloat16) for s in shapes]
    gpu = device.type == "cuda"
    if kind == "tide":
        g = tt.init(timeout_s=args.timeout, ring_bytes=args.ring_bytes, rs_push=rs_push or "auto")
        layout = tt.ShardLayout(shapes, W)
        shards = [torch.empty(s, device=device) for s in layout.shard_shapes(rank)]

        def step() -> None:
            tt.reduce_scatter(grads, shards, group=g, op="avg")

        def done() -> None:
            if gpu:
                tt.synchronize(g, timeout_s=args.timeout)
        return step, done, g.close, (f"tide_triton.reduce_scatter bf16 -> fp32 avg (rs_push={rs_push or 'auto'}, "
                                     "Triton sums)")
    from tide_triton.plan.layout import ShardLayout

    chunk_cat, cc_name = base._chunk_cat_fn()
    F = ShardLayout(shapes, W).flat_shard_numel
    rs_in = torch.empty(W, F, dtype=torch.float32, device=device)
    rs_out = torch.empty(F, dtype=torch.float32, device=device)
    op = dist.ReduceOp.AVG if gpu else dist.ReduceOp.SUM

    def nccl_step() -> None:
        chunk_cat(grads, W, rs_in)
        dist.reduce_scatter_tensor(rs_out, rs_in.view(-1), op=op)

    def nccl_done() -> None:
        if gpu:
            torch.cuda.current_stream(device).synchronize()
    name = dist.get_backend()
    return nccl_step, nccl_done, lambda: None, (f"FSDP2's path: {cc_name} bf16 -> fp32 (W, F) + reduce_scatter_tensor "
                                                f"fp32 {'AVG' if gpu else 'SUM'} ({name})")


def run_ranks(args: Any) -> int:
    """The torchrun mode of bench/interference.py (see the module docstring)."""
    import torch.distributed as dist

    import tide_triton as tt
    from tide_triton.bench.measure import env_info
    from tide_triton.plan.workloads import layer_shapes

    device = _device(args)
    gpu = device.type == "cuda"
    dist.init_process_group("cuda:nccl,cpu:gloo" if gpu else "gloo")
    rank, W = dist.get_rank(), dist.get_world_size()
    ctl = dist.new_group(backend="gloo")  # control messages, never on the GPU's queues
    shapes = base.TINY_SHAPES if args.model == "tiny" else layer_shapes(args.model)
    M, N, K = args.gemm
    info = env_info(device)
    if rank == 0:
        print(f"{info['gpu']} | torch {info['torch']} | triton {info['triton']} | CUDA {info['cuda']} | "
              f"git {info['git_sha']} | {info['date']}")
        print(f"victim: torch.mm {M}x{K} @ {K}x{N} bf16 on rank 0's {device}, {args.gemm_iters} per window | "
              f"background: {args.model} reduce-scatter, one process per rank, W={W}"
              f"{' on one GPU' if args.share_gpu else ''}")
    clock = base.Clock(device)
    gate = base.Gate(device) if rank == 0 else None
    a = torch.randn(M, K, device=device).to(torch.bfloat16)
    b = torch.randn(K, N, device=device).to(torch.bfloat16)
    c = torch.empty(M, N, dtype=torch.bfloat16, device=device)
    rows: list[dict] = []
    row0 = dict(script="interference", launch="torchrun", model=args.model, world_size=W, gemm=[M, N, K],
                gemm_iters=args.gemm_iters, gated=bool(gate and gate.ok), device=str(device),
                share_gpu=bool(args.share_gpu), **info)
    bg_stream = torch.cuda.Stream(device) if gpu else None
    ok = True
    for gemm_priority in args.gemm_priority:
        gstream, prio = base.gemm_stream(device, gemm_priority)
        row0.update(gemm_priority=gemm_priority, gemm_stream_priority=prio)
        alone = None
        if rank == 0:
            alone = base.gemm_alone(a, b, c, args.gemm_iters, clock, gate, gstream)
            rows.append({**row0, "background": "none", **{k: v for k, v in alone.items() if k != "window"}})
        plan = [(k, p) for k in args.backgrounds for p in (args.tide_rs_push if k == "tide" else [None])]
        for kind, rs_push in plan:
            row = _one(kind, tt, shapes, rank, W, device, args, clock, gate, gstream, bg_stream, a, b, c,
                       alone, ctl, rs_push)
            ok = ok and "error" not in row
            if rank == 0:
                rows.append({**row0, **row})
    if rank == 0:
        base.print_rows(rows)
        if args.dry_run:
            print("(dry run: CPU, tiny sizes, Triton interpreter, gloo for NCCL -- the numbers say nothing about GPUs)")
        base.append_rows(args.json, rows)
    flags = [None] * W
    dist.all_gather_object(flags, ok, group=ctl)
    dist.destroy_process_group()
    return 0 if all(flags) else 1


def _one(kind: str, tt: Any, shapes: Any, rank: int, W: int, device: torch.device, args: Any, clock: Any,
         gate: Any, gstream: Any, bg_stream: Any, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor,
         alone: dict | None, ctl: Any, rs_push: str | None = None) -> dict:
    """One background on every rank; rank 0's row (others: {})."""
    import torch.distributed as dist

    gpu = device.type == "cuda"
    close: Callable[[], None] = lambda: None  # noqa: E731
    err = None
    try:
        step, done, close, impl = _make(kind, tt, shapes, rank, W, device, args, rs_push)
    except Exception as e:  # noqa: BLE001 - every rank learns below, nobody waits in a collective
        err = f"setup on rank {rank}: {type(e).__name__}: {e}"
        traceback.print_exc()
    errs = [None] * W
    dist.all_gather_object(errs, err, group=ctl)
    if any(errs):
        close()
        return {"background": kind, "rs_push": rs_push, "error": "; ".join(x for x in errs if x)}
    ctx = torch.cuda.stream(bg_stream) if gpu else contextlib.nullcontext()
    try:
        with ctx:  # calibration: every rank, each iteration waited for
            durs = []
            for _ in range(max(2, args.bg_warmup)):
                s = clock.mark()
                step()
                e = clock.mark()
                done()
                clock.sync(e)
                durs.append(clock.at(e) - clock.at(s))
        iter_ms = statistics.median(durs[1:])
        n = [0]
        if rank == 0:
            n[0] = min(100_000, math.ceil(1.5 * alone["window_ms"] / max(iter_ms, 1e-3)) + 2)
        dist.broadcast_object_list(n, src=0, group=ctl)
        dist.barrier(group=ctl)
        bg = base.Background(kind, 1, device, clock, lambda r: step(), lambda r: done(), args.timeout, limit=n[0])
        if rank != 0:
            bg.start()
            bg.join()
            if bg.errors:
                raise RuntimeError("; ".join(bg.errors))
            return {}
        bg.start()
        bg.wait_iterations(1)
        res = base.time_gemms(a, b, c, args.gemm_iters, clock, gate, gstream)
        bg.join()
        if bg.errors:
            raise RuntimeError("; ".join(bg.errors))
        st = bg.stats(res["window"], 1, alone_ms=[iter_ms])
        return {"background": kind, "background_impl": impl, "rs_push": rs_push, "bg_iters": n[0],
                **base.window_row(res, alone, st)}
    except Exception as e:  # noqa: BLE001 - a rank stuck in a collective is the hang guard's
        traceback.print_exc()
        return {"background": kind, "rs_push": rs_push, "error": f"rank {rank}: {type(e).__name__}: {e}"}
    finally:
        if gpu:
            torch.cuda.synchronize(device)
        close()
        if gpu:
            torch.cuda.empty_cache()
