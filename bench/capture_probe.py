"""What of tide_triton's transport a CUDA graph can capture, and what a replay costs (one GPU).

Answers the questions docs/design.md ("CUDA graph capture") lists before the capture
protocol is built, with the same driver calls the transport makes (cuda-python):

1. ``cuStreamWaitValue64`` (EQ) / ``cuStreamWriteValue64`` captured: does a replay wait for a
   token written outside the graph, and can the reader reset its own word (the 0 / T handshake)?
2. ``cuStreamBatchMemOp`` (a wait and writes in one call) captured.
3. Copies captured: ``cuMemcpyAsync``, ``cuMemcpy2DAsync``, ``cuMemcpyBatchAsync``.
4. A driver stream of the transport's own (non-blocking) joining the capture by event fork/join.
5. Cost: N per-parameter copies (Qwen3-30B-A3B's 393 shards at W=2, and the 256-expert layer's
   771) enqueued eagerly (loop, batch) against one graph launch: host time and device time.

    python bench/capture_probe.py [--json FILE]

Prints one line per question (``ok`` / ``FAILED: why``) and a table for 5.
"""
from __future__ import annotations

import argparse
import functools
import json
import statistics
import time

import torch

from tide_triton.measure import copy_ceiling, env_info
from tide_triton.transport.driver import check, cu


def _stream(s: torch.cuda.Stream) -> int:
    return int(s.cuda_stream)


def _words(n: int) -> torch.Tensor:
    return torch.zeros(n, dtype=torch.int64, device="cuda")


def _wait(s: int, addr: int, value: int) -> None:
    check(cu.cuStreamWaitValue64(s, addr, value, int(cu.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_EQ)),
          "cuStreamWaitValue64")


def _write(s: int, addr: int, value: int) -> None:
    check(cu.cuStreamWriteValue64(s, addr, value, int(cu.CUstreamWriteValue_flags.CU_STREAM_WRITE_VALUE_DEFAULT)),
          "cuStreamWriteValue64")


def q1_token_handshake() -> str:
    """Graph: wait(A == T); A = 0 (the reader resets its word); B = T.  Replayed 3 times; the
    second replay is launched before A is set and must not finish until it is."""
    w = _words(2)
    a, b = w.data_ptr(), w.data_ptr() + 8
    T = 12345
    g = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    with torch.cuda.graph(g, stream=side):
        s = _stream(torch.cuda.current_stream())
        _wait(s, a, T)
        _write(s, a, 0)
        _write(s, b, T)
    for i in range(3):
        w.zero_()
        torch.cuda.synchronize()
        late = i == 1
        if not late:
            w[0] = T
            torch.cuda.synchronize()
        g.replay()
        if late:
            time.sleep(0.2)
            done = torch.cuda.current_stream().query()
            if done:
                return "FAILED: a replay did not wait for its token"
            other = torch.cuda.Stream()
            with torch.cuda.stream(other):
                w[0:1].fill_(T)
        torch.cuda.synchronize()
        got = w.tolist()
        if got != [0, T]:
            return f"FAILED: replay {i} left words {got}, expected [0, {T}]"
    return "ok (3 replays; one launched before its token waited for it)"


def q2_batch_memop() -> str:
    w = _words(3)
    a = w.data_ptr()
    T = 777
    ops = [(cu.CUstreamBatchMemOpType.CU_STREAM_MEM_OP_WAIT_VALUE_64, a, T,
            int(cu.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_EQ)),
           (cu.CUstreamBatchMemOpType.CU_STREAM_MEM_OP_WRITE_VALUE_64, a, 0, 0),
           (cu.CUstreamBatchMemOpType.CU_STREAM_MEM_OP_WRITE_VALUE_64, a + 8, T, 0),
           (cu.CUstreamBatchMemOpType.CU_STREAM_MEM_OP_WRITE_VALUE_64, a + 16, T + 1, 0)]
    params = []
    for op, addr, value, flags in ops:
        p = cu.CUstreamBatchMemOpParams()
        p.operation = op
        u = p.waitValue if op == cu.CUstreamBatchMemOpType.CU_STREAM_MEM_OP_WAIT_VALUE_64 else p.writeValue
        u.operation, u.address, u.value64, u.flags = op, addr, value, flags
        params.append(p)
    g = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(g, stream=torch.cuda.Stream()):
            check(cu.cuStreamBatchMemOp(_stream(torch.cuda.current_stream()), len(params), params, 0),
                  "cuStreamBatchMemOp")
    except Exception as exc:  # noqa: BLE001 - the answer is the exception
        return f"FAILED: {type(exc).__name__}: {exc}"
    for _ in range(2):
        w.zero_()
        w[0] = T
        torch.cuda.synchronize()
        g.replay()
        torch.cuda.synchronize()
        if w.tolist() != [0, T, T + 1]:
            return f"FAILED: words {w.tolist()}"
    return "ok (wait + 3 writes in one node, 2 replays)"


def _pieces(n: int, nbytes: int) -> tuple[torch.Tensor, torch.Tensor, list[int], list[int]]:
    src = torch.arange(n * nbytes // 2, device="cuda", dtype=torch.int16).view(torch.uint8)
    dst = torch.zeros_like(src)
    srcs = [src.data_ptr() + i * nbytes for i in range(n)]
    dsts = [dst.data_ptr() + i * nbytes for i in range(n)]
    return src, dst, srcs, dsts


def _copy_loop(s: int, dsts: list[int], srcs: list[int], nbytes: int) -> None:
    for d, x in zip(dsts, srcs):
        check(cu.cuMemcpyAsync(d, x, nbytes, s), "cuMemcpyAsync")


_ATTRS: list = []


def _copy_batch(s: int, dsts: list[int], srcs: list[int], nbytes: int) -> None:
    if not _ATTRS:
        attr = cu.CUmemcpyAttributes()
        attr.srcAccessOrder = cu.CUmemcpySrcAccessOrder.CU_MEMCPY_SRC_ACCESS_ORDER_STREAM
        attr.flags = cu.CUmemcpyFlags.CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE  # as the transport
        _ATTRS.append(attr)
    dp = cu.CUdeviceptr
    n = len(dsts)
    check(cu.cuMemcpyBatchAsync([dp(d) for d in dsts], [dp(x) for x in srcs], [nbytes] * n, n,
                                _ATTRS, [0], 1, s), "cuMemcpyBatchAsync")


def q3_copies() -> list[str]:
    out = []
    src, dst, srcs, dsts = _pieces(8, 1 << 16)
    for name, fn in (("cuMemcpyAsync loop", _copy_loop), ("cuMemcpyBatchAsync", _copy_batch)):
        dst.zero_()
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(g, stream=torch.cuda.Stream()):
                fn(_stream(torch.cuda.current_stream()), dsts, srcs, 1 << 16)
            g.replay()
            torch.cuda.synchronize()
            out.append(f"{name}: " + ("ok" if torch.equal(src, dst) else "FAILED: wrong bytes after replay"))
        except Exception as exc:  # noqa: BLE001
            out.append(f"{name}: FAILED: {type(exc).__name__}: {exc}")
            torch.cuda.synchronize()
    # 2-D: 8 rows of 4 KiB out of a 64 KiB pitch into a dense 4 KiB pitch.
    dst.zero_()
    m = cu.CUDA_MEMCPY2D()
    dev = cu.CUmemorytype.CU_MEMORYTYPE_DEVICE
    m.srcMemoryType, m.srcDevice, m.srcPitch = dev, cu.CUdeviceptr(srcs[0]), 1 << 16
    m.dstMemoryType, m.dstDevice, m.dstPitch = dev, cu.CUdeviceptr(dsts[0]), 4096
    m.srcXInBytes = m.srcY = m.dstXInBytes = m.dstY = 0
    m.WidthInBytes, m.Height = 4096, 8
    g = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(g, stream=torch.cuda.Stream()):
            check(cu.cuMemcpy2DAsync(m, _stream(torch.cuda.current_stream())), "cuMemcpy2DAsync")
        g.replay()
        torch.cuda.synchronize()
        want = src.view(8, 1 << 16)[:, :4096].reshape(-1)
        ok = torch.equal(dst[: 8 * 4096], want)
        out.append("cuMemcpy2DAsync: " + ("ok" if ok else "FAILED: wrong bytes after replay"))
    except Exception as exc:  # noqa: BLE001
        out.append(f"cuMemcpy2DAsync: FAILED: {type(exc).__name__}: {exc}")
    return out


def q4_fork_join() -> str:
    """The transport's copy stream is a driver stream (non-blocking); it joins the capture
    through an event recorded on the capturing stream and joins back the same way."""
    nb = int(cu.CUstream_flags.CU_STREAM_NON_BLOCKING)
    own = check(cu.cuStreamCreate(nb), "cuStreamCreate")
    ev1 = check(cu.cuEventCreate(int(cu.CUevent_flags.CU_EVENT_DISABLE_TIMING)), "cuEventCreate")
    ev2 = check(cu.cuEventCreate(int(cu.CUevent_flags.CU_EVENT_DISABLE_TIMING)), "cuEventCreate")
    src, dst, srcs, dsts = _pieces(4, 1 << 20)
    try:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=torch.cuda.Stream()):
            s = _stream(torch.cuda.current_stream())
            src.add_(1)  # a kernel before the fork
            check(cu.cuEventRecord(ev1, s), "cuEventRecord(fork)")
            check(cu.cuStreamWaitEvent(own, ev1, 0), "cuStreamWaitEvent(fork)")
            _copy_loop(int(own), dsts, srcs, 1 << 20)
            check(cu.cuEventRecord(ev2, own), "cuEventRecord(join)")
            check(cu.cuStreamWaitEvent(s, ev2, 0), "cuStreamWaitEvent(join)")
            dst.mul_(1)  # a kernel after the join
        src.zero_()
        torch.cuda.synchronize()
        g.replay()
        torch.cuda.synchronize()
        ok = torch.equal(src, dst) and int(src.view(torch.int16)[0]) != 0
        return "ok (kernel -> copies on a driver stream -> kernel)" if ok else "FAILED: wrong bytes"
    except Exception as exc:  # noqa: BLE001
        return f"FAILED: {type(exc).__name__}: {exc}"
    finally:
        torch.cuda.synchronize()
        cu.cuEventDestroy(ev1)
        cu.cuEventDestroy(ev2)
        cu.cuStreamDestroy(own)


def _time(fn, reps: int) -> tuple[float, float, float]:
    """(host ms median, device ms median, device ms mean) of ``fn`` on the current stream."""
    host, dev = [], []
    for _ in range(reps):
        torch.cuda.synchronize()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(2_000_000)  # keep the device busy so the host time is enqueue only
        e0.record()
        t0 = time.perf_counter()
        fn()
        t1 = time.perf_counter()
        e1.record()
        torch.cuda.synchronize()
        host.append((t1 - t0) * 1e3)
        dev.append(e0.elapsed_time(e1))
    return statistics.median(host), statistics.median(dev), statistics.fmean(dev)


def q5_cost(rows: list[dict], reps: int) -> None:
    # (layer, copies, bytes each): W=2 shards of Qwen3-30B-A3B (128 experts x 3 [768, 2048] +
    # attention/norms: 393 params, ~1.5 MiB for the expert shards) and a 256-expert layer of
    # [512, 1024] matrices (771 params, 0.5 MiB shards); each copied once per peer (W=2: 1 peer).
    for layer, n, nbytes in (("qwen3-30b-a3b W=2", 393, 768 * 2048), ("synthetic-moe-256e W=2", 771, 512 * 1024),
                             ("llama-3.1-70b W=2", 9, 56 << 20)):
        src, dst, srcs, dsts = _pieces(n, nbytes)
        s = torch.cuda.current_stream()
        si = _stream(s)
        modes = {"eager loop": functools.partial(_copy_loop, si, dsts, srcs, nbytes)}
        try:
            _copy_batch(si, dsts[:1], srcs[:1], nbytes)
            modes["eager batch"] = functools.partial(_copy_batch, si, dsts, srcs, nbytes)
        except Exception:  # noqa: BLE001
            pass
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=torch.cuda.Stream()):
            _copy_loop(_stream(torch.cuda.current_stream()), dsts, srcs, nbytes)
        modes["graph replay"] = g.replay
        for mode, fn in modes.items():
            fn()
            torch.cuda.synchronize()
            h, d, dm = _time(fn, reps)
            # device time includes the 2 ms sleep kernel: subtract its own measured time.
            rows.append(dict(layer=layer, copies=n, bytes=n * nbytes, mode=mode, host_ms=h,
                             device_ms=d, device_ms_mean=dm))
        sleep = _time(lambda: None, reps)[1]
        for r in rows[-len(modes):]:
            r["device_ms"] -= sleep
            r["device_ms_mean"] -= sleep
        del src, dst, g


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", default=None)
    ap.add_argument("--reps", type=int, default=20)
    a = ap.parse_args()
    if cu is None or not torch.cuda.is_available():
        raise SystemExit("capture_probe needs a CUDA GPU and cuda-python")
    torch.cuda.init()
    check(cu.cuInit(0), "cuInit")
    answers = {"1 token handshake (wait EQ, reader reset)": q1_token_handshake(),
               "2 cuStreamBatchMemOp": q2_batch_memop()}
    for line in q3_copies():
        answers["3 " + line.split(":")[0]] = line.split(":", 1)[1].strip()
    answers["4 fork/join a driver stream"] = q4_fork_join()
    for k, v in answers.items():
        print(f"{k}: {v}")
    rows: list[dict] = []
    with torch.cuda.stream(torch.cuda.Stream()):  # cuMemcpyBatchAsync refuses the legacy stream
        q5_cost(rows, a.reps)
    # the device-copy ceiling of this run: bytes read + written by one large copy, per second
    ceiling_gbps = copy_ceiling(torch.device("cuda"), 4 << 30).gbps()
    for r in rows:
        r["of_ceiling"] = 2 * r["bytes"] / (r["device_ms"] * 1e6) / ceiling_gbps
    print(f"device-copy ceiling in this run: {ceiling_gbps:.0f} GB/s (read + write)")
    print("| layer | copies | MiB | mode | host enqueue (ms, median) | device (ms, median) | device (ms, mean) | "
          "of ceiling |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['layer']} | {r['copies']} | {r['bytes'] / 2**20:.0f} | {r['mode']} | {r['host_ms']:.3f} | "
              f"{r['device_ms']:.3f} | {r['device_ms_mean']:.3f} | {r['of_ceiling']:.0%} |")
    if a.json:
        with open(a.json, "a") as f:
            f.write(json.dumps(dict(answers=answers, rows=rows, ceiling_gbps=ceiling_gbps,
                                    **env_info(torch.device("cuda")))) + "\n")


if __name__ == "__main__":
    main()
