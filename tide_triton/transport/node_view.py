"""A node-local transport addressed with global rank numbers.

A group of several nodes connects each node's ranks with their own transport (VMM handles
and copy engines do not cross nodes), whose ranks are numbered 0..L-1.  The cross-node
executor (:mod:`tide_triton.executors.across_nodes`) names ranks globally, as its plans do;
:class:`GlobalRanks` translates: global rank ``first + i`` is the inner transport's rank
``i``, and the inner transport's timeouts name global ranks.  Naming a rank of another node
is an error (a ValueError naming it and the node's ranks), never a wrong address.
Everything without a rank argument passes through.
"""
from __future__ import annotations

from typing import Any, Sequence

from .base import Transport

class GlobalRanks:
    def __init__(self, inner: Transport, first: int) -> None:
        self.inner = inner
        self.first = first
        self.rank = first + inner.rank
        inner.rank_offset = first  # its timeouts name global ranks

    def __getattr__(self, name: str) -> Any:  # everything without a rank argument
        return getattr(self.inner, name)

    def __repr__(self) -> str:
        return f"GlobalRanks({self.inner!r}, ranks {self.first}..{self.first + self.inner.local_size - 1})"

    def _local(self, rank: int, what: str) -> int:
        ok = not isinstance(rank, bool) and isinstance(rank, int)
        i = rank - self.first if ok else -1
        if not 0 <= i < self.inner.local_size:
            raise ValueError(f"{what}={rank!r} is not a rank of this node (ranks {self.first}.."
                             f"{self.first + self.inner.local_size - 1})")
        return i

    def address(self, rank: int, offset: int) -> int:
        return self.inner.address(self._local(rank, "rank"), offset)

    def heap_tensor(self, rank: int, offset: int, numel: int, dtype: Any) -> Any:
        return self.inner.heap_tensor(self._local(rank, "rank"), offset, numel, dtype)

    def signal(self, rank: int, slot: int, value: int, **kw: Any) -> None:
        self.inner.signal(self._local(rank, "rank"), slot, value, **kw)

    def signal_all(self, ranks: Sequence[int], slots: Sequence[int], values: Sequence[int], **kw: Any) -> None:
        self.inner.signal_all([self._local(r, "rank") for r in ranks], slots, values, **kw)

    def wait(self, slot: int, value: int, *, peer: int, **kw: Any) -> None:
        self.inner.wait(slot, value, peer=self._local(peer, "peer"), **kw)

    def wait_all(self, slots: Sequence[int], values: Sequence[int], *, peers: Sequence[int], **kw: Any) -> None:
        self.inner.wait_all(slots, values, peers=[self._local(p, "peer") for p in peers], **kw)

    def wait_all_equal(self, slots: Sequence[int], values: Sequence[int], *, peers: Sequence[int],
                       **kw: Any) -> None:
        self.inner.wait_all_equal(slots, values, peers=[self._local(p, "peer") for p in peers], **kw)
