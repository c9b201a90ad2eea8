"""The checks a prepared collective remembers (``_checks.CheckedLists``: a list's storage and
disjointness, by its addresses, sizes and dtype) never let through what the checks without
memory refuse.  A differential test: random sequences of calls on new first lists beside
recurring second lists -- some of them changed at the same addresses and element counts (another
dtype, another shape, a transposed view, flattened), some over the other list's bytes -- each
checked by ``_Prepared._check`` as it runs and by the same check with its memory cleared; the
two must raise alike, with the same message, on every call.  (One case passes both ways by
design and is left out: a storage freed and allocated again, smaller, at the same address --
the trust a set of addresses seen before already has.)"""
from __future__ import annotations

import random
import types

import pytest
import torch

from tide_triton.executors import prepared as programs
from tide_triton.runtime.checks import CheckedLists
from tide_triton.plan.layout import ShardLayout

W = 3
LAYOUTS = [ShardLayout([(7, 3), (2,), (5, 2)], W), ShardLayout([(6, 4), (4,)], W), ShardLayout([(3, 3)], W)]
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _prepared(cls, layout: ShardLayout, rank: int, dtypes) -> programs._Prepared:
    """What ``_check`` reads of a prepared collective, without a group."""
    p = object.__new__(cls)
    p.g = types.SimpleNamespace(rank=rank, world_size=W)
    p.layout, p.device, p._dtypes = layout, torch.device("cpu"), dtypes
    p._checked_second = CheckedLists(programs._LISTS_KEPT)
    return p


def _outcome(p, first, second) -> str:
    try:
        p._check(list(first), list(second), programs._Prepared._key(first, second))
        return "ok"
    except (TypeError, ValueError) as e:
        return f"{type(e).__name__}: {e}"


def _at(storage: torch.UntypedStorage, byte_off: int, dtype: torch.dtype, shape) -> torch.Tensor:
    es = torch.empty(0, dtype=dtype).element_size()
    return torch.empty(0, dtype=dtype).set_(storage, byte_off // es, shape)


class _Maker:
    def __init__(self, rng: random.Random) -> None:
        self.rng, self.alive = rng, []  # buffers kept alive: no address is reused by accident

    def packed(self, shapes, dtype, overlap: bool = False) -> list[torch.Tensor]:
        """Tensors back to back in one buffer (FSDP2's layout), or each overlapping the last."""
        es = torch.empty(0, dtype=dtype).element_size()
        numels = [torch.Size(s).numel() for s in shapes]
        b = torch.zeros(64 + 8 * (sum(numels) + 8) * 4, dtype=torch.uint8)
        self.alive.append(b)
        out, off = [], 8 * self.rng.randrange(3)
        for s, n in zip(shapes, numels):
            out.append(_at(b.untyped_storage(), off, dtype, s))
            step = n * es
            off += max(es, step - es) if overlap and n > 1 and self.rng.random() < 0.5 else -(-step // 8) * 8
        return out

    def full(self, layout: ShardLayout, dtype, near=None) -> list[torch.Tensor]:
        rng = self.rng
        ts = self.packed(layout.shapes, dtype) if rng.random() < 0.5 else [torch.zeros(s, dtype=dtype)
                                                                          for s in layout.shapes]
        self.alive.extend(ts)
        r = rng.random()
        if near is not None and r < 0.15:  # a full tensor over the other list's bytes
            i, j = rng.randrange(len(ts)), rng.randrange(len(near))
            es = ts[i].element_size()
            off = near[j].storage_offset() * near[j].element_size()
            if near[j].numel() and off % es == 0 and off + ts[i].numel() * es <= near[j].untyped_storage().nbytes():
                ts[i] = _at(near[j].untyped_storage(), off, dtype, ts[i].shape)
        elif r < 0.2:  # another dtype
            i = rng.randrange(len(ts))
            ts[i] = ts[i].to(rng.choice([d for d in DTYPES if d != dtype]))
        return ts

    def shards(self, layout: ShardLayout, rank: int, dtype, overlap: bool) -> list[torch.Tensor]:
        return self.packed(layout.shard_shapes(rank, padded=self.rng.random() < 0.5), dtype, overlap)

    def same_addresses(self, ts: list[torch.Tensor]) -> list[torch.Tensor]:
        """One tensor changed, its data_ptr and element count kept (what the memory's key sees)."""
        rng, out = self.rng, list(ts)
        i = rng.randrange(len(ts))
        t = ts[i]
        if t.numel() == 0:
            return out
        kind = rng.choice(["dtype", "reshape", "transpose", "flat"])
        if kind == "dtype":
            other = rng.choice([d for d in DTYPES if d != t.dtype])
            es = torch.empty(0, dtype=other).element_size()
            off = t.storage_offset() * t.element_size()
            if off % es == 0 and off + t.numel() * es <= t.untyped_storage().nbytes():
                out[i] = _at(t.untyped_storage(), off, other, t.shape)
        elif kind == "reshape" and t.dim() == 2 and 1 not in t.shape and t.shape[0] != t.shape[1]:
            out[i] = t.view(t.shape[1], t.shape[0])
        elif kind == "transpose" and t.dim() == 2 and min(t.shape) > 1:
            out[i] = t.view(t.shape[1], t.shape[0]).t()  # same shape and address, not contiguous
        elif kind == "flat" and t.dim() == 2:
            out[i] = t.reshape(-1)
        assert out[i].data_ptr() == t.data_ptr() and out[i].numel() == t.numel()
        return out


@pytest.mark.parametrize("seed", [0, 1])
def test_remembered_checks_refuse_what_the_checks_without_memory_refuse(seed: int) -> None:
    rng = random.Random(seed)
    make = _Maker(rng)
    seen = {"ok": 0, "refused": 0}
    for _ in range(150):
        layout, rank = rng.choice(LAYOUTS), rng.randrange(W)
        full_dtype, shard_dtype = rng.choice(DTYPES[:2]), rng.choice(DTYPES[:2])
        rs = rng.random() < 0.5
        cls = programs.PreparedReduceScatter if rs else programs.PreparedAllGather
        p = _prepared(cls, layout, rank, (full_dtype, shard_dtype))
        # the lists that recur: a reduce-scatter's shards, an all-gather's params
        pool = [make.shards(layout, rank, shard_dtype, overlap=rng.random() < 0.1) if rs
                else make.full(layout, full_dtype) for _ in range(2)]
        for call in range(10):
            second = rng.choice(pool)
            if rng.random() < 0.3:
                second = make.same_addresses(second)
            first = make.full(layout, full_dtype, near=second) if rs else make.shards(layout, rank, shard_dtype, False)
            got = _outcome(p, first, second)
            want = _outcome(_prepared(cls, layout, rank, (full_dtype, shard_dtype)), first, second)
            assert got == want, (seed, cls.__name__, call, got, want)
            seen["ok" if got == "ok" else "refused"] += 1
    assert seen["ok"] > 200 and seen["refused"] > 200, seen  # both outcomes well covered
