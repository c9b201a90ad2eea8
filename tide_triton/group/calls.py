"""Collective calls of a group and their identity: what keeps two ranks from ever pairing
different calls (see docs/errors.md).

* :class:`CallIdentity` -- a group's calls (owned by :class:`~tide_triton.group.core.Group`):
  their numbers, the agreement on arguments and errors through the bootstrap store
  (:meth:`~CallIdentity.agree`), ``check_in`` telling the peers a call's identity (call
  number and signature fingerprint, two flag words per rank by call parity) before any of
  its data moves and checking theirs, aborts published in the bootstrap store and in flag
  words, the broken state, and the explanation of a GPU timeout from them.
* :class:`Call` -- one collective call: numbered (every rank counts the same calls),
  refused on a broken group or from a second thread, and on an error it publishes the abort
  to the peers and, once data may have moved, marks the group broken.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any, NoReturn, Sequence

from ..runtime import stall_watch
from .bootstrap import NOTE_EVERY_S, Abort, Exchange
from ..errors import (
    ArgumentMismatchError,
    GroupBrokenError,
    PeerAbortedError,
    PeerArgumentError,
    PeerLostError,
    PeerTimeoutError,
)
from .signatures import check_same, describe, fingerprint, sig32, sig32_of

log = logging.getLogger("tide_triton")

FOLLOW_S = 6 * NOTE_EVERY_S
"""How long a rank timing out on a peer that noted a wait of its own looks for that note to
be renewed (a wait going on) before it takes the note as stale."""

FAILED_KEPT = 256
"""This rank's failed calls remembered (:meth:`CallIdentity._note_failed`): a peer's abort of
an older one is taken as of a call this rank completed -- only ever in an error message."""

AGREED_KEPT = 4096
"""Signatures remembered with ``agree="first"`` (a model's parameter groups x ops)."""


class CallIdentity:
    """The calls of one rank of a group: numbering, agreement, identity, aborts, broken state.

    ``exchange``: the group's bootstrap exchange; ``flags``: its flag map (the call-identity
    and abort words); ``timeout_s`` / ``agree``: the group's options of those names;
    ``transports``: the group's transports now (their flags are read in a diagnosis and
    written with an abort)."""

    def __init__(self, rank: int, world_size: int, exchange: Exchange, *, flags: Any, timeout_s: float,
                 agree: str = "always", transports: Callable[[], Iterable[Any]] = tuple) -> None:
        self.rank = rank
        self.world_size = world_size
        self.flags = flags
        self.timeout_s = timeout_s
        self._agree_first = agree == "first"
        self._exchange = exchange
        self._transports = transports
        self.seq = 0
        """Collective calls started (every rank counts the same calls)."""
        self.broken: str | None = None
        """Why the group is broken (see :class:`~tide_triton.errors.GroupBrokenError`), or None."""
        self.current: Call | None = None
        """The call in progress, or None."""
        self._lock = threading.Lock()  # one call at a time (Call.__enter__)
        self._failed_calls: tuple[int, ...] = ()  # calls that failed on this rank (_note_failed)
        self._keys: dict[int, tuple[int, object]] = {}  # recent calls: identity word, signature
        self._sig_names: dict[int, str] = {}  # 32-bit fingerprints of agreed signatures: descriptions
        self._posted_pending: tuple[int, int, tuple[int, ...]] | None = None  # see check_in_posted
        self._setup_index = 0  # exchanges outside any call (creation): call number 0
        self._agreed: set = set()  # agree="first": signatures agreed before

    # ---- agreement ---------------------------------------------------------------------
    def exchange(self, obj: object) -> list:
        """All-gather one small picklable object per rank (rank order), with the group's
        deadline: ``PeerTimeoutError`` names the ranks that did not arrive; a peer that
        abandons the current call raises its error here at once."""
        c = self.current
        if c is None:
            self._setup_index += 1
            call, index, what = 0, self._setup_index, "group set-up"
        else:
            c.index += 1
            call, index, what = c.seq, c.index, f"call #{c.seq} ({c.name})"
        return self._exchange.exchange(obj, call=call, index=index, timeout_s=self.timeout_s,
                                       what=what, check=self._check_aborts if c is not None else None)

    def agree(self, signature: object, error: BaseException | None) -> None:
        """Share this rank's (call number, signature, error); raise on every rank if any rank
        failed or the signatures or call numbers differ.  With ``agree="first"`` a signature
        agreed before is trusted without an exchange (the call's identity still reaches the
        peers before any data moves: :meth:`check_in`)."""
        c = self.current
        if c is not None and signature is not None and c.signature is None:
            # the call's own arguments: an agreement nested in it (a heap region the call
            # makes) keeps the call's identity, which check_in compares
            c.set_signature(signature)
        if self._agree_first:
            # Signatures agreed before are trusted: no exchange (a host round trip per
            # collective, which stalls a training loop's run-ahead).  A rank that fails
            # raises alone; the call's abort reaches its peers (see Call).
            if error is not None:
                raise error
            if signature in self._agreed:
                return
        msg = None if error is None else f"{type(error).__name__}: {error}"
        seq = c.seq if c is not None else 0
        # The signature's fingerprint travels, not the signature: a few bytes per call
        # whatever the parameter count (a signature holds every parameter's shape, and
        # pickling W of them, unpickling and comparing them cost ~1 ms per call for 771
        # parameters, and left W x 771 tuples for the garbage collector).
        fp = None if signature is None else fingerprint(signature)
        got = self.exchange((seq, fp, msg))
        if error is not None:
            raise error
        for r, (_, _, m) in enumerate(got):
            if m is not None:
                raise PeerArgumentError(r, m)
        seqs = [q for q, _, _ in got]
        if any(q != seq for q in seqs):
            raise ArgumentMismatchError(f"ranks are at different calls of this group: rank {self.rank} at call "
                                        f"#{seq}, " + ", ".join(f"rank {r} at #{q}" for r, q in enumerate(seqs)
                                                                 if q != seq)
                                        + "; every rank must make the same collective calls in the same order")
        if any(f != fp for _, f, _ in got):
            # Every rank saw the same fingerprints, so every rank takes this second exchange:
            # the signatures themselves, for an error naming the field, the ranks and values.
            sigs = self.exchange(signature)
            check_same([(q, sg, None) for q, sg in zip(seqs, sigs)], self.rank)
            raise ArgumentMismatchError(f"ranks' call signatures differ by fingerprint, yet compare equal: "
                                        f"{describe(signature)} on rank {self.rank}")
        if fp is not None and (k := sig32_of(fp)) not in self._sig_names:
            self._sig_names[k] = describe(signature)
        if self._agree_first and len(self._agreed) < AGREED_KEPT:
            self._agreed.add(signature)

    # ---- aborts and the broken state ----------------------------------------------------
    def _note_failed(self, seq: int) -> None:
        """Call ``seq`` failed on this rank (it enqueued nothing a peer's abort could strand).
        A tuple replaced whole: :meth:`raise_if_abandoned` may read it from another thread."""
        self._failed_calls = (self._failed_calls + (seq,))[-FAILED_KEPT:]

    def mark_broken(self, why: str) -> None:
        """Mark the group broken (the first reason is kept)."""
        if self.broken is None:
            self.broken = why
            log.error("tide_triton group (rank %d of %d) is broken: %s", self.rank, self.world_size, why)

    def _raise_abort(self, r: int, a: Abort) -> None:
        """Raise rank ``r``'s abort ``a`` here.  One that gave up waiting for a third rank
        names that rank, the one missing, as a ``PeerTimeoutError`` -- ``r`` only waited."""
        if a.kind == "argument":
            raise PeerArgumentError(r, a.message)
        if a.gave_up is not None and a.missing != self.rank:
            missing, waited, what, via = a.gave_up
            raise PeerTimeoutError(missing, f"rank {r} gave up waiting for it in call #{a.call}: {what}", waited,
                                   via=(r, *via))
        raise PeerAbortedError(r, a.call, a.message)

    def all_aborted(self, ranks: set[int]) -> bool:
        """Every rank of ``ranks`` published an abort (of any call): none of them signals or
        consumes data of this group any more."""
        return all(r != self.rank and self._exchange.abort_of(r, 0) is not None for r in ranks)

    def _check_aborts(self, ranks: Sequence[int]) -> None:
        """Raise for the first of ``ranks`` that published an abort of this call or later
        (an exchange's wait for ``ranks``: the first is noted as waited for)."""
        c = self.current
        if c is None:
            return
        if ranks:
            c.notes(ranks[0])
        for r in ranks:
            a = self._exchange.abort_of(r, c.seq)
            if a is not None:
                self._raise_abort(r, a)

    def _abandoned_here(self, r: int, since: int) -> Abort | None:
        """The first abort peer ``r`` published of a call in ``since..`` (this rank's latest)
        that did not fail on this rank -- a call whose work this rank enqueued and which waits
        for ``r``.  Every published abort is looked at: an earlier one of a call that failed
        here too (a refusal both ranks raised, the group still usable) hides nothing."""
        failed = self._failed_calls
        return next((a for a in self._exchange.aborts_of(r)
                     if since <= a.call <= self.seq and a.call not in failed), None)

    def raise_if_abandoned(self, since: int) -> None:
        """Raise the error of a peer that published an abort of a call this rank made without
        failing (its work enqueued) since call ``since``: that work waits for the peer, which
        will never come (the poll of :func:`tide_triton.synchronize`, so that the wait ends at
        once, naming the peer, instead of at its deadline).  A call that failed here too was
        reported by its own error and enqueued nothing to wait for."""
        for r in range(self.world_size):
            if r == self.rank:
                continue
            a = self._abandoned_here(r, since)
            if a is not None:
                self._raise_abort(r, a)

    def explain_timeout(self, e: BaseException, since: int) -> Exception | None:
        """For a timeout on a GPU wait: the error of a peer that published an abort of call
        ``since`` or later (its reason, instead of "timed out"), or a peer whose call
        identity differs from this rank's (``ArgumentMismatchError`` naming both calls), or
        None."""
        for seq in range(max(since, 1), self.seq + 1):
            mine = self._keys.get(seq)
            if mine is None:
                continue
            for t in list(self._transports()):
                if not hasattr(t, "wait_all_equal"):
                    continue
                first = getattr(t, "first", 0)
                for i in range(t.local_size):
                    r = first + i
                    if r == self.rank:
                        continue
                    try:
                        got = t.read_flag(self.flags.call(seq % 2, r))
                    except Exception:  # noqa: BLE001 -- diagnosis only
                        continue
                    if got >> 32 == seq and got != mine[0]:
                        self.mark_broken(f"ranks {self.rank} and {r} made different collectives as call #{seq}")
                        sig = got & 0xFFFFFFFF
                        theirs = self._sig_names.get(sig, f"a signature this rank has not seen (hash {sig:#010x})")
                        return ArgumentMismatchError(
                            f"ranks {self.rank} and {r} made different collectives as call #{seq} of this group: "
                            f"rank {self.rank}: {describe(mine[1])}; rank {r}: {theirs}")
        # A timeout that names its peer is explained by that peer's abort only: the others
        # may have aborted because of the same missing rank, and it is the one to blame.
        named = getattr(e, "peer", None)
        if isinstance(e, PeerTimeoutError) and not isinstance(e, PeerLostError) and isinstance(named, int):
            found = _missing_behind(self._exchange, self.rank, named, since, self.current)
            if found is not None:
                missing, steps = found
                via = tuple(r for r, _, _ in steps)
                told = "; ".join(f"rank {r} {'gave up waiting' if gave_up else 'waits'} for rank {n}"
                                 for r, n, gave_up in steps)
                return PeerTimeoutError(missing, f"{e.what} -- from rank {named}; {told}, which is missing",
                                        e.timeout_s, via=via)
        for r in ([named] if isinstance(named, int) else range(self.world_size)):
            if r == self.rank:
                continue
            a = self._abandoned_here(r, since) or self._exchange.abort_of(r, since)
            if a is not None:
                self.mark_broken(f"rank {r} abandoned call #{a.call}: {a.message}")
                return PeerArgumentError(r, a.message) if a.kind == "argument" else \
                    PeerAbortedError(r, a.call, a.message)
        return None

    def _watch_flags(self, t: Any, seq: int, notes: Any = None) -> Any:
        """A poll hook for the host transport's waits: raises once the peer waited for has
        published an abort of this call (its abort flag) -- within one poll, not a timeout;
        ``notes`` (the call's :class:`~tide_triton.group.bootstrap.WaitNotes`) learns whom it waits for."""
        slot = self.flags.abort

        def watch(peer: int) -> None:
            if t.read_flag(slot(peer)) >= seq:
                a = self._exchange.abort_of(peer, seq) or Abort((seq, "failed", "its call failed"))
                self._raise_abort(peer, a)
            if notes is not None:
                notes(peer)
        return watch

    def check_in(self, t: Any, peers: Sequence[int]) -> None:
        """Before any data of the current call moves between this rank and ``peers``
        (ranks of ``t``): tell them this call's identity (call number and signature) and
        check theirs is the same.  A peer in another call raises
        ``ArgumentMismatchError`` naming both calls; a peer that abandoned this call raises
        its error.  On the host the check is done here; on CUDA the copy stream waits for
        exactly the expected identity (a mismatch surfaces as a stuck wait, named by
        :func:`tide_triton.synchronize` or the pacing)."""
        c = self.current
        if c is None:
            raise RuntimeError("internal error: check_in outside a collective call")
        peers = list(peers)
        c.watch(t)
        fm = self.flags
        key = c.key
        slot = fm.call(c.seq % 2, self.rank)
        cuda = getattr(t, "device", None) is not None and t.device.type == "cuda"
        if cuda and not hasattr(t, "wait_all_equal"):
            c.moving = True
            return  # a transport without exact waits: the identity is agreed by the exchange only
        # On the host the check runs on the caller's thread (``host_compute``: ahead of a copy
        # queue that runs behind it, transport.host.COPY_QUEUE = "async"); on CUDA on the copy stream.
        host = None if cuda else getattr(t, "host_compute", None)
        t.signal_all(peers, [slot] * len(peers), [key] * len(peers), stream=host)
        if cuda:
            t.wait_all_equal([fm.call(c.seq % 2, p) for p in peers], [key] * len(peers), peers=peers,
                             timeout_s=self.timeout_s, what=f"rank {{peer}} to enter call #{c.seq} "
                             f"({c.name})")
            c.moving = True
            return
        for p in peers:
            ps = fm.call(c.seq % 2, p)
            t.wait(ps, key & ~0xFFFFFFFF, peer=p, timeout_s=self.timeout_s,
                   what=f"rank {p} to enter call #{c.seq} ({c.name})", stream=host)
            got = t.read_flag(ps)
            if got != key:
                self._mismatch(p, got, c)
        c.moving = True

    def check_in_exchange(self) -> None:
        """:meth:`check_in` through the bootstrap store instead of flag words, for a path whose
        data moves between host-synchronised barriers (the multicast path): every rank's call
        identity, compared before any data moves."""
        c = self.current
        if c is None:
            raise RuntimeError("internal error: check_in_exchange outside a collective call")
        for p, got in enumerate(self.exchange(c.key)):
            if got != c.key:
                self._mismatch(p, got, c)
        c.moving = True

    def check_in_posted(self, peers: Sequence[int]) -> None:
        """:meth:`check_in` for ``peers`` no flag word reaches -- a CUDA cross-node call's rail
        peers, whose only link is the NCCL hop -- through identities posted in the bootstrap
        store, one call late: this call's identity is posted (a store write), and the peers'
        identities of this group's previous such call are read and compared (waiting for
        them, with the deadline, only where a peer has not reached that call yet).  The host
        never waits for a peer's *current* call, so ``agree="first"`` keeps its run-ahead; a
        peer that made another collective raises ``ArgumentMismatchError`` on both ranks at
        the next such call or :func:`tide_triton.synchronize` -- after that call's data
        moved, so the group breaks -- where it would have paired with the other call and
        given wrong sums without an error."""
        c = self.current
        if c is None:
            raise RuntimeError("internal error: check_in_posted outside a collective call")
        self.check_posted()
        self._exchange.post_identity(c.seq, c.key, timeout_s=self.timeout_s)
        self._posted_pending = (c.seq, c.key, tuple(peers))

    def check_posted(self, timeout_s: float | None = None) -> None:
        """Compare the identities peers posted of the last call :meth:`check_in_posted` ran
        in with this rank's (once; no-op when there is none pending), waiting for them at
        most ``timeout_s`` (default: the group's deadline)."""
        pending = self._posted_pending
        if pending is None:
            return
        seq, key, peers = pending

        def aborted(ranks: Sequence[int]) -> None:
            for r in ranks:
                a = self._exchange.abort_of(r, seq)
                if a is not None:
                    self._raise_abort(r, a)

        wait = self.timeout_s if timeout_s is None else timeout_s
        got = self._exchange.identities(peers, seq, timeout_s=wait, check=aborted,
                                        what=f"call #{seq} of this group (posted identities)")
        self._posted_pending = None
        for p, theirs in zip(peers, got):
            if theirs != key:
                mine = self._keys.get(seq)
                sig = theirs & 0xFFFFFFFF
                desc = self._sig_names.get(sig, f"a signature this rank has not seen (hash {sig:#010x})")
                self.mark_broken(f"ranks {self.rank} and {p} made different collectives as call #{seq}")
                raise ArgumentMismatchError(
                    f"ranks {self.rank} and {p} made different collectives as call #{seq} of this group (found at "
                    f"the next call: they are peers across nodes, checked one call late; that call's data moved "
                    f"and the group is broken): rank {self.rank}: "
                    f"{describe(mine[1]) if mine is not None else 'unknown'}; rank {p}: {desc}")

    def _mismatch(self, p: int, got: int, c: "Call") -> None:
        seq, sig = got >> 32, got & 0xFFFFFFFF
        mine = describe(c.signature)
        if seq != c.seq:
            raise ArgumentMismatchError(
                f"rank {p} is at call #{seq} of this group while rank {self.rank} is at call #{c.seq} ({mine}): "
                f"rank {p} did not make this call; every rank must make the same collective calls in the "
                "same order")
        theirs = self._sig_names.get(sig, f"a signature this rank has not seen (hash {sig:#010x})")
        raise ArgumentMismatchError(
            f"ranks {self.rank} and {p} made different collectives as call #{c.seq} of this group: rank "
            f"{self.rank}: {mine}; rank {p}: {theirs}")

    def _publish_abort(self, seq: int, kind: str, message: str, gave_up: tuple | None = None) -> None:
        """Tell the peers this rank abandoned call ``seq`` (``gave_up``: whom it gave up
        waiting for, :attr:`~tide_triton.group.bootstrap.Abort.gave_up`): in the bootstrap store
        (peers in an exchange, and any that look up why) and in every peer's abort flag of
        every transport this group has (the host transport's waits watch it)."""
        self._exchange.publish_abort(seq, kind, message, gave_up)
        for t in list(self._transports()):
            if getattr(t, "device", None) is None or t.device.type != "cpu":
                continue  # CUDA: a stream write would queue behind the stuck waits; the store tells
            try:
                peers = [r for r in range(t.local_size) if r != t.rank]
                t.signal_all(peers, [self.flags.abort(self.rank)] * len(peers), [seq] * len(peers),
                             stream=getattr(t, "host_compute", None))
            except Exception:  # noqa: BLE001 -- best effort on the way out of an error
                pass


def _missing_behind(ex: Exchange, me: int, peer: int, since: int,
                    c: "Call | None") -> tuple[int, list[tuple[int, int, bool]]] | None:
    """The rank missing behind ``peer``, which this rank timed out waiting for: follow
    whom ``peer`` waits for (its noted wait, renewed while it lasts, or the rank its
    published abort of call ``since`` or later gave up on), and whom that rank waits
    for, to a rank that waits for nobody.  Returns ``(that rank, [(rank, waits for,
    gave up)...])``, or None where ``peer`` waits for nobody (it is the one missing), or
    the chain comes back to this rank (``me``) or goes round (ranks waiting on each other: no
    rank is missing, the calls differ).  Reads the store only on this error path; a note
    is taken as a wait going on once it is seen renewed (within :data:`FOLLOW_S`; the notes of
    ``c``, this rank's call, renewed meanwhile)."""
    first: dict[int, int] = {}  # the count of each rank's note when first read

    def walk(judge: bool) -> tuple[list, int, bool] | None:
        steps: list[tuple[int, int, bool]] = []
        seen, r = {me}, peer
        while True:
            if r in seen:
                return None  # back to this rank, or round in a circle
            seen.add(r)
            a = ex.abort_of(r, since)
            if a is not None:
                if a.missing is None:
                    return steps, r, False  # it gave up for its own reason
                steps.append((r, a.missing, True))
                r = a.missing
                continue
            w = ex.wait_of(r)
            if w is None:
                return steps, r, False
            if judge and first.setdefault(r, w.count) == w.count:
                return steps, r, True  # a note not seen renewed (yet): the wait may be over
            first.setdefault(r, w.count)
            steps.append((r, w.peer, False))
            r = w.peer

    try:
        got = walk(False)
        if got is not None and any(not gave_up for _, _, gave_up in got[0]):  # notes to see renewed
            deadline = time.monotonic() + FOLLOW_S
            while True:
                if c is not None and c.notes is not None:
                    c.notes.renew()
                time.sleep(NOTE_EVERY_S / 2)
                got = walk(True)
                if got is None or not got[2] or time.monotonic() >= deadline:
                    break
    except Exception:  # noqa: BLE001 -- a diagnosis: the timeout as it was
        return None
    if got is None or not got[0]:
        return None
    return got[1], got[0]


class Call:
    """One collective call on a group (see :meth:`Group.call`): ``with`` it, numbered by its
    group's :class:`CallIdentity`."""

    def __init__(self, identity: CallIdentity, name: str) -> None:
        self.identity = identity
        self.name = name
        self.seq = 0
        self.index = 0
        self.signature: object = None
        self.key = 0
        self.moving = False
        """Data of this call may have moved (or peers may be past its start): an error from
        here on leaves the group broken."""
        self._watched: list[Any] = []
        self.notes: Any = None
        """Whom this call waits for, noted once a wait is long (``WaitNotes``)."""
        self._stall: stall_watch.section | None = None
        self._refusal: BaseException | None = None

    def set_signature(self, signature: object) -> None:
        self.signature = signature
        self.key = (self.seq << 32) | sig32(signature)
        keys = self.identity._keys
        keys[self.seq] = (self.key, signature)  # described only for an error message
        keys.pop(self.seq - 64, None)

    def refuse(self, e: BaseException) -> NoReturn:
        """Raise ``e``: this rank refuses the call before anything moved (e.g. it is being
        captured into a CUDA graph).  Like an argument error it takes the call's number and is
        published to the peers, who raise ``PeerArgumentError`` naming this rank in the same
        call; the group stays usable.  Refusing *before* taking a number would shift this
        rank's calls against the peers' when they made the call: each later call paired with
        a neighbour."""
        self._refusal = e
        raise e

    def watch(self, t: Any) -> None:
        """Let ``t``'s host-side waits see the peers' aborts of this call."""
        if hasattr(t, "watch") and t.watch is None:
            t.watch = self.identity._watch_flags(t, self.seq, self.notes)
            self._watched.append(t)

    def __enter__(self) -> "Call":
        ids = self.identity
        if not ids._lock.acquire(blocking=False):
            raise RuntimeError(
                f"this tide_triton group (rank {ids.rank}) is already in a collective call from another thread; "
                "a group runs one collective at a time: serialise the calls, or make one group per thread "
                "(tide_triton.init(pg) for another process group)")
        ids.seq += 1
        self.seq = ids.seq
        if ids.broken is not None:
            why = ids.broken
            ids._note_failed(self.seq)
            try:
                ids._publish_abort(self.seq, "broken", f"its group is broken: {why}")
            finally:
                ids._lock.release()
            raise GroupBrokenError(
                f"this tide_triton group (rank {ids.rank}) is broken and refuses call #{self.seq} ({self.name}): "
                f"{why}.  Its staging and flags can no longer be trusted; close it (group.close()) and "
                "create a new one (tide_triton.init)")
        self.notes = ids._exchange.wait_notes(self.seq)
        ids.current = self
        # a thread stuck inside a driver call never reaches its deadline checks: reported
        self._stall = stall_watch.section(ids.rank, f"{self.name} (call #{self.seq})", ids.timeout_s)
        self._stall.__enter__()
        return self

    def __exit__(self, et: Any, e: BaseException | None, tb: Any) -> None:
        ids = self.identity
        better = None
        try:
            for t in self._watched:
                t.watch = None
            if e is not None and isinstance(e, Exception):
                if isinstance(e, TimeoutError):  # a stuck wait: did the peer abandon this call?
                    better = ids.explain_timeout(e, self.seq)
                self._failed(better or e)
            elif e is not None:  # KeyboardInterrupt, SystemExit: the call stops mid-way all the same
                try:
                    self._failed(e)
                except Exception:  # noqa: BLE001 - the interrupt is what propagates
                    log.exception("rank %d: publishing the abort of an interrupted call failed", ids.rank)
        finally:
            if self.notes is not None:
                self.notes.clear()  # after the abort: a peer reading this rank sees one of them
            ids.current = None
            ids._lock.release()
            if self._stall is not None:
                self._stall.__exit__()
        if better is not None:
            raise better from e

    def _failed(self, e: BaseException) -> None:
        """Publish the abort (peers waiting on this call raise at once instead of timing
        out) and, unless nothing can have moved, mark the group broken."""
        ids = self.identity
        ids._note_failed(self.seq)
        argument = (isinstance(e, (TypeError, ValueError)) or e is self._refusal) and not self.moving
        gave_up = (e.peer, e.timeout_s, e.what, e.via) if isinstance(e, PeerTimeoutError) and \
            isinstance(e.peer, int) else None
        ids._publish_abort(self.seq, "argument" if argument else "failed", f"{type(e).__name__}: {e}", gave_up)
        if not argument:
            ids.mark_broken(f"call #{self.seq} ({self.name}) failed on rank {ids.rank}: {type(e).__name__}: {e}")
