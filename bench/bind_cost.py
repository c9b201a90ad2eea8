"""Python per call on tensors at new addresses (CPU): the eager call's cache miss against a
prepared collective's run on new tensors (``_run_on``: a full check and a bind, what the FSDP2
drop-in's prepared mode pays whenever FSDP2 hands it new addresses), and both again once the
addresses are known.

Two ranks as threads on the host transport, copies and kernel launches replaced by no-ops
(like ``bench/host_path.py --no-kernels``), the layer's shapes divided by ``--scale``.  Each
rank makes ``--sets`` sets of tensors; the calls on the sets the first time are the misses,
the calls on the same sets again the hits (``time.thread_time`` per call, rank 0).

    TRITON_INTERPRET=1 python bench/bind_cost.py [--models qwen3-30b-a3b] [--sets 20] [--scale 64]
"""
from __future__ import annotations

import argparse
import os
import threading
import time

os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

import tide_triton as tt  # noqa: E402
from tide_triton.collectives import prepared_all_gather_call, prepared_reduce_scatter_call  # noqa: E402
from tide_triton.kernels.segments import Binding  # noqa: E402
from tide_triton.bench.measure import env_info  # noqa: E402
from tide_triton.transport import host  # noqa: E402
from tide_triton.plan.workloads import layer_shapes  # noqa: E402

W = 2


def measure(model: str, sets: int, scale: int) -> dict[str, tuple[float, float]]:
    shapes = [tuple(max(1, d // scale) for d in s) for s in layer_shapes(model)]
    layout = tt.ShardLayout(shapes, W)
    groups = tt.local_groups(W, timeout_s=120, agree="first")

    def fresh(r: int) -> tuple:
        return ([torch.ones(s, dtype=torch.bfloat16) for s in shapes],
                [torch.zeros(s) for s in layout.shard_shapes(r, padded=True)],
                [torch.zeros(s, dtype=torch.bfloat16) for s in shapes],
                [torch.zeros(s, dtype=torch.bfloat16) for s in layout.shard_shapes(r, padded=True)])

    def body(r: int) -> dict:
        g = groups[r]
        grads, shards, params, ag_shards = fresh(r)
        prs = prepared_reduce_scatter_call(g, grads, shards, "sum", False, hold=False)
        pag = prepared_all_gather_call(g, ag_shards, params, hold=False)
        tt.reduce_scatter(grads, shards, group=g, op="sum")  # the eager signatures agreed once
        tt.all_gather(ag_shards, params, group=g)
        calls = {"reduce_scatter eager": lambda s: tt.reduce_scatter(s[0], s[1], group=g, op="sum"),
                 "reduce_scatter prepared": lambda s: prs._run_on(s[0], s[1]),
                 "all_gather eager": lambda s: tt.all_gather(s[3], s[2], group=g),
                 "all_gather prepared": lambda s: pag._run_on(s[3], s[2])}
        out = {}
        for name, call in calls.items():
            new = [fresh(r) for _ in range(sets)]
            t0 = time.thread_time()
            for s in new:
                call(s)
            t1 = time.thread_time()
            for s in new:
                call(s)
            t2 = time.thread_time()
            out[name] = ((t1 - t0) / sets * 1e3, (t2 - t1) / sets * 1e3)
        return out

    results: dict[int, dict] = {}
    errors: list[BaseException] = []

    def run(r: int) -> None:
        try:
            results[r] = body(r)
        except BaseException as e:  # noqa: BLE001 -- re-raised below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(W)]
    try:
        for th in threads:
            th.start()
        for th in threads:
            th.join(600)
        if errors:
            raise errors[0]
        return results[0]
    finally:
        for g in groups:
            g.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["qwen3-30b-a3b"])
    ap.add_argument("--sets", type=int, default=20)
    ap.add_argument("--scale", type=int, default=64)
    a = ap.parse_args()
    # the transport's data movement and the kernels out, for this measurement only (restored:
    # the tests run main() in their own process)
    copy, launch = host.HostTransport.copy, Binding.launch
    host.HostTransport.copy = lambda self, *args, **kw: None
    Binding.launch = lambda self, **kw: None
    try:
        info = env_info(torch.device("cpu"))
        print(f"{info['gpu']}, {os.cpu_count()} cores | torch {info['torch']} | triton {info['triton']} | "
              f"git {info['git_sha']} | {info['date']} | {a.sets} sets of new tensors per call kind, rank 0")
        print("| layer | parameters | call | new addresses (ms) | known addresses (ms) |")
        print("|---|---|---|---|---|")
        for model in a.models:
            n = len(layer_shapes(model))
            for name, (miss, hit) in measure(model, a.sets, a.scale).items():
                print(f"| {model} | {n} | {name} | {miss:.2f} | {hit:.2f} |", flush=True)
    finally:
        host.HostTransport.copy, Binding.launch = copy, launch


if __name__ == "__main__":
    main()
