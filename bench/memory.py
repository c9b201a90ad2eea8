"""Memory of one reduce-scatter per rank: tide_triton (measured, and from the layout) vs
FSDP2's fp32 reduce-scatter input.

    python bench/memory.py [--models llama-3.1-70b qwen3-30b-a3b wan2.2-14b] [--world-sizes 2 3 4 5 6 7 8] [--json out.jsonl]
    python bench/memory.py --layout-only            # no GPU: the layout part only
    TRITON_INTERPRET=1 python bench/memory.py --dry-run   # CPU: the measured path on tiny shapes

Measured (GPU, single-process multi-rank mode, ``tt.local_groups(W)``, one thread and stream
per rank): bf16 full gradients and fp32 shards of one layer are allocated for every rank first
(they are the caller's, not the collective's); then, around one ``tt.reduce_scatter`` on every
rank (op avg):

* ``torch peak`` = ``torch.cuda.max_memory_allocated() - memory_allocated() before``, after
  ``reset_peak_memory_stats`` -- everything the collective took from torch's caching allocator,
  all W ranks together (one process), divided by W for "per rank"; for the first call (which also
  makes the group's persistent buffers) and for a second call (steady state);
* ``heap`` = ``group.transport(dev).heap_nbytes()`` of each rank: the VMM heap (flags + receive
  ring + all-gather region once used) that tide_triton maps itself, outside torch's allocator;
* ``tide total / rank`` = heap (max over ranks) + torch peak of the first call / W.

From the layout (any W, here W = 2..8 and 64, no GPU): tide_triton's receive ring,
``tide_triton.plan.schedule.ring_plan(layout, ring_bytes, 2, stages).staging_elems() * 2`` bytes, vs
FSDP2's reduce-scatter input with ``reduce_dtype=fp32``: ``4 * sum(padded_numels)`` bytes per rank
(the whole layer in fp32, padded to W*c rows per parameter), plus its fp32 output (``4 *
flat_shard_numel``) for reference.
"""
from __future__ import annotations

import argparse
import faulthandler
import json
import os
import sys
import threading
import traceback
from typing import Sequence

_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(_HERE)
for _p in (_ROOT, _HERE):
    if _p not in sys.path:
        sys.path.insert(0, _p)

# One process drives every rank (local_groups): their streams must not share hardware queues
# (tide_triton.group.single_process.hardware_queues); read when CUDA initialises, before any GEMM.
os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "32")
os.environ.setdefault("CUDA_MODULE_LOADING", "EAGER")  # and no lazy kernel load may sync the context

import torch  # noqa: E402

MiB = float(1 << 20)


def _shapes(model: str) -> tuple:
    if model == "tiny":
        try:
            from bench.nccl_baseline import TINY_SHAPES
        except ImportError:
            from nccl_baseline import TINY_SHAPES  # type: ignore
        return TINY_SHAPES
    from tide_triton.plan.workloads import layer_shapes

    return layer_shapes(model)


def layout_row(model: str, W: int, ring_bytes: int, stages: int) -> dict:
    from tide_triton.plan.layout import ShardLayout
    from tide_triton.plan.schedule import FlagMap, ring_plan

    layout = ShardLayout(_shapes(model), W)
    plan = ring_plan(layout, ring_bytes, 2, stages)
    return dict(model=model, world_size=W, ring_bytes=ring_bytes, stages=stages,
                tide_ring_staging_bytes=plan.staging_elems() * 2, tide_flag_bytes=FlagMap(W, stages).n_flags * 8,
                chunks_per_rs=plan.rounds,
                fsdp_rs_input_fp32_bytes=4 * sum(layout.padded_numels),
                fsdp_rs_output_fp32_bytes=4 * layout.flat_shard_numel,
                layer_numel=sum(layout.numels))


def measure(model: str, W: int, device: torch.device, ring_bytes: int, stages: int, timeout_s: float) -> dict:
    import tide_triton as tt

    shapes = _shapes(model)
    layout = tt.ShardLayout(shapes, W)
    gpu = device.type == "cuda"
    groups = tt.local_groups(W, timeout_s=timeout_s, ring_bytes=ring_bytes, stages=stages,
                             devices=[device] * W if gpu else None)  # every rank's heap on one GPU
    out: dict = {}
    try:
        grads = [[torch.randn(s, device=device).to(torch.bfloat16) for s in shapes] for _ in range(W)]
        shards = [[torch.empty(s, device=device) for s in layout.shard_shapes(r)] for r in range(W)]
        streams = [torch.cuda.Stream(device) if gpu else None for _ in range(W)]

        def one_call() -> None:
            errs: list[str] = []

            def body(r: int) -> None:
                try:
                    if gpu:
                        with torch.cuda.stream(streams[r]):
                            tt.reduce_scatter(grads[r], shards[r], group=groups[r], op="avg")
                            tt.synchronize(groups[r], timeout_s=timeout_s)
                    else:
                        tt.reduce_scatter(grads[r], shards[r], group=groups[r], op="avg")
                except BaseException as e:  # noqa: BLE001
                    errs.append(f"rank {r}: {type(e).__name__}: {e}")

            ts = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(W)]
            for t in ts:
                t.start()
            for t in ts:
                t.join(timeout_s + 30)
            if any(t.is_alive() for t in ts):
                raise TimeoutError(f"a rank thread did not finish within {timeout_s + 30} s ({errs})")
            if errs:
                raise RuntimeError("; ".join(errs))
            if gpu:
                torch.cuda.synchronize(device)

        for call in (1, 2):
            if gpu:
                torch.cuda.synchronize(device)
                torch.cuda.reset_peak_memory_stats(device)
                m0 = torch.cuda.memory_allocated(device)
            one_call()
            if gpu:
                out[f"torch_peak_call{call}_bytes"] = torch.cuda.max_memory_allocated(device) - m0
                out[f"torch_kept_call{call}_bytes"] = torch.cuda.memory_allocated(device) - m0
            else:
                out[f"torch_peak_call{call}_bytes"] = None
                out[f"torch_kept_call{call}_bytes"] = None
        heaps = [g.transport(device).heap_nbytes() for g in groups]
        out["heap_bytes_per_rank"] = heaps
        out["heap_bytes_max"] = max(heaps)
        peak1 = out["torch_peak_call1_bytes"]
        out["tide_total_per_rank_bytes"] = max(heaps) + (peak1 / W if peak1 is not None else 0)
        del grads, shards
    finally:
        for g in groups:
            try:
                g.close()
            except Exception as e:  # noqa: BLE001
                print(f"  (close: {type(e).__name__}: {e})")
        if gpu:
            torch.cuda.synchronize(device)
            torch.cuda.empty_cache()
    return out


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["llama-3.1-70b", "qwen3-30b-a3b", "wan2.2-14b"])
    ap.add_argument("--world-sizes", nargs="+", type=int, default=[2, 3, 4, 5, 6, 7, 8],
                    help="measured world sizes (single-process mode)")
    ap.add_argument("--layout-world-sizes", nargs="+", type=int, default=[16, 64],
                    help="world sizes shown from the layout only (beside the measured ones)")
    ap.add_argument("--ring-bytes", type=int, default=256 << 20)
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=120.0)
    ap.add_argument("--layout-only", action="store_true", help="no GPU needed: the layout table only")
    ap.add_argument("--dry-run", action="store_true",
                    help="CPU: the measured path on tiny shapes through the Triton interpreter (no byte counts)")
    ap.add_argument("--json", default=None, help="append result rows (with env info) to this JSON-lines file")
    args = ap.parse_args(argv)
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"
        args.models = ["tiny"]
        args.world_sizes = [2, 3]
        args.ring_bytes = min(args.ring_bytes, 4096 * 8)
    faulthandler.dump_traceback_later(float(os.environ.get("TIDE_HANG_DUMP_S", 1200)), exit=True, file=sys.stderr)
    from tide_triton.bench.measure import env_info

    measured = not args.layout_only
    device = torch.device("cpu" if (args.dry_run or args.layout_only) else "cuda")
    if measured and device.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: use --layout-only (or --dry-run)", file=sys.stderr)
        return 2
    info = env_info(device)
    print(f"{info['gpu']} | torch {info['torch']} | triton {info['triton']} | CUDA {info['cuda']} | "
          f"git {info['git_sha']} | {info['date']}")
    print(f"ring_bytes = {args.ring_bytes / MiB:.2f} MiB, stages = {args.stages}, bf16 gradients, fp32 shards")
    rows: list[dict] = []
    failures = 0
    base = dict(script="memory", device=str(device), **info)
    for model in args.models:
        lines = [f"\n### {model}", "",
                 "| W | source | tide torch peak / rank, call 1 (MiB) | call 2 (MiB) | tide heap / rank (MiB) | "
                 "tide total / rank (MiB) | tide ring (layout, MiB) | chunks / RS | FSDP2 fp32 RS input / rank (MiB) | "
                 "FSDP2 fp32 RS output (MiB) |",
                 "|---|---|---|---|---|---|---|---|---|---|"]
        if measured:
            todo = [(W, True) for W in args.world_sizes]
            todo += [(W, False) for W in args.layout_world_sizes if W not in args.world_sizes]
        else:  # layout only: the measured world sizes too, from the layout
            todo = [(W, False) for W in sorted(set(args.world_sizes) | set(args.layout_world_sizes))]
        for W, meas in sorted(todo):
            try:
                lay = layout_row(model, W, args.ring_bytes, args.stages)
            except Exception as e:  # noqa: BLE001
                failures += 1
                lines.append(f"| {W} | ERROR layout: {type(e).__name__}: {e} | | | | | | | | |")
                continue
            row = {**base, **lay, "measured": meas}
            m: dict = {}
            if meas:
                try:
                    m = measure(model, W, device, args.ring_bytes, args.stages, args.timeout)
                    row.update(m)
                except Exception as e:  # noqa: BLE001
                    failures += 1
                    traceback.print_exc()
                    row["error"] = f"{type(e).__name__}: {e}"
            rows.append(row)

            def f(x: object) -> str:
                return "" if x is None else f"{x / MiB:.1f}"

            src = "measured" if meas else "layout"
            if "error" in row:
                src = f"ERROR: {row['error']}"
            lines.append(f"| {W} | {src} | {f(m.get('torch_peak_call1_bytes'))} | {f(m.get('torch_peak_call2_bytes'))} | "
                         f"{f(m.get('heap_bytes_max'))} | {f(m.get('tide_total_per_rank_bytes'))} | "
                         f"{f(lay['tide_ring_staging_bytes'])} | {lay['chunks_per_rs']} | "
                         f"{lay['fsdp_rs_input_fp32_bytes'] / MiB:.0f} | {f(lay['fsdp_rs_output_fp32_bytes'])} |")
            if args.json:
                try:
                    with open(args.json, "a") as fh:
                        fh.write(json.dumps(row, default=str) + "\n")
                except OSError as e:
                    print(f"ERROR writing {args.json}: {e}")
        print("\n".join(lines), flush=True)
    if args.dry_run:
        print("\n(dry run: CPU host transport, no torch byte counts; heap = the host transport's heap)")
    if args.json:
        print(f"rows appended to {args.json}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
