"""Teardown diagnostics on the GPU: which objects are left in reference cycles after the
collectives ran and the groups closed (the cyclic collector frees those at an arbitrary
point, running C destructors in whatever order it likes), and whether create / run /
close cycles in the single-process mode lose file descriptors or device memory.

    python bench/diag_teardown.py [--cycles 20]
"""
from __future__ import annotations

import argparse
import collections
import gc
import os
import threading

os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "32")
os.environ.setdefault("CUDA_MODULE_LOADING", "EAGER")  # and no lazy kernel load may sync the context

import torch  # noqa: E402

import tide_triton as tt  # noqa: E402


def _one_cycle(W: int, shapes: list[tuple[int, ...]], ops: str = "both") -> None:
    dev = torch.device("cuda", 0)
    layout = tt.ShardLayout(shapes, W)
    groups = tt.local_groups(W, timeout_s=60, ring_bytes=1 << 20, devices=[dev] * W)
    grads = [[torch.ones(s, device=dev, dtype=torch.bfloat16) for s in shapes] for _ in range(W)]
    shards = [[torch.empty(s, device=dev) for s in layout.shard_shapes(r)] for r in range(W)]
    params = [[torch.empty(s, device=dev) for s in shapes] for _ in range(W)]
    errors: list = []

    def body(r: int) -> None:
        try:
            with torch.cuda.stream(torch.cuda.Stream(dev)):
                if ops in ("rs", "both"):
                    tt.reduce_scatter(grads[r], shards[r], group=groups[r], op="sum")
                if ops in ("ag", "both"):
                    tt.all_gather(shards[r], params[r], group=groups[r])
                if ops == "none":  # the transport alone: created (heap, streams), then closed
                    groups[r].transport(dev).ensure_heap(1 << 20)
                tt.synchronize(groups[r], timeout_s=60)
        except BaseException as e:  # noqa: BLE001
            errors.append((r, repr(e)))

    threads = [threading.Thread(target=body, args=(r,)) for r in range(W)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    for g in groups:
        g.close()
    if errors:
        raise RuntimeError(errors)
    if ops != "both":
        return
    for r in range(W):
        for x in params[r]:
            assert bool((x == W).all()), "all_gather of the reduce-scattered sums is wrong"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cycles", type=int, default=20)
    ap.add_argument("--world-size", type=int, default=4)
    ap.add_argument("--ops", choices=["rs", "ag", "both", "none"], default="both")
    ap.add_argument("--no-saveall", action="store_true", help="collect normally (no DEBUG_SAVEALL)")
    ap.add_argument("--find-bad", default=None, help="file: before collecting, log every tracked "
                    "container's type and touch its referents (the last line names the container "
                    "holding a dangling reference, if the scan crashes)")
    args = ap.parse_args()
    shapes = [(1000, 64), (7, 3, 5), (129,), (3,)]
    _one_cycle(args.world_size, shapes)  # warm: kernels compiled, caches filled
    gc.collect()
    torch.cuda.synchronize()
    fds0 = len(os.listdir("/proc/self/fd"))
    free0 = torch.cuda.mem_get_info()[0]
    if not args.no_saveall:
        gc.set_debug(gc.DEBUG_SAVEALL)
    for _ in range(args.cycles):
        _one_cycle(args.world_size, shapes, args.ops)
    if args.find_bad:
        fd = os.open(args.find_bad, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        for o in gc.get_objects():
            os.write(fd, f"{type(o).__module__}.{type(o).__qualname__} {id(o):#x}\n".encode())
            for r in gc.get_referents(o):
                type(r).__name__  # reads the referent's type: a freed one crashes here
        os.write(fd, b"scan done\n")
        os.close(fd)
    n = gc.collect()
    kinds = collections.Counter(f"{type(o).__module__}.{type(o).__qualname__}" for o in gc.garbage)
    print(f"cyclic garbage after {args.cycles} cycles: {n} objects")
    for k, c in kinds.most_common(25):
        print(f"  {c:6d} {k}")
    gc.set_debug(0)
    gc.garbage.clear()
    gc.collect()
    torch.cuda.synchronize()
    fds1 = len(os.listdir("/proc/self/fd"))
    free1 = torch.cuda.mem_get_info()[0]
    print(f"file descriptors: {fds0} -> {fds1}; device memory free: {(free1 - free0) / 2**20:+.1f} MiB "
          f"over {args.cycles} create/run/close cycles of {args.world_size} ranks")


if __name__ == "__main__":
    main()
