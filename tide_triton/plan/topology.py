"""Where ranks sit: ``world_size`` ranks in nodes of ``local_size`` consecutive ranks.

Rank ``r`` is local rank ``r % local_size`` of node ``r // local_size`` (torchrun's
numbering).  A *rail* is the set of ranks with the same local index, one per node: the
cross-node schedules (:mod:`tide_triton.plan.across_nodes`) move data along rails (one NIC
per GPU on rail-optimised clusters), and node-local peers exchange over NVLink/copy
engines.

Pure Python: no torch import, so schedules and the simulator run anywhere.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping

def _check_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")
    return value


@dataclass(frozen=True)
class Topology:
    """``world_size`` ranks in ``world_size // local_size`` nodes of ``local_size`` ranks."""

    world_size: int
    """Ranks in the group, >= 1."""
    local_size: int
    """Consecutive ranks sharing one node, >= 1; ``world_size`` must be a multiple of it."""

    def __post_init__(self) -> None:
        _check_int("world_size", self.world_size)
        _check_int("local_size", self.local_size)
        if self.world_size % self.local_size:
            raise ValueError(
                f"world_size must be a multiple of local_size={self.local_size}, got {self.world_size}"
            )

    @classmethod
    def from_env(cls, world_size: int, local_size: int | None = None,
                 env: Mapping[str, str] | None = None) -> "Topology":
        """``local_size`` if given, else ``LOCAL_WORLD_SIZE`` from ``env`` (default
        ``os.environ``; torchrun sets it), else every rank on one node."""
        _check_int("world_size", world_size)
        if local_size is None:
            raw = (os.environ if env is None else env).get("LOCAL_WORLD_SIZE")
            if raw is None or raw.strip() == "":
                local_size = world_size
            else:
                try:
                    local_size = int(raw.strip())
                except ValueError:
                    raise ValueError(f"LOCAL_WORLD_SIZE must be an int, got {raw!r}") from None
                if local_size < 1:
                    raise ValueError(f"LOCAL_WORLD_SIZE must be >= 1, got {raw!r}")
                if world_size % local_size:
                    raise ValueError(
                        f"world_size={world_size} must be a multiple of LOCAL_WORLD_SIZE, got {raw!r}"
                    )
        return cls(world_size, local_size)

    # ---- derived ----------------------------------------------------------------
    @property
    def nodes(self) -> int:
        """Number of nodes: ``world_size // local_size``."""
        return self.world_size // self.local_size

    def _rank(self, rank: int) -> int:
        if isinstance(rank, bool) or not isinstance(rank, int):
            raise TypeError(f"rank must be an int, got {type(rank).__name__}")
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank must be in [0, {self.world_size}), got {rank}")
        return rank

    def node_of(self, rank: int) -> int:
        """The node rank ``rank`` sits on."""
        return self._rank(rank) // self.local_size

    def local_rank(self, rank: int) -> int:
        """Rank ``rank``'s index within its node (its rail)."""
        return self._rank(rank) % self.local_size

    def rank_of(self, node: int, local: int) -> int:
        """The rank with local index ``local`` on node ``node``."""
        self._index("node", node, self.nodes)
        self._index("local", local, self.local_size)
        return node * self.local_size + local

    def rail(self, local: int) -> tuple[int, ...]:
        """Ranks with local index ``local``, one per node, in node order."""
        self._index("local", local, self.local_size)
        return tuple(range(local, self.world_size, self.local_size))

    def node_ranks(self, node: int) -> tuple[int, ...]:
        """Ranks on node ``node``, in local order."""
        self._index("node", node, self.nodes)
        return tuple(range(node * self.local_size, (node + 1) * self.local_size))

    @staticmethod
    def _index(name: str, value: int, bound: int) -> None:
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an int, got {type(value).__name__}")
        if not 0 <= value < bound:
            raise ValueError(f"{name} must be in [0, {bound}), got {value}")

    def __str__(self) -> str:
        return f"{self.nodes} x {self.local_size}"
