"""Collective timings on one GPU, single-process multi-rank mode (one thread per rank, each
with its own heap and copy stream, so ranks' work overlaps as on a node).

    python bench/collectives_gpu.py [--world-sizes 2 4] [--models llama-3.1-70b qwen3-30b-a3b]

reduce_scatter: bf16 full gradients -> fp32 shards (avg); all_gather: bf16 shards -> bf16
parameters.  Time per collective is the wall time of ``iters`` back-to-back collectives on
every rank divided by ``iters`` (all ranks start together, end with a synchronize).
"""
from __future__ import annotations

import argparse
import json
import threading
import time

import torch

import tide_triton as tt
from tide_triton.bench import env_info
from tide_triton.workloads import layer_shapes


def run(model: str, W: int, iters: int, ring_bytes: int) -> dict:
    dev = torch.device("cuda")
    shapes = layer_shapes(model)
    layout = tt.ShardLayout(shapes, W)
    groups = tt.local_groups(W, timeout_s=120, ring_bytes=ring_bytes)
    grads = [[torch.randn(s, device=dev).to(torch.bfloat16) for s in shapes] for _ in range(W)]
    shards = [[torch.empty(s, device=dev) for s in layout.shard_shapes(r)] for r in range(W)]
    bshards = [[x.to(torch.bfloat16) for x in shards[r]] for r in range(W)]
    params = [[torch.empty(s, dtype=torch.bfloat16, device=dev) for s in shapes] for _ in range(W)]
    barrier = threading.Barrier(W)
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
            tt.synchronize(g, timeout_s=120)
            barrier.wait()
            if r == 0:
                times[name] = (time.perf_counter() - t0) / iters * 1e3

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
    return dict(model=model, world_size=W, rs_ms=times["reduce_scatter"], ag_ms=times["all_gather"],
                staging_bytes=ring_bytes, fsdp_rs_input_bytes=4 * sum(layout.padded_numels),
                layer_numel=numel)


def main() -> None:
    import faulthandler
    import sys

    faulthandler.dump_traceback_later(float(__import__("os").environ.get("TIDE_HANG_DUMP_S", "1e9")), exit=True,
                                      file=sys.stderr)
    ap = argparse.ArgumentParser()
    ap.add_argument("--world-sizes", nargs="+", type=int, default=[2, 4])
    ap.add_argument("--models", nargs="+", default=["llama-3.1-70b", "qwen3-30b-a3b"])
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--ring-bytes", type=int, default=64 << 20)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    info = env_info(torch.device("cuda"))
    print(f"{info['gpu']} | torch {info['torch']} | triton {info['triton']} | git {info['git_sha']} | {info['date']}")
    print("| model | W | reduce_scatter bf16->fp32 (ms) | all_gather bf16 (ms) | RS staging / rank | FSDP2 fp32 RS input / rank |")
    print("|---|---|---|---|---|---|")
    for model in args.models:
        for W in args.world_sizes:
            row = run(model, W, args.iters, args.ring_bytes)
            print(f"| {model} | {W} | {row['rs_ms']:.2f} | {row['ag_ms']:.2f} | "
                  f"{row['staging_bytes'] / 2**20:.0f} MiB | {row['fsdp_rs_input_bytes'] / 2**20:.0f} MiB |", flush=True)
            if args.json:
                with open(args.json, "a") as f:
                    f.write(json.dumps({**row, **info}) + "\n")
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
