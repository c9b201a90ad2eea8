"""How much work one stream takes while it waits on a flag, before the enqueuing call blocks
inside the driver: the limit behind the pacer's operation budget (``group._QUEUED_OPS``).

A thread that blocks inside the driver has no deadline (a dead peer would hang it with no
error), so the library paces its enqueue (``group._Pacer``: the host waits, with the group's
deadline, for an event of an earlier chunk) and keeps at most ``_QUEUED_OPS`` operations
queued per collective.  A round of a MoE reduce-scatter on new gradient addresses holds
hundreds of copy descriptors, and the pacer then lets the host only one round ahead.  This
probe measures the limit instead of guessing it: a stream waits on a word of pinned host
memory; another thread enqueues, on that stream, copies (one ``cuMemcpyBatchAsync`` of
``--batch`` descriptors at a time, or ``cuMemcpyAsync`` one by one) or flag writes
(``cuStreamBatchMemOp``), counting; when the count stops for ``--stall-s`` the call is
blocked: that count is the limit.  A CPU store then releases the stream, and the copies are
checked.

    python bench/queue_depth_probe.py [--max-ops 200000] [--stall-s 1.0]
"""
from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from typing import Callable

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from blocking_probe import Probe  # noqa: E402
from cuda.bindings import driver as cu  # noqa: E402

from tide_triton.measure import env_info  # noqa: E402
from tide_triton.transport.driver import check  # noqa: E402

PIECE = 4096
"""Bytes per copy descriptor (small: the probe measures the queue, not the copies)."""


def queue_limit(p: Probe, enqueue: Callable[[int], int], max_ops: int, stall_s: float) -> tuple[int, bool, float]:
    """``enqueue(i)`` (returns the operations it queued) called on another thread until
    ``max_ops`` while the stream waits: (operations queued when the thread stopped advancing,
    whether it was blocked, seconds the enqueue took)."""
    p.value += 1
    check(cu.cuStreamWaitValue64(p.work, p.dev_word, p.value,
                                 int(cu.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_GEQ)), "cuStreamWaitValue64")
    done = {"ops": 0, "end": False}

    def run() -> None:
        check(cu.cuCtxSetCurrent(p.ctx), "cuCtxSetCurrent")
        i = 0
        while done["ops"] < max_ops:
            done["ops"] += enqueue(i)
            i += 1
        done["end"] = True

    th = threading.Thread(target=run, daemon=True)
    t0 = time.perf_counter()
    th.start()
    last, since = -1, time.perf_counter()
    blocked = False
    while th.is_alive():
        th.join(0.05)
        if done["ops"] != last:
            last, since = done["ops"], time.perf_counter()
        elif time.perf_counter() - since > stall_s:
            blocked = True
            break
    took = time.perf_counter() - t0
    at = done["ops"]
    p.word.value = p.value  # release: a CPU store, no driver call
    th.join(120)
    check(cu.cuStreamSynchronize(p.work), "cuStreamSynchronize")
    return at, blocked, took


def main() -> None:
    ap = argparse.ArgumentParser(prog="python bench/queue_depth_probe.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--max-ops", type=int, default=200_000)
    ap.add_argument("--stall-s", type=float, default=1.0)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        ap.error("needs a CUDA device")
    info = env_info(torch.device("cuda", 0))
    print(f"{info['gpu']} | torch {info['torch']} | CUDA driver API {check(cu.cuDriverGetVersion(), 'v')} | "
          f"git {info['git_sha']} | {info['date']} | one stream waits on a pinned word; up to {a.max_ops} "
          f"operations enqueued behind it; blocked = no progress for {a.stall_s} s")
    p = Probe(60.0)
    n = p.src.nbytes // PIECE
    src, dst = p.src.data_ptr(), p.dst.data_ptr()
    attrs = cu.CUmemcpyAttributes()
    attrs.srcAccessOrder = cu.CUmemcpySrcAccessOrder.CU_MEMCPY_SRC_ACCESS_ORDER_STREAM
    attrs.flags = cu.CUmemcpyFlags.CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE  # as the library's

    def batch_of(k: int) -> Callable[[int], int]:
        def enqueue(i: int) -> int:
            offs = [((i * k + j) % n) * PIECE for j in range(k)]
            check(cu.cuMemcpyBatchAsync([cu.CUdeviceptr(dst + o) for o in offs],
                                        [cu.CUdeviceptr(src + o) for o in offs], [PIECE] * k, k,
                                        [attrs], [0], 1, p.work), "cuMemcpyBatchAsync")
            return k
        return enqueue

    def one_by_one(i: int) -> int:
        o = (i % n) * PIECE
        check(cu.cuMemcpyAsync(dst + o, src + o, PIECE, p.work), "cuMemcpyAsync")
        return 1

    write = cu.CUstreamBatchMemOpType.CU_STREAM_MEM_OP_WRITE_VALUE_64
    scratch = int(p.dev_word) + 96  # a word of the pinned page nobody reads

    def memops(k: int) -> Callable[[int], int]:
        def enqueue(i: int) -> int:
            ops = []
            for j in range(k):
                op = cu.CUstreamBatchMemOpParams()
                op.operation = write
                op.writeValue.operation = write
                op.writeValue.address = scratch
                op.writeValue.value64 = i * k + j
                op.writeValue.flags = 0
                ops.append(op)
            check(cu.cuStreamBatchMemOp(p.work, k, ops, 0), "cuStreamBatchMemOp")
            return k
        return enqueue

    print("| operations (enqueued on the waiting stream) | queued when the call blocked | blocked | s |")
    print("|---|---|---|---|")
    for name, fn in (("cuMemcpyAsync, one descriptor per call", one_by_one),
                     ("cuMemcpyBatchAsync, 16 descriptors per call", batch_of(16)),
                     ("cuMemcpyBatchAsync, 256 descriptors per call", batch_of(256)),
                     ("cuStreamBatchMemOp, 4 writes per call", memops(4))):
        at, blocked, took = queue_limit(p, fn, a.max_ops, a.stall_s)
        print(f"| {name} | {at if blocked else f'>= {at} (never blocked)'} | {'yes' if blocked else 'no'} | "
              f"{took:.1f} |", flush=True)
    torch.cuda.synchronize()
    print(f"copies checked: {'exact' if torch.equal(p.dst, p.src) else 'WRONG'}")


if __name__ == "__main__":
    main()
