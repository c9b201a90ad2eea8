"""Bootstrap exchanges with deadlines: how a group's ranks swap small objects.

Every collective's agreement, every transport's set-up (heap names, handles, sizes) and every
heap growth exchanges one small picklable object per rank.  These exchanges go through a
key-value store -- the process group's own ``torch.distributed`` store, or an in-process
dictionary for the single-process mode -- never through a collective of the process group,
so that:

* every wait has the group's deadline (``timeout_s``) and, when it passes, raises
  :class:`~tide_triton.errors.PeerTimeoutError` naming every rank that has not arrived
  (a gloo collective waits for the process group's own timeout, 30 minutes by default, and
  reports a socket error, not a rank);
* a rank that abandons a call publishes that (:meth:`Exchange.publish_abort`) and peers
  waiting in an exchange raise at once, naming it;
* keys carry the group's call number and the exchange's index within the call, so an
  exchange one rank skipped (its call failed before reaching it) can never pair with
  another exchange of a later call.

A key is written once by its owner, read by every peer, and deleted by its owner once a
later exchange has completed (every peer has then written that later key, so it has read
the earlier one).  Pure Python plus ``torch.distributed``'s store; no CUDA.
"""
from __future__ import annotations

import pickle
import threading
import time
from typing import Any, Callable, Protocol, Sequence

from .errors import PeerTimeoutError

__all__ = ["KeyValue", "StoreKeyValue", "LocalKeyValue", "Exchange", "Abort"]

IDENTITIES_KEPT = 4
"""Posted call identities (:meth:`Exchange.post_identity`) a rank keeps in the store."""

_POLL_S = 0.05
"""How long one wait on the store lasts before the missing ranks and the abort keys are
looked at again: a peer's abort is seen within about this long."""


class KeyValue(Protocol):
    """The few store operations an exchange needs (``torch.distributed.Store`` has them)."""

    def set(self, key: str, value: bytes) -> None: ...

    def present(self, key: str) -> bool: ...

    def wait_all(self, keys: Sequence[str], timeout_s: float) -> bool:
        """True once every key exists; False after ``timeout_s``."""
        ...

    def get_many(self, keys: Sequence[str]) -> list[bytes]: ...

    def delete(self, key: str) -> None: ...


class StoreKeyValue:
    """A ``torch.distributed.Store`` (TCPStore, FileStore, PrefixStore ...)."""

    def __init__(self, store: Any) -> None:
        self.store = store

    def set(self, key: str, value: bytes) -> None:
        self.store.set(key, value)

    def present(self, key: str) -> bool:
        return bool(self.store.check([key]))

    def wait_all(self, keys: Sequence[str], timeout_s: float) -> bool:
        # Polls ``check`` (one round trip) with a growing pause rather than ``Store.wait``
        # with a short timeout, which logs a warning at every expiry.
        deadline = time.monotonic() + timeout_s
        pause = 20e-6
        keys = list(keys)
        while not self.store.check(keys):
            if time.monotonic() >= deadline:
                return False
            time.sleep(pause)
            pause = min(pause * 2, 2e-3)
        return True

    def get_many(self, keys: Sequence[str]) -> list[bytes]:
        if hasattr(self.store, "multi_get"):
            return list(self.store.multi_get(list(keys)))
        return [self.store.get(k) for k in keys]

    def delete(self, key: str) -> None:
        self.store.delete_key(key)


class LocalKeyValue:
    """An in-process store for ranks driven by threads of one process."""

    def __init__(self) -> None:
        self._data: dict[str, bytes] = {}
        self._cond = threading.Condition()

    def set(self, key: str, value: bytes) -> None:
        with self._cond:
            self._data[key] = value
            self._cond.notify_all()

    def present(self, key: str) -> bool:
        with self._cond:
            return key in self._data

    def wait_all(self, keys: Sequence[str], timeout_s: float) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: all(k in self._data for k in keys), timeout_s)

    def get_many(self, keys: Sequence[str]) -> list[bytes]:
        with self._cond:
            return [self._data[k] for k in keys]

    def delete(self, key: str) -> None:
        with self._cond:
            self._data.pop(key, None)


ABORTS_KEPT = 16
"""How many of a rank's latest aborts its peers can read (:meth:`Exchange.abort_of`)."""


class Abort(tuple):
    """What a rank published when it abandoned a call: ``(call, kind, message)``.  ``kind``:
    ``"argument"`` (its arguments were bad; nothing of the call moved), ``"failed"`` (it
    failed after data may have moved), ``"broken"`` (its group is broken)."""

    @property
    def call(self) -> int:
        return self[0]

    @property
    def kind(self) -> str:
        return self[1]

    @property
    def message(self) -> str:
        return self[2]


class Exchange:
    """All-gathers of one small picklable object per rank, with a deadline.

    ``kv``: the store; ``prefix``: this group's keys (unique per group instance, the same on
    every rank); ``rank`` / ``world_size``: within the group; ``names``: how to call rank
    ``r`` in errors (its rank in the group, or a global rank)."""

    def __init__(self, kv: KeyValue, prefix: str, rank: int, world_size: int,
                 name: Callable[[int], int] = lambda r: r) -> None:
        self.kv = kv
        self.prefix = prefix
        self.rank = rank
        self.world_size = world_size
        self.name = name
        self._mine: list[str] = []  # my keys not yet deleted, oldest first
        self._aborts: list[Abort] = []  # what this rank published, oldest first
        self._posted: list[str] = []  # identity keys this rank posted, not yet deleted, oldest first

    # ---- aborts -------------------------------------------------------------------------
    def _abort_key(self, r: int) -> str:
        return f"{self.prefix}abort/{r}"

    def publish_abort(self, call: int, kind: str, message: str) -> None:
        """Tell every peer that this rank abandoned call ``call`` (best effort: a store that
        is gone cannot be told).  The last :data:`ABORTS_KEPT` aborts stay readable: a
        peer explaining a wait on call ``n`` needs the abort *of* call ``n`` (its cause),
        not a later call's refusal on the group that abort broke."""
        self._aborts = (self._aborts + [Abort((call, kind, message))])[-ABORTS_KEPT:]
        try:
            self.kv.set(self._abort_key(self.rank), pickle.dumps(self._aborts))
        except Exception:  # noqa: BLE001 -- the store may be gone with its host
            pass

    def aborts_of(self, r: int) -> list[Abort]:
        """The aborts rank ``r`` published (its last :data:`ABORTS_KEPT`), oldest first."""
        key = self._abort_key(r)
        try:
            if not self.kv.present(key):
                return []
            return list(pickle.loads(self.kv.get_many([key])[0]))
        except Exception:  # noqa: BLE001
            return []

    def abort_of(self, r: int, since: int = 0) -> Abort | None:
        """The first abort rank ``r`` published of call ``since`` or later, or None."""
        return next((a for a in self.aborts_of(r) if a.call >= since), None)

    # ---- the exchange -------------------------------------------------------------------
    def exchange(self, obj: object, *, call: int, index: int, timeout_s: float, what: str,
                 check: Callable[[Sequence[int]], None] | None = None) -> list:
        """Every rank's ``obj`` in rank order.  ``(call, index)`` names the exchange (the
        group's call number and the exchange's place in that call).  While waiting,
        ``check(missing_ranks)`` runs every :data:`_POLL_S` (it may raise, e.g. for a
        peer's published abort).  After ``timeout_s`` raises ``PeerTimeoutError`` naming
        the first missing rank and listing all of them."""
        W, me = self.world_size, self.rank
        tag = f"{self.prefix}x/{call}/{index}/"
        mine = tag + str(me)
        self.kv.set(mine, pickle.dumps(obj))
        keys = [tag + str(r) for r in range(W)]
        self._wait_for(keys, [r for r in range(W) if r != me], timeout_s, check,
                       f"{what}: its part of bootstrap exchange (call #{call}, step {index})")
        got = [pickle.loads(b) for b in self.kv.get_many(keys)]
        # Every peer wrote this exchange's key, so it has read all my earlier keys.
        for old in self._mine:
            try:
                self.kv.delete(old)
            except Exception:  # noqa: BLE001 -- cleanup only
                pass
        self._mine = [mine]
        return got

    def _wait_for(self, keys: Sequence[str], pending: Sequence[int], timeout_s: float,
                  check: Callable[[Sequence[int]], None] | None, what: str) -> None:
        """Until ``keys[r]`` is in the store for every rank ``r`` of ``pending`` (``keys`` in
        rank order), running ``check(missing ranks)`` every :data:`_POLL_S`; past ``timeout_s``
        ``PeerTimeoutError`` naming the first missing rank ("waiting for rank r: ``what``")
        and listing them all."""
        pending = list(pending)
        deadline = time.monotonic() + timeout_s
        while pending:
            left = deadline - time.monotonic()
            if self.kv.wait_all([keys[r] for r in pending], min(_POLL_S, max(left, 0.0))):
                return
            pending = [r for r in pending if not self.kv.present(keys[r])]
            if not pending:
                return
            if check is not None:
                check(pending)
            if time.monotonic() >= deadline:
                names = [self.name(r) for r in pending]
                more = "" if len(names) == 1 else f"; ranks {names} have not arrived"
                raise PeerTimeoutError(names[0], f"{what}{more}", timeout_s)

    # ---- posted call identities -----------------------------------------------------------
    def _identity_key(self, call: int, r: int) -> str:
        return f"{self.prefix}id/{call}/{r}"

    def post_identity(self, call: int, key: int) -> None:
        """Post this rank's identity of call ``call`` (its call number and signature
        fingerprint, :meth:`~tide_triton.calls.CallIdentity.check_in`) for peers to read
        later (:meth:`identities`) -- a store write, no wait.  The last
        :data:`IDENTITIES_KEPT` stay readable: a peer reads call ``n``'s at its call ``n + 1``
        at the latest, and this rank cannot be more than a call ahead of a peer that reads it."""
        k = self._identity_key(call, self.rank)
        self.kv.set(k, str(int(key)).encode())
        self._posted.append(k)
        while len(self._posted) > IDENTITIES_KEPT:
            try:
                self.kv.delete(self._posted.pop(0))
            except Exception:  # noqa: BLE001 -- cleanup only
                pass

    def identities(self, ranks: Sequence[int], call: int, *, timeout_s: float, what: str,
                   check: Callable[[Sequence[int]], None] | None = None) -> list[int]:
        """The identities ``ranks`` posted of call ``call`` (:meth:`post_identity`), in the
        order of ``ranks``, waiting for them with the deadline of :meth:`exchange`."""
        keys = {r: self._identity_key(call, r) for r in ranks}
        by_rank = [keys.get(r, "") for r in range(self.world_size)]
        self._wait_for(by_rank, list(ranks), timeout_s, check, f"{what}: its identity of call #{call}")
        return [int(b) for b in self.kv.get_many([keys[r] for r in ranks])]
