"""Every exception tide_triton raises on purpose, in one place (see docs/errors.md).

All derive from :class:`TideTritonError`, so ``except tide_triton.TideTritonError`` catches
any of them; each also keeps the built-in base its callers already catch (``TimeoutError``,
``ValueError``, ``RuntimeError``).  No imports of the package: every layer may raise these.
"""
from __future__ import annotations

__all__ = [
    "TideTritonError",
    "PeerTimeoutError",
    "PeerLostError",
    "PeerArgumentError",
    "ArgumentMismatchError",
    "PeerAbortedError",
    "GroupBrokenError",
]


class TideTritonError(Exception):
    """Base of the errors below."""


class PeerTimeoutError(TideTritonError, TimeoutError):
    """A wait on a peer outlived its deadline; ``peer`` names the rank that did not arrive.
    Where the rank waited for was itself waiting for another, ``peer`` is the end of that
    chain -- the rank that is missing -- and ``via`` the ranks between, in order (empty when
    ``peer`` is the rank this rank waited for).

    Fix: find out why rank ``peer`` did not arrive (crashed, stuck, called something else, or
    slower than ``timeout_s``); raise ``GroupOptions.timeout_s`` if it is only slow."""

    def __init__(self, peer: int, what: str, timeout_s: float, via: tuple[int, ...] = ()) -> None:
        super().__init__(f"timed out after {timeout_s:.1f} s waiting for rank {peer} ({what})")
        self.peer = peer
        self.what = what
        self.timeout_s = timeout_s
        self.via = tuple(via)


class PeerLostError(PeerTimeoutError, RuntimeError):
    """The connection to rank ``peer`` failed while this rank waited through it: that process
    is gone, not late.  Raised when torch.distributed's store stops answering -- its host is
    rank 0 under ``init_method="tcp://..."`` or ``"env://"`` (torchrun's agent beside rank 0
    under torchrun) -- so every exchange of every group of the job fails.  A
    :class:`PeerTimeoutError` (a dead peer is caught as one either way) and a ``RuntimeError``
    (the base of torch's ``DistNetworkError`` it replaces, which is its ``__cause__``).

    ``peer`` is None where the store's host is not a rank of this group (global rank 0 outside
    a subgroup).

    Fix: read rank ``peer``'s log (a process killed by a signal or the OOM killer leaves none;
    look at the launcher's and the kernel's).  The group is broken afterwards, and the process
    group too (its store is gone): end the job and restart it (torchrun's ``--max-restarts``
    does), from a checkpoint."""

    def __init__(self, peer: int | None, what: str, timeout_s: float, cause: str) -> None:
        who = "the store's host" if peer is None else f"rank {peer}"
        RuntimeError.__init__(self, f"lost {who} while waiting for {what}: {cause}")
        self.peer = peer
        self.what = what
        self.timeout_s = timeout_s
        self.via = ()
        self.cause = cause


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
