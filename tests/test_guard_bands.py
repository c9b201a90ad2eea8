"""No collective writes outside the caller's tensors.

Every tensor the caller passes (gradients, shards, parameters) is a view inside a larger
buffer with guard bands of a sentinel before and after it (in a heap region for the
all-gather's ``params_region`` path); after each collective every byte outside the tensors
must still hold the sentinel, and the results must be the contract's.  Over padded and
unpadded shards and parameters, a copy and a cast, W = 2 and 3, the block path and the
region path of the all-gather, ring- and region-staged reduce-scatters, one node and
declared nodes; processes, on the CPU and (where present) the GPU.  A padded shard's padding
staged past the end of an unpadded parameter shows here on the CPU, where the copies run in
list order and would otherwise hide it.
"""
from __future__ import annotations

import pytest
import torch

try:
    from _dist import nccl_problem, rank_device, run_multiprocess
except ImportError:  # pragma: no cover
    from tests._dist import nccl_problem, rank_device, run_multiprocess

_KINDS = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]  # gpu: skipped without CUDA

pytestmark = pytest.mark.multiproc

_GUARD = 5  # elements of sentinel around every tensor
_SENTINEL = -77.0


def _shapes(W: int) -> list[tuple[int, ...]]:
    # the last ranks hold fewer rows, or none; one row-less parameter per kind of remainder
    return [(2 * W + 1, 3), (3 * W - 1,), (W - 1, 2), (1, 4, 3), (W + 1, 1), (5 * W, 2)]


class _Carver:
    """Tensors carved out of one flat buffer, each with ``_GUARD`` sentinel elements before
    and after it; ``intact()`` says whether every guard element still holds the sentinel."""

    def __init__(self, flat: torch.Tensor) -> None:
        self.flat = flat
        self.flat.fill_(_SENTINEL)
        self.used = 0
        self.spans: list[tuple[int, int]] = []

    def take(self, shape: tuple[int, ...]) -> torch.Tensor:
        n = int(torch.Size(shape).numel())
        start = self.used + _GUARD
        if start + n + _GUARD > self.flat.numel():
            raise ValueError("carver out of room")
        self.spans.append((start, start + n))
        self.used = start + n
        return self.flat[start:start + n].view(shape)

    def broken_guards(self) -> list[int]:
        mask = torch.ones(self.flat.numel(), dtype=torch.bool, device=self.flat.device)
        for a, b in self.spans:
            mask[a:b] = False
        outside = self.flat[mask]
        return torch.nonzero(outside != _SENTINEL).flatten().tolist()[:8]


def _room(shapes: list[tuple[int, ...]], W: int) -> int:
    from tide_triton.plan.layout import ShardLayout

    layout = ShardLayout(shapes, W)
    return W * sum(layout.padded_shard_numels) + 2 * _GUARD * (len(shapes) + 2)


def _guarded(rank: int, W: int, kind: str = "cpu", local_size: int | None = None) -> dict:
    import tide_triton as tt
    from tide_triton.plan.layout import ShardLayout

    dev = rank_device(rank) if kind == "cuda" else torch.device("cpu")
    if dev.type == "cuda":
        torch.cuda.set_device(dev)

    def done() -> None:  # the call's GPU work is finished before the host looks
        if dev.type == "cuda":
            tt.synchronize(g)

    g = tt.init(timeout_s=60) if local_size is None else tt.init(local_size=local_size, timeout_s=60)
    nodes = 1 if local_size is None else W // local_size
    shapes = _shapes(W)
    layout = ShardLayout(shapes, W)
    room = _room(shapes, W)
    full = [(torch.arange(int(torch.Size(s).numel()), device=dev) % 29 - 14).float().view(s) for s in shapes]
    region = g.heap_region("params", room * 4, dev)
    problems: list[str] = []
    for padded_params in (False, True):
        pshapes = layout.padded_shapes if padded_params else shapes
        for padded_shards in (False, True):
            for sdt in (torch.bfloat16, torch.float32):
                what = f"params {'padded' if padded_params else 'full'}, shards " \
                       f"{'padded' if padded_shards else 'real rows'}, {str(sdt)[6:]}"
                for where in ("block", "region") if nodes == 1 else ("block",):  # region: one node
                    sh = _Carver(torch.empty(room, dtype=sdt, device=dev))
                    shards = []
                    for f, c, n in zip(full, layout.rows_per_rank, layout.shard_rows(rank)):
                        x = sh.take((c if padded_shards else n, *f.shape[1:]))
                        x.fill_(33.0)  # padding rows: 33, never to be seen in a parameter
                        x[:n] = f[rank * c: rank * c + n].to(sdt)
                        shards.append(x)
                    if where == "region":
                        pc = _Carver(region.tensor(torch.bfloat16, room))
                    else:
                        pc = _Carver(torch.empty(room, dtype=torch.bfloat16, device=dev))
                    params = [pc.take(s) for s in pshapes]
                    tt.all_gather(shards, params, params_region=region if where == "region" else None)
                    done()
                    for p, (a, f) in enumerate(zip(params, full)):
                        if not torch.equal(a[: f.shape[0]].float(), f):
                            problems.append(f"all_gather ({where}; {what}): params[{p}] wrong")
                        # a padded parameter's rows that real-row shards lack arrive as zeros
                        if padded_params and not padded_shards and bool((a[f.shape[0]:] != 0).any()):
                            problems.append(f"all_gather ({where}; {what}): params[{p}]'s padding rows not zero")
                    for name, carver in (("params", pc), ("shards", sh)):
                        if carver.broken_guards():
                            problems.append(f"all_gather ({where}; {what}): wrote outside the {name} at guard "
                                            f"elements {carver.broken_guards()}")
                    if where == "region":
                        region.vacate()
                if padded_params:
                    continue  # the reduce-scatter's gradients are full: its layout comes from them
                # the reduce-scatter: bf16 gradients in, fp32 or bf16 shards (padded or not) out
                gc = _Carver(torch.empty(room, dtype=torch.bfloat16, device=dev))
                grads = [gc.take(s) for s in shapes]
                for x, f in zip(grads, full):
                    x.copy_((f * (rank + 1)).to(torch.bfloat16))
                for staging in (None, region) if nodes == 1 else (None,):  # the ring, or the vacated region
                    how = "ring" if staging is None else "region"
                    oc = _Carver(torch.empty(room, dtype=sdt, device=dev))
                    outs = [oc.take(s) for s in (layout.shard_shapes(rank, padded=True) if padded_shards
                                                  else layout.shard_shapes(rank))]
                    tt.reduce_scatter(grads, outs, op="sum", staging=staging)
                    done()
                    total = W * (W + 1) // 2
                    for p, (o, f, c, n) in enumerate(zip(outs, full, layout.rows_per_rank, layout.shard_rows(rank))):
                        want = (f[rank * c: rank * c + n] * total).to(sdt)
                        if not torch.equal(o[:n], want) or (o.shape[0] > n and bool((o[n:] != 0).any())):
                            problems.append(f"reduce_scatter ({how}; {what}): shards[{p}] wrong")
                    for name, carver in (("gradients", gc), ("shards", oc)):
                        if carver.broken_guards():
                            problems.append(f"reduce_scatter ({how}; {what}): wrote outside the {name} at guard "
                                            f"elements {carver.broken_guards()}")
                    if staging is not None:
                        staging.vacate()  # used again next round: the peers have read what they staged
    done()
    g.close()
    return {"problems": problems}


@pytest.mark.parametrize("kind", _KINDS)
@pytest.mark.parametrize("world_size", [2, 3])
def test_collectives_write_only_inside_the_callers_tensors(world_size: int, kind: str) -> None:
    out = run_multiprocess(_guarded, world_size, kind, timeout=300)
    for r, res in enumerate(out):
        assert not res["problems"], (r, res["problems"][:6])


@pytest.mark.parametrize("kind", _KINDS)
@pytest.mark.parametrize("world_size,local_size", [(2, 1), (4, 2)])
def test_cross_node_collectives_write_only_inside_the_callers_tensors(world_size: int, local_size: int,
                                                                       kind: str) -> None:
    """The same over declared nodes (the cross-node executor: its own staging, its own own-row
    copies and zero-fill of missing rows; on the GPU its hop needs NCCL, >= 2.30 for several
    ranks on one GPU)."""
    if kind == "cuda" and (why := nccl_problem(world_size)):
        pytest.skip(why)
    out = run_multiprocess(_guarded, world_size, kind, local_size, timeout=300)
    for r, res in enumerate(out):
        assert not res["problems"], (r, res["problems"][:6])


# ---- the public kernels, in this process (interpreter on the CPU, compiled on a GPU) ------
@pytest.mark.parametrize("padded", [False, True], ids=["real-rows", "padded"])
def test_kernels_write_only_inside_their_outputs(device: torch.device, padded: bool) -> None:
    """``place_shards`` into parameters, ``accumulate_shards`` into shards and ``pack_shards``
    into a flat buffer, each output carved between guard bands: the bands stay intact and the
    outputs equal the plain-torch references."""
    import tide_triton as tt
    from tide_triton.plan.layout import ShardLayout

    W, rank = 3, 2  # the last rank: fewer real rows, or none
    shapes = _shapes(W)
    layout = ShardLayout(shapes, W)
    room = _room(shapes, W)
    gen = torch.Generator().manual_seed(3)
    blocks = [torch.randint(-9, 10, (layout.flat_shard_numel,), generator=gen).float().to(device) for _ in range(W)]
    pc = _Carver(torch.empty(room, dtype=torch.bfloat16, device=device))
    params = [pc.take(s) for s in (layout.padded_shapes if padded else shapes)]
    tt.place_shards(blocks, params, layout)
    ref = [torch.empty_like(p) for p in params]
    tt.place_shards_ref(blocks, ref, layout)
    assert all(torch.equal(a[: s[0]], b[: s[0]]) for a, b, s in zip(params, ref, shapes))
    assert not pc.broken_guards(), ("place_shards", pc.broken_guards())

    grads = [[torch.randint(-9, 10, s, generator=gen).to(torch.bfloat16).to(device) for s in shapes]
             for _ in range(W)]
    sc = _Carver(torch.empty(room, dtype=torch.float32, device=device))
    shards = [sc.take(s) for s in layout.shard_shapes(rank, padded=padded)]
    tt.accumulate_shards(grads, shards, layout, rank)
    want = [torch.zeros(s, device=device) for s in layout.shard_shapes(rank, padded=padded)]
    tt.accumulate_shards_ref(grads, want, layout, rank)
    n_real = layout.shard_rows(rank)
    assert all(torch.equal(a[:n], b[:n]) for a, b, n in zip(shards, want, n_real))
    assert not sc.broken_guards(), ("accumulate_shards", sc.broken_guards())

    fc = _Carver(torch.empty(room, dtype=torch.float32, device=device))
    flat = fc.take((layout.flat_shard_numel,))
    tt.pack_shards(grads[0], flat, layout, rank)
    want_flat = torch.full_like(flat, _SENTINEL)
    tt.pack_shards_ref(grads[0], want_flat, layout, rank)
    written = want_flat != _SENTINEL
    assert torch.equal(flat[written], want_flat[written])
    assert not fc.broken_guards(), ("pack_shards", fc.broken_guards())
