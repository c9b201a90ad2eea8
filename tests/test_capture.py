"""reduce_scatter / all_gather inside a CUDA graph capture: a clear error at once, never a
recorded graph that hangs or reads early on replay, and the group stays usable.

Why they refuse (see ``collectives._refuse_capture``): the flags carry per-call values
(call identity, chunk sequence, all-gather epoch) that a graph would bake in, the pacing
waits on events from the host, and a first call exchanges with the peers on the host.  The
CPU test mocks the capturing state; the GPU test captures for real on one GPU with the
single-process mode (2 ranks)."""
from __future__ import annotations

import pytest
import torch

try:
    from _dist import run_threads
except ImportError:  # pragma: no cover
    from tests._dist import run_threads

import tide_triton as tt
import tide_triton.collectives as coll
from tide_triton.layout import ShardLayout

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


_MATCH = r"cannot be captured in a CUDA graph.*per-call values.*host \(group._Pacer\)"


@pytest.mark.multiproc
def test_capture_refused_clearly_and_group_stays_usable(monkeypatch: pytest.MonkeyPatch) -> None:
    dev = torch.device("cpu")
    grads, layout = _data(dev)
    groups = tt.local_groups(W, timeout_s=30, ring_bytes=512 * W)
    try:
        _check(_eager(groups, grads, layout, dev), grads, layout)  # agreed and prepared first
        monkeypatch.setattr(coll, "_capturing", lambda stream: True)
        shards = [torch.empty(s) for s in layout.shard_shapes(0, padded=True)]
        with pytest.raises(RuntimeError, match="tide_triton.reduce_scatter " + _MATCH):
            tt.reduce_scatter(grads[0], shards, group=groups[0])
        params = [torch.empty(s, dtype=torch.bfloat16) for s in SHAPES]
        with pytest.raises(RuntimeError, match="tide_triton.all_gather " + _MATCH):
            tt.all_gather([x.to(torch.bfloat16) for x in shards], params, group=groups[0])
        monkeypatch.setattr(coll, "_capturing", lambda stream: False)
        assert groups[0].broken is None
        _check(_eager(groups, grads, layout, dev), grads, layout)  # rank 0 took no call number
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
    dev = torch.device("cuda", 0)
    grads, layout = _data(dev)
    groups = tt.local_groups(W, timeout_s=60, ring_bytes=512 * W, devices=[dev] * W)
    try:
        _check(_eager(groups, grads, layout, dev), grads, layout)
        shards = [torch.empty(s, device=dev) for s in layout.shard_shapes(0, padded=True)]
        params = [torch.empty(s, dtype=torch.bfloat16, device=dev) for s in SHAPES]
        side = torch.cuda.Stream(dev)
        for name, fn in [("reduce_scatter", lambda: tt.reduce_scatter(grads[0], shards, group=groups[0])),
                         ("all_gather", lambda: tt.all_gather([x.to(torch.bfloat16) for x in shards], params,
                                                              group=groups[0]))]:
            graph = torch.cuda.CUDAGraph()
            with pytest.raises(RuntimeError, match=f"tide_triton.{name} " + _MATCH):
                with torch.cuda.graph(graph, stream=side):
                    fn()
        assert groups[0].broken is None
        _check(_eager(groups, grads, layout, dev), grads, layout)
    finally:
        for g in groups:
            g.close()
