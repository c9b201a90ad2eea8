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
  another exchange of a later call;
* a rank waiting long for a peer notes whom it waits for (:meth:`Exchange.note_wait`), so
  that a peer timing out on *it* can name the rank that is really missing;
* a store that stops answering (its host died: rank 0 under ``init_method="tcp://..."``)
  raises :class:`~tide_triton.errors.PeerLostError` naming that rank, not torch's
  ``DistNetworkError``.

A key is written once by its owner, read by every peer, and deleted by its owner once a
later exchange has completed (every peer has then written that later key, so it has read
the earlier one).  Pure Python plus ``torch.distributed``'s store; no CUDA.
"""
from __future__ import annotations

import pickle
import threading
import time
from typing import Any, Callable, Protocol, Sequence

from ..errors import PeerLostError, PeerTimeoutError

IDENTITIES_KEPT = 4
"""Posted call identities (:meth:`Exchange.post_identity`) a rank keeps in the store."""

_POLL_S = 0.05
"""How long one wait on the store lasts before the missing ranks and the abort keys are
looked at again: a peer's abort is seen within about this long."""

NOTE_AFTER_S = 0.2
"""A wait on one peer lasting this long is noted in the store (:meth:`Exchange.note_wait`)."""

NOTE_EVERY_S = 0.1
"""How often a noted wait is noted again while it lasts: a note whose count stops growing is
a wait that ended (or a rank that died in it)."""


class StoreLost(Exception):
    """The store failed under an operation (its host is gone); ``where`` names the store."""

    def __init__(self, where: str, error: BaseException) -> None:
        super().__init__(f"{where} failed: {type(error).__name__}: {error}")
        self.where = where


class KeyValue(Protocol):
    """The few store operations an exchange needs (``torch.distributed.Store`` has them)."""

    def set(self, key: str, value: bytes) -> None: ...

    def present(self, key: str) -> bool: ...

    def wait_all(self, keys: Sequence[str], timeout_s: float) -> bool:
        """True once every key exists; False after ``timeout_s``."""
        ...

    def get_many(self, keys: Sequence[str]) -> list[bytes]: ...

    def delete(self, key: str) -> None: ...


def _store_address(store: Any) -> str:
    """``"TCPStore at host:port"`` for a (prefixed) TCPStore, else the store's type."""
    inner = store
    while hasattr(inner, "underlying_store"):  # PrefixStore
        inner = inner.underlying_store
    host, port = getattr(inner, "host", None), getattr(inner, "port", None)
    return f"{type(inner).__name__} at {host}:{port}" if host is not None else type(inner).__name__


class StoreKeyValue:
    """A ``torch.distributed.Store`` (TCPStore, FileStore, PrefixStore ...).  A store
    operation that fails (``DistNetworkError`` once the store's host died) raises
    :class:`StoreLost`."""

    def __init__(self, store: Any) -> None:
        self.store = store

    def _failed(self, e: BaseException) -> StoreLost:
        return StoreLost(f"torch.distributed's store ({_store_address(self.store)})", e)

    def set(self, key: str, value: bytes) -> None:
        try:
            self.store.set(key, value)
        except (RuntimeError, OSError) as e:  # DistError derives from RuntimeError
            raise self._failed(e) from e

    def present(self, key: str) -> bool:
        try:
            return bool(self.store.check([key]))
        except (RuntimeError, OSError) as e:
            raise self._failed(e) from e

    def wait_all(self, keys: Sequence[str], timeout_s: float) -> bool:
        # Polls ``check`` (one round trip) with a growing pause rather than ``Store.wait``
        # with a short timeout, which logs a warning at every expiry.
        deadline = time.monotonic() + timeout_s
        pause = 20e-6
        keys = list(keys)
        try:
            while not self.store.check(keys):
                if time.monotonic() >= deadline:
                    return False
                time.sleep(pause)
                pause = min(pause * 2, 2e-3)
        except (RuntimeError, OSError) as e:
            raise self._failed(e) from e
        return True

    def get_many(self, keys: Sequence[str]) -> list[bytes]:
        try:
            if hasattr(self.store, "multi_get"):
                return list(self.store.multi_get(list(keys)))
            return [self.store.get(k) for k in keys]
        except (RuntimeError, OSError) as e:
            raise self._failed(e) from e

    def delete(self, key: str) -> None:
        try:
            self.store.delete_key(key)
        except (RuntimeError, OSError) as e:
            raise self._failed(e) from e


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
    """What a rank published when it abandoned a call: ``(call, kind, message)``, and
    :attr:`gave_up` as a fourth item where it gave up waiting for a rank.  ``kind``:
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

    @property
    def gave_up(self) -> tuple[int, float, str, tuple[int, ...]] | None:
        """Where it gave up waiting (its ``PeerTimeoutError``): ``(the rank missing, seconds
        waited, what it waited for, the ranks between)``; else None."""
        return self[3] if len(self) > 3 else None

    @property
    def missing(self) -> int | None:
        """The rank whose absence made it give up, or None."""
        return None if len(self) < 4 else self[3][0]


class Wait(tuple):
    """A rank's note of a long wait (:meth:`Exchange.note_wait`): ``(call, peer, count)``;
    ``count`` grows with every note of this rank, so two reads tell a wait going on from one
    that ended."""

    @property
    def call(self) -> int:
        return self[0]

    @property
    def peer(self) -> int:
        return self[1]

    @property
    def count(self) -> int:
        return self[2]


class WaitNotes:
    """One call's waits on peers, noted in the store once one lasts :data:`NOTE_AFTER_S`
    and again every :data:`NOTE_EVERY_S` while it lasts.  Called with the peer at every poll
    of a wait (the group's abort watch); costs a clock read until a wait is long."""

    _GAP_S = 0.2
    """Polls of one peer further apart than this belong to two waits."""

    def __init__(self, ex: "Exchange", call: int) -> None:
        self._ex = ex
        self._call = call
        self._since: dict[int, float] = {}
        self._last: dict[int, float] = {}
        self._next = 0.0
        self._peer: int | None = None

    def __call__(self, peer: int) -> None:
        now = time.monotonic()
        if now - self._last.get(peer, -1e9) > self._GAP_S:
            self._since[peer] = now
        self._last[peer] = now
        if now - self._since[peer] >= NOTE_AFTER_S and now >= self._next:
            self._next = now + NOTE_EVERY_S
            self._peer = peer
            self._ex.note_wait(self._call, peer)

    def renew(self) -> None:
        """Note the last noted wait again: the call gave up on that peer and is still held by
        it while it looks for the rank behind it (a peer following this rank sees it live)."""
        if self._peer is not None:
            self._ex.note_wait(self._call, self._peer)

    def clear(self) -> None:
        """The call is over: its note goes (one store delete, only if it noted)."""
        if self._peer is not None:
            self._ex.clear_wait()


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
        self._noted = 0  # notes of waits this rank published (Wait.count)
        self.store_host: int | None = 0
        """The rank named when the store fails: its host, global rank 0 under
        ``init_method="tcp://..."`` or ``"env://"`` (under torchrun the agent beside it);
        None where that rank is not in this group."""

    def _lost(self, e: StoreLost, what: str, timeout_s: float) -> PeerLostError:
        host = None if self.store_host is None else self.name(self.store_host)
        who = "global rank 0 (not in this group)" if host is None else f"rank {host}"
        return PeerLostError(
            host, what, timeout_s,
            f"{e}: {who}, the store's host (under torchrun: its agent), died or exited -- every exchange "
            "of the job goes through that store, so this group is broken and the process group with it: "
            "end the job and restart it")

    # ---- aborts -------------------------------------------------------------------------
    def _abort_key(self, r: int) -> str:
        return f"{self.prefix}abort/{r}"

    def publish_abort(self, call: int, kind: str, message: str,
                      gave_up: tuple[int, float, str, tuple[int, ...]] | None = None) -> None:
        """Tell every peer that this rank abandoned call ``call`` (best effort: a store that
        is gone cannot be told); ``gave_up``: :attr:`Abort.gave_up`, if that was why.  The
        last :data:`ABORTS_KEPT` aborts stay readable: a
        peer explaining a wait on call ``n`` needs the abort *of* call ``n`` (its cause),
        not a later call's refusal on the group that abort broke."""
        a = Abort((call, kind, message) if gave_up is None else (call, kind, message, tuple(gave_up)))
        self._aborts = (self._aborts + [a])[-ABORTS_KEPT:]
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

    # ---- whom a rank waits for ------------------------------------------------------------
    def _wait_key(self, r: int) -> str:
        return f"{self.prefix}wait/{r}"

    def note_wait(self, call: int, peer: int) -> None:
        """Publish that this rank has been waiting for ``peer`` in call ``call`` (best effort;
        :class:`WaitNotes` calls it)."""
        self._noted += 1
        try:
            self.kv.set(self._wait_key(self.rank), pickle.dumps(Wait((call, peer, self._noted))))
        except Exception:  # noqa: BLE001 -- a note only explains; the wait's own error is the one raised
            pass

    def clear_wait(self) -> None:
        try:
            self.kv.delete(self._wait_key(self.rank))
        except Exception:  # noqa: BLE001
            pass

    def wait_of(self, r: int) -> Wait | None:
        """Rank ``r``'s latest note of a long wait (:meth:`note_wait`), or None."""
        key = self._wait_key(r)
        try:
            if not self.kv.present(key):
                return None
            return Wait(pickle.loads(self.kv.get_many([key])[0]))
        except Exception:  # noqa: BLE001 -- diagnosis only
            return None

    def wait_notes(self, call: int) -> WaitNotes:
        return WaitNotes(self, call)

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
        what = f"{what}: its part of bootstrap exchange (call #{call}, step {index})"
        keys = [tag + str(r) for r in range(W)]
        try:
            self.kv.set(mine, pickle.dumps(obj))
            self._wait_for(keys, [r for r in range(W) if r != me], timeout_s, check, what)
            got = [pickle.loads(b) for b in self.kv.get_many(keys)]
        except StoreLost as e:
            raise self._lost(e, what, timeout_s) from e.__cause__
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

    def post_identity(self, call: int, key: int, *, timeout_s: float = 0.0) -> None:
        """Post this rank's identity of call ``call`` (its call number and signature
        fingerprint, :meth:`~tide_triton.group.calls.CallIdentity.check_in`) for peers to read
        later (:meth:`identities`) -- a store write, no wait (``timeout_s``: the deadline a
        lost store's error states).  The last
        :data:`IDENTITIES_KEPT` stay readable: a peer reads call ``n``'s at its call ``n + 1``
        at the latest, and this rank cannot be more than a call ahead of a peer that reads it."""
        k = self._identity_key(call, self.rank)
        try:
            self.kv.set(k, str(int(key)).encode())
        except StoreLost as e:
            raise self._lost(e, f"the store to take call #{call}'s identity", timeout_s) from e.__cause__
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
        what = f"{what}: its identity of call #{call}"
        try:
            self._wait_for(by_rank, list(ranks), timeout_s, check, what)
            return [int(b) for b in self.kv.get_many([keys[r] for r in ranks])]
        except StoreLost as e:
            raise self._lost(e, what, timeout_s) from e.__cause__
