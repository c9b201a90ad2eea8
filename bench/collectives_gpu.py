"""Collective timings on one GPU, single-process multi-rank mode (one thread per rank, each
with its own heap and copy stream, so ranks' work overlaps as on a node).

    python bench/collectives_gpu.py [--world-sizes 2 4] [--models llama-3.1-70b qwen3-30b-a3b]

reduce_scatter: bf16 full gradients -> fp32 shards (avg); all_gather: bf16 shards -> bf16
parameters.  Time per collective is the wall time of ``iters`` back-to-back collectives on
every rank divided by ``iters`` (all ranks start together, end with a synchronize).
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import threading
import time

# Ranks' streams must not share hardware queues (see tide_triton.group._enough_hardware_queues).
os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "32")

import torch  # noqa: E402

import tide_triton as tt
from tide_triton.bench import copy_ceiling, env_info
from tide_triton.workloads import layer_shapes


def run(model: str, W: int, iters: int, ring_bytes: int, profile: str | None = None) -> dict:
    dev = torch.device("cuda")
    shapes = layer_shapes(model)
    layout = tt.ShardLayout(shapes, W)
    groups = tt.local_groups(W, timeout_s=120, ring_bytes=ring_bytes)
    grads = [[torch.randn(s, device=dev).to(torch.bfloat16) for s in shapes] for _ in range(W)]
    shards = [[torch.empty(s, device=dev) for s in layout.shard_shapes(r)] for r in range(W)]
    bshards = [[x.to(torch.bfloat16) for x in shards[r]] for r in range(W)]
    params = [[torch.empty(s, dtype=torch.bfloat16, device=dev) for s in shapes] for _ in range(W)]
    barrier = threading.Barrier(W)
    prof_ctx: list = [None]
    times: dict = {}
    errors: list = []

    def rank_main(r: int) -> None:
        try:
            with torch.cuda.stream(torch.cuda.Stream(dev)):  # every rank its own compute stream
                rank_body(r)
        except BaseException as e:  # noqa: BLE001
            errors.append((r, repr(e)))
            barrier.abort()

    def rank_body(r: int) -> None:
        g = groups[r]
        for name, fn in [("reduce_scatter", lambda: tt.reduce_scatter(grads[r], shards[r], group=g, op="avg")),
                         ("all_gather", lambda: tt.all_gather(bshards[r], params[r], group=g))]:
            fn()
            tt.synchronize(g, timeout_s=120)
            barrier.wait()
            t0 = time.perf_counter()
            for _ in range(iters):
                fn()
            t1 = time.perf_counter()  # host time to enqueue (pacing included)
            tt.synchronize(g, timeout_s=120)
            barrier.wait()
            if r == 0:
                times[name] = (time.perf_counter() - t0) / iters * 1e3
                times[name + "_host"] = (t1 - t0) / iters * 1e3
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
    # Bytes every rank moves (read + written), all ranks together since they share the GPU:
    # RS: copies of the (W-1)/W of the bf16 grads that go to peers, then the reduction reads
    # W bf16 contributions of the shard and writes it in fp32; AG (bf16): the own shard into
    # the heap block, then every rank's rows into every parameter.
    rs_bytes = W * (2 * (W - 1) * 2 * numel // W + 2 * numel + 4 * numel // W)
    ag_bytes = W * (2 * 2 * numel // W + 2 * 2 * numel)
    if prof_ctx[0] is not None:
        _profile_summary(prof_ctx[0], profile, f"{model} W={W} ring={ring_bytes >> 20} MiB")
    return dict(model=model, world_size=W, rs_ms=times["reduce_scatter"], ag_ms=times["all_gather"],
                rs_host_ms=times["reduce_scatter_host"], ag_host_ms=times["all_gather_host"],
                staging_bytes=ring_bytes, fsdp_rs_input_bytes=4 * sum(layout.padded_numels),
                layer_numel=numel, rs_bytes=rs_bytes, ag_bytes=ag_bytes)


def _profile_summary(prof, path: str, title: str) -> None:
    """Busy time per kind of GPU activity in one reduce-scatter (all ranks): kernels, copies,
    and the span from the first activity to the last."""
    import collections

    trace = os.path.join(path, "rs_trace.json")
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
    print(f"profile {title}: span {(hi - lo) / 1e3:.2f} ms")
    for kind, us in busy.most_common(12):
        print(f"  {kind}: {count[kind]} x, {us / 1e3:.3f} ms busy")


def main() -> None:
    import faulthandler
    import sys

    faulthandler.dump_traceback_later(float(__import__("os").environ.get("TIDE_HANG_DUMP_S", "1e9")), exit=True,
                                      file=sys.stderr)
    ap = argparse.ArgumentParser()
    ap.add_argument("--world-sizes", nargs="+", type=int, default=[2, 4])
    ap.add_argument("--models", nargs="+", default=["llama-3.1-70b", "qwen3-30b-a3b"])
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--ring-bytes", type=int, nargs="+", default=[256 << 20])
    ap.add_argument("--profile", default=None, help="folder: profile one reduce-scatter of the first row")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    dev = torch.device("cuda")
    info = env_info(dev)
    ceiling = copy_ceiling(dev, 4 << 30).gbps()  # device copy, read + write, this run
    torch.cuda.empty_cache()
    print(f"{info['gpu']} | torch {info['torch']} | triton {info['triton']} | git {info['git_sha']} | "
          f"{info['date']} | copy ceiling {ceiling:.0f} GB/s (read + write, this run)")
    print("| model | W | ring | reduce_scatter bf16->fp32 (ms) | of ceiling | host enqueue (ms) | "
          "all_gather bf16 (ms) | of ceiling | host enqueue (ms) | FSDP2 fp32 RS input / rank |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    first = True
    for model, W, ring in itertools.product(args.models, args.world_sizes, args.ring_bytes):
        try:
            row = run(model, W, args.iters, ring, args.profile if first else None)
        except Exception as e:  # noqa: BLE001 - one failed row must not lose the others
            print(f"| {model} | {W} | {ring >> 20} MiB | failed: {type(e).__name__}: {e} |", flush=True)
            continue
        first = False
        row["ceiling_gbps"] = ceiling
        rs_frac = row["rs_bytes"] / (row["rs_ms"] * 1e-3) / 1e9 / ceiling
        ag_frac = row["ag_bytes"] / (row["ag_ms"] * 1e-3) / 1e9 / ceiling
        print(f"| {model} | {W} | {ring >> 20} MiB | {row['rs_ms']:.2f} | {rs_frac:.1%} | {row['rs_host_ms']:.2f} | "
              f"{row['ag_ms']:.2f} | {ag_frac:.1%} | {row['ag_host_ms']:.2f} | "
              f"{row['fsdp_rs_input_bytes'] / 2**20:.0f} MiB |", flush=True)
        if args.json:
            with open(args.json, "a") as f:
                f.write(json.dumps({**row, **info}) + "\n")
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
