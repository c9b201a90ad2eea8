"""Every exception tide_triton raises on purpose, in one place (see docs/errors.md).

All derive from :class:`TideTritonError`, so ``except tide_triton.TideTritonError`` catches
any of them; each also keeps the built-in base its callers already catch (``TimeoutError``,
``ValueError``, ``RuntimeError``).  No imports of the package: every layer may raise these.
"""
from __future__ import annotations

__all__ = [
    "TideTritonError",
    "PeerTimeoutError",
    "PeerArgumentError",
    "ArgumentMismatchError",
    "PeerAbortedError",
    "GroupBrokenError",
]


class TideTritonError(Exception):
    """Base of the errors below."""


class PeerTimeoutError(TideTritonError, TimeoutError):
    """A wait on a peer outlived its deadline; ``peer`` names the rank waited for.

    Fix: find out why rank ``peer`` did not arrive (crashed, stuck, called something else, or
    slower than ``timeout_s``); raise ``GroupOptions.timeout_s`` if it is only slow."""

    def __init__(self, peer: int, what: str, timeout_s: float) -> None:
        super().__init__(f"timed out after {timeout_s:.1f} s waiting for rank {peer} ({what})")
        self.peer = peer
        self.what = what
        self.timeout_s = timeout_s


class PeerArgumentError(TideTritonError, ValueError):
    """Another rank rejected its arguments to the same collective; this rank raises too
    instead of hanging.  ``rank`` names it, the message carries its error.

    Fix: the error is that rank's -- read its message, fix the call there."""

    def __init__(self, rank: int, message: str) -> None:
        super().__init__(f"rank {rank} rejected its arguments: {message}")
        self.rank = rank


class ArgumentMismatchError(TideTritonError, ValueError):
    """Ranks called collectives whose arguments disagree (another collective, other shapes,
    dtypes or op, or another call of the group's sequence).

    Fix: every rank of a group must make the same collective calls in the same order with
    the same shapes, dtypes and op; the message names the ranks and what differs."""


class PeerAbortedError(TideTritonError, RuntimeError):
    """A peer abandoned a collective this rank was taking part in (its call raised after
    the collective had started, e.g. a bad argument under ``agree="first"`` or a transport
    error); ``rank`` names it and ``call`` the group's call number.

    Fix: read the error on rank ``rank``.  The group is broken afterwards (see
    :class:`GroupBrokenError`)."""

    def __init__(self, rank: int, call: int, message: str) -> None:
        super().__init__(f"rank {rank} abandoned collective call #{call}: {message}")
        self.rank = rank
        self.call = call


class GroupBrokenError(TideTritonError, RuntimeError):
    """The group was left in the middle of a collective (a peer timed out, aborted, or a
    call failed after data started moving), so its staging and flags can no longer be
    trusted: every later call raises this instead of risking stale data.

    Fix: ``group.close()`` it and make a new one (``tide_triton.init`` creates a fresh group
    for the process group once the old one is closed)."""
