"""Interference: how much a reduce-scatter running next to a GEMM slows the GEMM down.

    python bench/interference.py [--model llama-3.1-70b] [--world-size 2] [--gemm-iters 200] [--json out.jsonl]
    TRITON_INTERPRET=1 python bench/interference.py --dry-run     # CPU, tiny sizes, logic only
    torchrun --nproc-per-node 2 bench/interference.py --backgrounds tide nccl [--share-gpu]

Under torchrun: one process per rank, tide_triton beside NCCL on FSDP2's path in the same run
(``bench/interference_ranks.py`` says how).  Otherwise one process, one GPU.  The victim is a single-wave GEMM, ``torch.mm`` of (M, K) x (K, N) bf16
with M x N x K = 1024 x 16896 x 8192 (about 0.35 ms on an H200), on its own stream.  Each GEMM
is timed with its own pair of CUDA events; ``gemm-iters`` (>= 50) GEMMs are enqueued behind a
gate (``cuStreamWaitValue32`` on a device word, opened by ``cuStreamWriteValue32`` from another
stream once all are enqueued: no host gaps between GEMMs, no kernel), so the timed window is
one back-to-back run.  Reported: median / p90 / mean per GEMM, and the slowdown of the median
and of the mean against the GEMM alone (the mean is the throughput loss: a background that holds
every SM for a while stalls a few GEMMs a lot and leaves the median alone).  ``--tide-max-ctas``
sweeps the accumulation kernel's grid bound: fewer CTAs hold fewer SMs for longer.

Backgrounds (each looped on W ranks, one thread and one stream per rank, as in
bench/collectives_gpu.py):

* ``tide``: ``tide_triton.reduce_scatter`` (bf16 grads -> fp32 shards, avg) of one model layer
  on ``tt.local_groups(W)``: bytes move on copy engines, sums in short Triton kernels;
* ``sm``: an SM-based reduce-scatter equivalent, FSDP2-style: every rank ``chunk_cat``s its bf16
  grads into an fp32 (W, F) buffer (FSDP2's reduce-scatter input, ``torch.ops.fsdp.chunk_cat``),
  then every destination d sums the W ranks' row d with ``torch.sum`` (fp32, the buffers are in the
  same process) and scales by 1/W -- the reduction NCCL's kernel would do, done by torch kernels
  on SMs, without NCCL's transfer.

Each background is started, runs ``--bg-warmup`` iterations alone (the first compiles kernels;
the later ones give its time per iteration alone), then the GEMMs are timed while it runs, then
it is stopped by a flag that all ranks read at the same iteration boundary (a rank leaving early
would leave its peers waiting in the collective) and joined with a timeout.  Every background
iteration is bracketed by CUDA events on the rank's stream, so the report says, on the GPU's
clock, which fraction of the GEMM window a background iteration was in flight (``coverage``,
min over ranks: must be ~100% for the numbers to mean anything), and how many background
iterations' worth of work was done inside the window (``bg iters in window``: sum over
iterations of the part of each inside the window, per rank) vs the iterations the background
would have completed in that time alone (``bg progress`` = ratio).

Also reported: SM time of one tide_triton reduce_scatter (all W ranks, under torch.profiler),
``sm_time_from_trace`` from bench/nccl_baseline.py: SM µs = sum_k dur_k * min(ctas_k, n_SM) / n_SM.
"""
from __future__ import annotations

import argparse
import faulthandler
import os
import sys
import threading
import traceback
from typing import Callable, Sequence

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

# One process drives every rank (local_groups): their streams must not share hardware queues
# (tide_triton.group.single_process.hardware_queues); read when CUDA initialises, before any GEMM.
os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "32")
os.environ.setdefault("CUDA_MODULE_LOADING", "EAGER")  # and no lazy kernel load may sync the context

import torch  # noqa: E402

from interference_parts import (TINY_SHAPES, Background, Clock, Gate, append_rows, gemm_alone,  # noqa: E402
                                gemm_stream, make_sm, make_tide, print_rows, profile_sm_time,
                                short_kernel_names, time_gemms, window_row)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama-3.1-70b", help="layer from tide_triton.plan.workloads, or 'tiny'")
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--gemm", nargs=3, type=int, default=[1024, 16896, 8192], metavar=("M", "N", "K"))
    ap.add_argument("--gemm-iters", type=int, default=200, help="GEMMs per timed window (>= 50)")
    ap.add_argument("--backgrounds", nargs="+", default=None, choices=["tide", "sm", "nccl"],
                    help="default: tide sm (one process), tide nccl (torchrun); nccl needs torchrun, sm one process")
    ap.add_argument("--share-gpu", action="store_true",
                    help="torchrun: every rank on cuda:0 (default: rank on cuda:LOCAL_RANK %% GPUs)")
    ap.add_argument("--tide-max-ctas", nargs="+", type=int, default=[0],
                    help="accumulation grid bounds to sweep for the tide background (0: one CTA per tile)")
    ap.add_argument("--tide-rs-push", nargs="+", default=["auto"], choices=["auto", "copy_engine", "kernel"],
                    help="GroupOptions.rs_push values to sweep for the tide background (kernel pushes spend SMs "
                         "on the copies: their grid is bounded by --tide-max-ctas too)")
    ap.add_argument("--gemm-priority", nargs="+", default=["default", "high"], choices=["default", "high"],
                    help="the GEMM's stream priority: default (0, the lowest, as the collectives' streams) or "
                         "high (the highest CUDA offers: the collectives' kernels yield to it); one window each")
    ap.add_argument("--bg-warmup", type=int, default=4, help="background iterations before the window")
    ap.add_argument("--ring-bytes", type=int, default=256 << 20)
    ap.add_argument("--no-profile", action="store_true", help="skip the SM time of one tide reduce_scatter")
    ap.add_argument("--timeout", type=float, default=120.0, help="per wait on a background (s)")
    ap.add_argument("--dry-run", action="store_true",
                    help="CPU, tiny sizes, Triton interpreter (sets TRITON_INTERPRET=1): checks the logic")
    ap.add_argument("--json", default=None, help="append result rows (with env info) to this JSON-lines file")
    args = ap.parse_args(argv)
    torchrun = "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ)
    if args.backgrounds is None:
        args.backgrounds = ["tide", "nccl"] if torchrun else ["tide", "sm"]
    if torchrun:
        args.world_size = int(os.environ["WORLD_SIZE"])
        if "sm" in args.backgrounds:
            ap.error("--backgrounds sm runs in one process only (under torchrun: tide, nccl)")
    elif "nccl" in args.backgrounds:
        ap.error("--backgrounds nccl needs one process per rank: run under torchrun")
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"  # before tide_triton imports triton
        args.model = "tiny" if args.model == "llama-3.1-70b" else args.model
        args.gemm = [64, 64, 64]
        args.gemm_iters = max(50, min(args.gemm_iters, 60))
        args.bg_warmup = min(args.bg_warmup, 2)
        args.ring_bytes = min(args.ring_bytes, 4096 * args.world_size)
    elif args.gemm_iters < 50:
        ap.error("--gemm-iters must be >= 50")
    faulthandler.dump_traceback_later(float(os.environ.get("TIDE_HANG_DUMP_S", 900)), exit=True, file=sys.stderr)
    if torchrun:
        from interference_ranks import run_ranks

        return run_ranks(args)

    import tide_triton as tt
    from tide_triton.bench.measure import env_info
    from tide_triton.plan.workloads import layer_shapes

    device = torch.device("cpu" if args.dry_run else "cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: use --dry-run for the CPU check", file=sys.stderr)
        return 2
    info = env_info(device)
    W = args.world_size
    shapes = TINY_SHAPES if args.model == "tiny" else layer_shapes(args.model)
    M, N, K = args.gemm
    print(f"{info['gpu']} | torch {info['torch']} | triton {info['triton']} | CUDA {info['cuda']} | "
          f"git {info['git_sha']} | {info['date']}")
    print(f"victim: torch.mm {M}x{K} @ {K}x{N} bf16, {args.gemm_iters} per window | background: "
          f"{args.model} reduce-scatter on W={W} local ranks")
    clock = Clock(device)
    gate = Gate(device)
    if device.type == "cuda" and not gate.ok:
        print(f"WARNING: no stream gate ({gate.why}): GEMMs are timed as enqueued (host gaps possible)")
    a = torch.randn(M, K, device=device).to(torch.bfloat16)
    b = torch.randn(K, N, device=device).to(torch.bfloat16)
    c = torch.empty(M, N, dtype=torch.bfloat16, device=device)
    rows: list[dict] = []
    base = dict(script="interference", model=args.model, world_size=W, gemm=[M, N, K],
                gemm_iters=args.gemm_iters, gated=gate.ok, device=str(device), **info)

    for gemm_priority in args.gemm_priority:
        # CUDA's stream priorities: 0 (default) is the lowest; the collectives' kernels run on
        # default-priority streams, so a GEMM stream of higher priority puts them below it.
        gstream, prio = gemm_stream(device, gemm_priority)
        base["gemm_priority"] = gemm_priority
        base["gemm_stream_priority"] = prio
        try:
            alone = gemm_alone(a, b, c, args.gemm_iters, clock, gate, gstream)
            rows.append({**base, "background": "none", **{k: v for k, v in alone.items() if k != "window"}})
        except Exception as e:  # noqa: BLE001
            print(f"ERROR timing the GEMM alone: {type(e).__name__}: {e}")
            traceback.print_exc()
            return 1

        plan = [(k, m, p) for k in args.backgrounds
                for m in (args.tide_max_ctas if k == "tide" else [0])
                for p in (args.tide_rs_push if k == "tide" else [None])]
        for kind, max_ctas, rs_push in plan:
            bg = None
            close: Callable[[], None] = lambda: None  # noqa: E731
            try:
                if kind == "tide":
                    _, step, done, close = make_tide(tt, shapes, W, device, args.ring_bytes, args.timeout,
                                                     max_ctas or None, rs_push=rs_push)
                    impl = (f"tide_triton.reduce_scatter bf16 -> fp32 avg (rs_push={rs_push}, Triton sums, "
                            f"{f'max_ctas={max_ctas}' if max_ctas else 'one CTA per tile'})")
                else:
                    step, done, impl = make_sm(shapes, W, device)
                bg = Background(kind, W, device, clock, step, done, args.timeout)
                bg.start()
                bg.wait_iterations(args.bg_warmup)
                before = min(bg.completed)
                marks: dict = {}
                res = time_gemms(a, b, c, args.gemm_iters, clock, gate, gstream,
                                 on_open=lambda: marks.update(c0=list(bg.completed)))
                marks["c1"] = list(bg.completed)
                if min(bg.completed) <= before and bg.errors:
                    raise RuntimeError("; ".join(bg.errors))
                bg.stop()
                if bg.errors:
                    raise RuntimeError("; ".join(bg.errors))
                st = bg.stats(res["window"], before)
                row = {**base, "background": kind, "background_impl": impl, "max_ctas": max_ctas or None,
                       "rs_push": rs_push,
                       **window_row(res, alone, st),
                       "bg_completed_host": [y - x for x, y in zip(marks["c0"], marks["c1"])]}
                rows.append(row)
            except Exception as e:  # noqa: BLE001
                print(f"ERROR background {kind}: {type(e).__name__}: {e}")
                traceback.print_exc()
                rows.append({**base, "background": kind, "max_ctas": max_ctas or None, "rs_push": rs_push,
                             "error": f"{type(e).__name__}: {e}"})
                if bg is not None:
                    try:
                        bg.stop()
                    except Exception:  # noqa: BLE001
                        pass
            finally:
                try:
                    close()
                except Exception as e:  # noqa: BLE001
                    print(f"ERROR closing {kind}: {e}")
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                    torch.cuda.empty_cache()

    sm_row = None
    if not args.no_profile:
        try:
            groups, step, done, close = make_tide(tt, shapes, W, device, args.ring_bytes, args.timeout)
            try:
                def once_all() -> None:
                    errs: list = []

                    def body(r: int) -> None:
                        try:
                            if device.type == "cuda":
                                with torch.cuda.stream(torch.cuda.Stream(device)):
                                    step(r)
                                    done(r)
                            else:
                                step(r)
                        except BaseException as e:  # noqa: BLE001
                            errs.append(f"rank {r}: {type(e).__name__}: {e}")

                    ts = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(W)]
                    for t in ts:
                        t.start()
                    for t in ts:
                        t.join(args.timeout)
                    if errs or any(t.is_alive() for t in ts):
                        raise RuntimeError(errs or "a rank thread did not finish")

                once_all()  # warm: kernels compiled, heaps mapped
                res = profile_sm_time(once_all, device)
                sm_row = {**base, "background": "sm_time", "op": "tide reduce_scatter (all W ranks, one call)",
                          "sm_us": res["sm_us"], "sm_us_per_rank": None if res["sm_us"] is None else res["sm_us"] / W,
                          "kernel_us": res["kernel_us"], "n_kernels": res["n_kernels"],
                          "memcpy_us": res["memcpy_us"], "n_memcpy": res["n_memcpy"], "n_sm": res.get("n_sm"),
                          "kernels": res["kernels"]}
                rows.append(sm_row)
            finally:
                close()
        except Exception as e:  # noqa: BLE001
            print(f"ERROR SM time: {type(e).__name__}: {e}")
            traceback.print_exc()

    print_rows(rows)
    if sm_row is not None:
        sm = "n/a (CPU)" if sm_row["sm_us"] is None else f"{sm_row['sm_us']:.1f} µs ({sm_row['sm_us_per_rank']:.1f} per rank)"
        print(f"\nSM time of one tide_triton reduce_scatter ({args.model}, W={W}, all ranks): {sm} | "
              f"{sm_row['n_kernels']} kernels, {sm_row['kernel_us']:.1f} µs kernel time | copy engines: "
              f"{sm_row['n_memcpy']} copies, {sm_row['memcpy_us']:.1f} µs | {short_kernel_names(sm_row)}")
    if args.dry_run:
        print("(dry run: CPU, tiny sizes, Triton interpreter -- the numbers say nothing about GPUs)")
    append_rows(args.json, rows)
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
