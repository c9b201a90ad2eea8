"""Python per call of a prepared collective, without the transport's work (CPU).

Two ranks as threads of one process on the host transport, whose copies are replaced by
no-ops, ``agree="first"`` (``--agree always``: tt.init's default, one exchange per call);
the layer's shapes with every dimension divided by ``--scale``
(the parameter count is what matters).  After ``--warmup`` calls (the first prepares), the
calling thread's CPU time (``time.thread_time``) per call over ``--calls`` calls, per rank.
What remains is the per-call Python of the API: argument checks, addresses, cache keys,
flags -- the floor an eager call cannot go below (docs/benchmarks.md, "Python per call on
the CPU").

    TRITON_INTERPRET=1 python bench/host_path.py [--models llama-3.1-70b qwen3-30b-a3b synthetic-moe-256e]
        [--ops all_gather reduce_scatter] [--agree first|always] [--prepared [unchecked]] [--no-kernels]
        [--profile]
"""
from __future__ import annotations

import argparse
import cProfile
import functools
import os
import pstats
import threading
import time

os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

import tide_triton as tt  # noqa: E402
from tide_triton.bench.measure import GcPasses  # noqa: E402
from tide_triton.transport import host  # noqa: E402
from tide_triton.plan.workloads import layer_shapes  # noqa: E402


def measure(model: str, op: str, world: int, scale: int, warmup: int, calls: int, profile: bool,
            agree: str = "first", prepared: str | None = None) -> dict:
    shapes = [tuple(max(1, d // scale) for d in s) for s in layer_shapes(model)]
    layout = tt.ShardLayout(shapes, world)
    groups = tt.local_groups(world, timeout_s=120, agree=agree)
    per_rank: dict[int, float] = {}
    prof: dict[str, cProfile.Profile] = {}
    clock = GcPasses()
    ready = threading.Barrier(world)

    def body(r: int) -> None:
        g = groups[r]
        if op == "all_gather":
            shards = [torch.zeros(s, dtype=torch.bfloat16) for s in layout.shard_shapes(r, padded=True)]
            params = [torch.zeros(s, dtype=torch.bfloat16) for s in layout.padded_shapes]

            if prepared:
                call = functools.partial(tt.prepare_all_gather(shards, params, group=g).run,
                                         check_addresses=prepared != "unchecked")
            else:
                def call() -> None:
                    tt.all_gather(shards, params, group=g)
        else:
            grads = [torch.zeros(s, dtype=torch.bfloat16) for s in shapes]
            out = [torch.zeros(s) for s in layout.shard_shapes(r, padded=True)]

            if prepared:
                call = functools.partial(tt.prepare_reduce_scatter(grads, out, group=g, op="sum").run,
                                         check_addresses=prepared != "unchecked")
            else:
                def call() -> None:
                    tt.reduce_scatter(grads, out, group=g, op="sum")
        for _ in range(warmup):
            call()
        if ready.wait() == 0:  # one rank starts counting the process's collector passes
            clock.start()
        pr = cProfile.Profile() if profile and r == 0 else None
        t0 = time.thread_time()
        if pr:
            pr.enable()
        for _ in range(calls):
            call()
        if pr:
            pr.disable()
            prof["rank0"] = pr
        per_rank[r] = (time.thread_time() - t0) / calls * 1e6

    threads = [threading.Thread(target=body, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    clock.stop()
    for g in groups:
        g.close()
    if profile and "rank0" in prof:
        pstats.Stats(prof["rank0"]).sort_stats("tottime").print_stats(15)
    label = op
    if prepared:
        label += f" (prepared: run, addresses {'not ' if prepared == 'unchecked' else ''}checked)"
    return {"model": model, "op": label, "params": len(shapes),
            "us_per_call": [round(per_rank[r]) for r in range(world)],
            "gc_passes_per_call": clock.count / calls, "gc_full_passes": clock.full, "gc_ms": clock.seconds * 1e3}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", nargs="+", default=["llama-3.1-70b", "qwen3-30b-a3b", "synthetic-moe-256e"])
    ap.add_argument("--ops", nargs="+", default=["all_gather"], choices=["all_gather", "reduce_scatter"],
                    help="reduce_scatter also runs its reduction kernel (through the interpreter on the CPU)")
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--scale", type=int, default=64)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--profile", action="store_true", help="cProfile rank 0's timed calls")
    ap.add_argument("--agree", choices=["first", "always"], default="first",
                    help="the groups' agree option (always: one bootstrap exchange per call, the default of tt.init)")
    ap.add_argument("--prepared", nargs="?", const="checked", choices=["checked", "unchecked"], default=None,
                    help="time run() of tt.prepare_reduce_scatter / tt.prepare_all_gather instead of the eager call "
                         "(unchecked: run(check_addresses=False))")
    ap.add_argument("--no-kernels", action="store_true",
                    help="launch no reduction/cast kernel either (their Python on the CPU is Triton's interpreter)")
    a = ap.parse_args()
    host.HostTransport.copy = lambda self, *args, **kw: None  # the transport's data movement out
    if a.no_kernels:
        from tide_triton.kernels.segments import Binding

        Binding.launch = lambda self, **kw: None
    print("| layer | op | parameters | Python per call, per rank (us) | GC passes per call | full GC passes (ms) |")
    print("|---|---|---|---|---|---|")
    for model in a.models:
        for op in a.ops:
            row = measure(model, op, a.world_size, a.scale, a.warmup, a.calls, a.profile, a.agree, a.prepared)
            gc_cells = (f"{row['gc_passes_per_call']:.2f} | {row['gc_full_passes']} "
                        f"({row['gc_ms']:.1f} ms in all passes)")
            print(f"| {row['model']} | {row['op']} | {row['params']} | {' / '.join(map(str, row['us_per_call']))} "
                  f"| {gc_cells} |", flush=True)


if __name__ == "__main__":
    main()
