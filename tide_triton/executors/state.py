"""The executors' state of one group (:class:`ExecState`): the eager flag counters, the checks
remembered by address, the all-gather block's release, the multicast and across-nodes
resources, and what CUDA graphs recorded -- typed fields, made on a group's first use.

Group lies below the executors and cannot import this type: it holds the object in an untyped
slot (``Group.executor_state``) and closes it with the group through :meth:`ExecState.close_extra`.
"""
from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import Any

from ..runtime.checks import CheckedLists

log = logging.getLogger("tide_triton")

_MADE = threading.Lock()


@dataclass(eq=False)
class ExecState:
    """Per-group state of the executor layer (:func:`of`)."""

    rank: int
    ag_epoch: int = 0
    """Eager all-gathers run (node-local, or the across-nodes pickup): the value their
    ``ag_ready`` / ``ag_done`` flags carry."""
    rs_count: int = 0
    """Eager reduce-scatter rounds (windows across nodes) run: round ``j`` of the next call
    signals ``rs_count + j + 1``."""
    rs_last: dict[tuple[int, int], int] = field(default_factory=dict)
    """``(dest, stage)`` -> the value this rank last signalled into ``dest``'s ready flag of that
    stage: ``dest``'s free flag must reach it before the slot is written again."""
    checked_shards: CheckedLists = field(default_factory=CheckedLists)
    """The eager reduce-scatter's shard lists whose own checks passed."""
    checked_splits: dict[tuple, bool] = field(default_factory=dict)
    """The caller's lists of ``shard_dims`` calls whose storage and overlaps passed (the newest 64)."""
    released_blocks: dict[str, dict[str, int]] = field(default_factory=dict)
    """Device type -> ``{"offset", "nbytes"}`` of a released all-gather block (:mod:`.ag_block`)."""
    multicast: dict[str, Any] = field(default_factory=dict)
    """Device type -> the path the multicast resolution chose: its ``MulticastBuffers`` (closed
    with the group) or None (:mod:`tide_triton.executors.multicast`)."""
    across_nodes: dict[int, Any] = field(default_factory=dict)
    """``id(transport)`` -> the across-nodes executor's state (its inter-node hop, closed with the
    group; :mod:`tide_triton.executors.across_nodes`)."""
    captured: list[Any] = field(default_factory=list)
    """The prepared collectives a CUDA graph has recorded: kept alive until the group closes."""
    block_free: dict[tuple, list] = field(default_factory=dict)
    """``(device type, index, region key)`` -> ``[event]``: where the last prepared all-gather of
    that block ended quiescent on this rank (``[None]`` before the first)."""

    close_broken = True
    """:meth:`Group.close` passes a broken group's shorter drain to :meth:`close_extra`."""

    def close_extra(self, drain_timeout_s: float | None = None) -> None:
        """Called by :meth:`Group.close`: lets go of the recorded prepared collectives (they hold
        tensors and tables), closes the multicast buffers and the across-nodes hops (their NCCL
        communicators, after ``drain_timeout_s`` where given); every part is closed, the first
        error raised after."""
        self.captured.clear()
        failed: BaseException | None = None
        parts = [(x, False) for x in self.multicast.values() if x is not None]
        parts += [(x, True) for x in self.across_nodes.values()]
        for x, drains in parts:
            try:
                if drains and drain_timeout_s is not None:
                    x.close_extra(drain_timeout_s=drain_timeout_s)
                else:
                    x.close_extra()
            except Exception as e:  # noqa: BLE001 -- the other parts are closed all the same
                log.error("rank %d: closing %s failed: %s", self.rank, type(x).__name__, e)
                failed = failed or e
        if failed is not None:
            raise failed


def of(g: Any) -> ExecState:
    """Group ``g``'s executor state, made on first use."""
    s = g.executor_state
    if s is None:
        with _MADE:
            s = g.executor_state
            if s is None:
                s = g.executor_state = ExecState(g.rank)
    return s


def existing(g: Any) -> ExecState | None:
    """Group ``g``'s executor state, if an executor made it."""
    return g.executor_state
