"""What each host operation of a prepared run's replay costs, one by one (one GPU, seconds).

A replayed prepared collective spends its host time on a few operations: the check that no
held tensor moved (one ``data_ptr`` per tensor: ~1,540 for the 256-expert all-gather), the
fences between the caller's stream and the copy queue, the mark where the block is free
again, and the graph launch.  Each is timed here both ways, in the same process:

* the address check: ``tuple(map(Tensor.data_ptr, ...))`` compared in Python (what ``run()``
  does), against torch's private C++ loop ``torch._C._tensors_data_ptrs_at_indices_equal``
  (CUDA builds; session 19 measured it 10% faster and kept the Python form);
* a fence: torch's ``Stream.wait_stream`` (a new event each time) against one
  ``cuEventRecord`` + ``cuStreamWaitEvent`` on an event made once
  (``CopyEngine.stream_waits_for``, what the CUDA transport's fences use);
* a mark: ``Stream.record_event()`` (a new event, what ``CudaTransport.mark`` makes) against
  re-recording one event.

    python bench/host_ops_probe.py [--tensors 1540] [--iters 2000]

Prints microseconds per operation (median of 7 batches of ``--iters``).
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from tide_triton.measure import env_info
from tide_triton.transport.driver import check, cu


def _per_op_us(fn, iters: int) -> float:
    fn()
    batches = []
    for _ in range(7):
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        batches.append((time.perf_counter() - t0) / iters * 1e6)
    return statistics.median(batches)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tensors", type=int, default=1540)
    ap.add_argument("--iters", type=int, default=2000)
    args = ap.parse_args()
    dev = torch.device("cuda", torch.cuda.current_device())
    print(env_info(dev))
    ts = [torch.empty(64, device=dev) for _ in range(args.tensors)]
    ptrs = [t.data_ptr() for t in ts]
    ptr_tuple, idx = tuple(ptrs), list(range(len(ts)))
    fast = getattr(torch._C, "_tensors_data_ptrs_at_indices_equal", None)
    rows = [("address check, Python map", _per_op_us(lambda: tuple(map(torch.Tensor.data_ptr, ts)) == ptr_tuple,
                                                       args.iters))]
    if fast is not None:
        rows.append(("address check, torch's C++ loop", _per_op_us(lambda: fast(ts, ptrs, idx), args.iters)))

    a, b = torch.cuda.Stream(dev), torch.cuda.Stream(dev)
    ev = check(cu.cuEventCreate(int(cu.CUevent_flags.CU_EVENT_DISABLE_TIMING)), "cuEventCreate")
    ha, hb = int(a.cuda_stream), int(b.cuda_stream)

    def driver_fence() -> None:
        check(cu.cuEventRecord(ev, ha), "cuEventRecord")
        check(cu.cuStreamWaitEvent(hb, ev, 0), "cuStreamWaitEvent")

    kept = torch.cuda.Event()
    rows += [("fence, torch wait_stream", _per_op_us(lambda: b.wait_stream(a), args.iters)),
             ("fence, driver event made once", _per_op_us(driver_fence, args.iters)),
             ("mark, record_event (new event)", _per_op_us(lambda: a.record_event(), args.iters)),
             ("mark, one event re-recorded", _per_op_us(lambda: kept.record(a), args.iters)),
             ("current_stream", _per_op_us(lambda: torch.cuda.current_stream(dev), args.iters))]
    torch.cuda.synchronize()
    check(cu.cuEventDestroy(ev), "cuEventDestroy")
    print(f"{args.tensors} tensors; us per operation, median of 7 batches of {args.iters}")
    for name, us in rows:
        print(f"  {name:40s} {us:8.2f}")


if __name__ == "__main__":
    main()
