"""reduce_scatter / all_gather inside a CUDA graph capture: a clear error at once, never a
recorded graph that hangs or reads early on replay; the refusal takes the call's number and is
published like an argument error (peers in the same call raise PeerArgumentError), and the group
stays usable.

Why they refuse (see ``collectives._refuse_capture``): the flags carry per-call values
(call identity, chunk sequence, all-gather epoch) that a graph would bake in, the pacing
waits on events from the host, and a first call exchanges with the peers on the host.  The
CPU test mocks the capturing state; the GPU test captures for real on one GPU with the
single-process mode (2 ranks)."""
from __future__ import annotations

import re

import pytest
import torch

try:
    from _dist import run_threads
except ImportError:  # pragma: no cover
    from tests._dist import run_threads

import tide_triton as tt
import tide_triton.collectives as coll
from tide_triton.plan.layout import ShardLayout

SHAPES = [(7, 5), (3,), (13, 2)]
W = 2


def _data(device: torch.device):
    gen = torch.Generator().manual_seed(5)
    grads = [[torch.randint(-8, 9, s, generator=gen).to(torch.bfloat16).to(device) for s in SHAPES]
             for _ in range(W)]
    return grads, ShardLayout(SHAPES, W)


def _eager(groups, grads, layout, device):
    """One eager reduce-scatter and all-gather per rank (threads); the shards and params."""
    def body(r: int):
        def run():
            shards = [torch.full(s, -1.0, device=device) for s in layout.shard_shapes(r, padded=True)]
            tt.reduce_scatter(grads[r], shards, group=groups[r], op="sum")
            params = [torch.empty(s, dtype=torch.bfloat16, device=device) for s in SHAPES]
            tt.all_gather([x[:n] for x, n in zip(shards, layout.shard_rows(r))], params, group=groups[r])
            if device.type == "cuda":
                tt.synchronize(groups[r], timeout_s=60)
            return [x.cpu() for x in shards], [x.cpu() for x in params]
        if device.type == "cuda":
            with torch.cuda.stream(torch.cuda.Stream(device)):
                return run()
        return run()
    return run_threads(body, W, timeout=120)


def _check(out, grads, layout):
    for r in range(W):
        shards, params = out[r]
        for p in range(len(SHAPES)):
            want = sum(grads[q][p].float().cpu() for q in range(W))
            c, rows = layout.rows_per_rank[p], layout.shard_rows(r)[p]
            assert torch.equal(shards[p][:rows], want[r * c: r * c + rows])
            assert torch.equal(params[p], want.to(torch.bfloat16))


_MATCH = r"cannot be captured in a CUDA graph.*per-call values.*host \(group\.parts\.Pacer\)"


def _refused_calls(groups, grads, layout, device, capturing_ranks, capture) -> list:
    """Every rank makes a reduce-scatter and an all-gather, the ranks in ``capturing_ranks``
    inside ``capture(r)`` (a context: a capture, real or mocked); what each call raised."""
    def body(r: int):
        got = []
        shards = [torch.empty(s, device=device) for s in layout.shard_shapes(r, padded=True)]
        params = [torch.empty(s, dtype=torch.bfloat16, device=device) for s in SHAPES]
        for fn in (lambda: tt.reduce_scatter(grads[r], shards, group=groups[r]),
                   lambda: tt.all_gather([x.to(torch.bfloat16) for x in shards], params, group=groups[r])):
            try:
                if r in capturing_ranks:
                    with capture(r):
                        fn()
                else:
                    fn()
                    if device.type == "cuda":
                        tt.synchronize(groups[r], timeout_s=60)
                got.append(("ok", ""))
            except Exception as e:  # noqa: BLE001 - the outcome is the test's subject
                got.append((type(e).__name__, str(e)))
        return got
    return run_threads(body, W, timeout=120)


def _assert_refused(out, capturing_ranks) -> None:
    """A capturing rank: RuntimeError naming the collective and why; every other rank:
    PeerArgumentError naming a capturing rank -- in the same call, never the next."""
    for r, got in enumerate(out):
        for name, (kind, msg) in zip(("reduce_scatter", "all_gather"), got):
            if r in capturing_ranks:
                assert kind == "RuntimeError" and re.search(f"tide_triton.{name} " + _MATCH, msg), (r, kind, msg)
            else:
                assert kind == "PeerArgumentError", (r, kind, msg)
                assert f"rank {min(capturing_ranks)} rejected" in msg and "cannot be captured" in msg, (r, msg)


class _MockCapture:
    """``collectives._capturing`` answers True on the threads inside ``with mock(r):``."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        import threading
        from contextlib import contextmanager

        self.tls = threading.local()
        monkeypatch.setattr(coll, "_capturing", lambda stream: getattr(self.tls, "on", False))

        @contextmanager
        def on(r: int):
            self.tls.on = True
            try:
                yield
            finally:
                self.tls.on = False
        self.on = on


@pytest.mark.multiproc
@pytest.mark.parametrize("capturing", [(0, 1), (0,)], ids=["every-rank", "one-rank"])
def test_capture_refused_clearly_and_group_stays_usable(monkeypatch: pytest.MonkeyPatch, capturing) -> None:
    """Every rank inside a capture: each refuses at once.  One rank inside a capture while the
    others make the call for real: a refusal before the call took its number would pair
    that rank's *next* call with the peers' call -- wrong sums, no error; so it takes the
    number and is published like an argument error (the peers raise ``PeerArgumentError``
    naming it in the same call).  Either way the group stays usable and the next calls are
    exact."""
    dev = torch.device("cpu")
    grads, layout = _data(dev)
    groups = tt.local_groups(W, timeout_s=30, ring_bytes=512 * W)
    try:
        _check(_eager(groups, grads, layout, dev), grads, layout)  # agreed and prepared first
        mock = _MockCapture(monkeypatch)
        _assert_refused(_refused_calls(groups, grads, layout, dev, capturing, mock.on), capturing)
        assert all(g.broken is None for g in groups)
        _check(_eager(groups, grads, layout, dev), grads, layout)  # the calls stay paired
    finally:
        for g in groups:
            g.close()


def test_capturing_is_false_without_cuda() -> None:
    if torch.cuda.is_available():
        pytest.skip("checks the CPU-only answer")
    assert coll._capturing(None) is False


@pytest.mark.gpu
@pytest.mark.multiproc
def test_capture_on_gpu_raises_without_hang() -> None:
    """Every rank's thread captures on its own stream (thread-local capture mode, as the
    library's own recordings do): each call refuses at once, the captures end empty, and the
    next eager calls are exact."""
    from contextlib import contextmanager

    dev = torch.device("cuda", 0)
    grads, layout = _data(dev)
    groups = tt.local_groups(W, timeout_s=60, ring_bytes=512 * W, devices=[dev] * W)

    @contextmanager
    def capture(r: int):
        graph, side = torch.cuda.CUDAGraph(), torch.cuda.Stream(dev)
        with torch.cuda.stream(side):
            graph.capture_begin(capture_error_mode="thread_local")
            try:
                yield
            finally:
                graph.capture_end()

    try:
        _check(_eager(groups, grads, layout, dev), grads, layout)
        _assert_refused(_refused_calls(groups, grads, layout, dev, (0, 1), capture), (0, 1))
        assert all(g.broken is None for g in groups)
        _check(_eager(groups, grads, layout, dev), grads, layout)
    finally:
        for g in groups:
            g.close()


@pytest.mark.gpu
@pytest.mark.multiproc
def test_vacate_under_capture_is_refused_before_it_signals() -> None:
    """``HeapRegion.vacate()`` inside a CUDA graph capture raises at once, naming the region:
    its signal carries the hand-over's epoch, which a graph would bake in (every replay would
    signal the same one, and the peers' waits for later hand-overs would never be met).  No
    epoch is used up: the next vacate outside the capture is the first hand-over."""
    dev = torch.device("cuda", 0)
    groups = tt.local_groups(W, timeout_s=60, ring_bytes=512 * W, devices=[dev] * W)

    def body(r: int):
        g = groups[r]
        region = g.heap_region("vacate-capture", 256, dev)
        side = torch.cuda.Stream(dev)
        err = None
        if r == 0:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.stream(side):
                graph.capture_begin(capture_error_mode="thread_local")
                try:
                    region.vacate()
                except RuntimeError as e:
                    err = str(e)
                finally:
                    graph.capture_end()
        with torch.cuda.stream(side):
            epoch = region.vacate()
        tt.synchronize(g, timeout_s=60)
        return err, epoch

    try:
        out = run_threads(body, W, timeout=120)
    finally:
        for g in groups:
            g.close()
    err, epoch = out[0]
    assert err is not None and "'vacate-capture'" in err and "cannot be captured" in err, err
    assert epoch == 1 and out[1][1] == 1, out
