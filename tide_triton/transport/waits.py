"""The flag waits pending on one rank's streams, host waits with deadlines, and stuck reports.

Stream-side waits cannot time out; :meth:`WaitLedger.synchronize` and
:meth:`WaitLedger.host_wait_event` wait from the host with a deadline and raise
:class:`~tide_triton.errors.PeerTimeoutError` naming the peer of a pending wait whose flag is
still short -- of the waits that have not passed, the earliest of the stuck stream: each wait
batch ends with a write of its sequence number into a progress word of its stream, which tells
a passed wait from a stuck one (:mod:`tide_triton.transport.progress`; a token word its reader
reset reads short either way).  The ledger keeps one pending wait per flag slot (and the ones a
later wait with another progress word replaced); a run being recorded into a graph notes its
waits into the recording instead, and each replay notes them again.  A close whose streams do
not drain releases this rank's own stuck waits (:meth:`WaitLedger.release_own_waits`).
"""
from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from contextlib import contextmanager
from typing import Any, Callable, Iterator, NamedTuple, Sequence

from ..errors import PeerTimeoutError
from ..runtime.profiling import host_range, in_host_range
from ._once import log_once
from .driver import CtxGuard, CudaError, check
from .streams import NOT_READY, RankStreams

log = logging.getLogger("tide_triton")

POLL_S = 0.05
"""How often a host wait on a stream runs its ``poll`` (a look for peers' published aborts)."""
SUPERSEDED_KEPT = 1024
"""Pending waits kept after a later wait on the same slot with another progress word replaced
them in the ledger (:meth:`WaitLedger._note_pending`), the most recent."""
RECORDING_WORDS = 4
"""Progress words a recording can take during its capture (its streams: the recording stream
and the copy stream; more get none), set aside before the capture begins."""

Pending = tuple[int, int, int, str, int, int]
"""A pending wait: ``(value, peer, stream, what, progress word, seq)`` -- the wait has passed iff
the word reads >= seq (word 0: unknown; see the progress module); ``peer`` is a global rank."""


class _Track:
    """The progress word of one stream -- or of one stream of a recording -- and the sequence
    number of the last wait batch enqueued there (:mod:`tide_triton.transport.progress`).
    ``reset``: the word was not written to 0 at the recording's start (a stream that joined it
    later): its first batch writes 0 first.  ``word`` 0: none (those waits keep the old rule)."""

    __slots__ = ("word", "seq", "reset")

    def __init__(self, word: int, reset: bool = False) -> None:
        self.word, self.seq, self.reset = word, 0, reset


class Stuck(NamedTuple):
    """A pending wait that has not passed and whose flag is short (:meth:`WaitLedger._short_waits`)."""

    slot: int
    value: int
    peer: int
    """The global rank that was to write the flag."""
    stream: int
    tier: int
    """0: in the batch its stream is at (the one after the last that passed: what the stream is
    blocked on, or reaches next); 1: no progress word tells (waits enqueued under a user's
    capture); 2: further on -- behind that batch, whose own entries may have been replaced by
    later waits on their slots (the ledger keeps one wait per slot and progress word)."""
    what: str = ""
    """What the wait was for, as its collective said (empty: the flag and value are named)."""


class WaitLedger:
    """The pending flag waits of one rank (see the module notes).  ``own_flags``: the address
    of this rank's flag 0; ``rank_offset`` is added to rank numbers in timeouts (a node-local
    transport of a several-node group names global ranks)."""

    def __init__(self, cu: Any, guard: CtxGuard, streams: RankStreams, *, rank: int, own_flags: int) -> None:
        self._cu = cu
        self._guard = guard
        self._streams = streams
        self.rank = rank
        self.own_flags = own_flags
        self.rank_offset = 0
        self.WRITE = int(cu.CUstreamWriteValue_flags.CU_STREAM_WRITE_VALUE_DEFAULT)
        self._pending: dict[int, Pending] = {}  # slot -> its pending wait
        self._waits_into: dict[int, Pending] | None = None  # see recording_waits
        self._tracks: dict[int, _Track] = {}  # stream handle -> its progress word (eager batches)
        # (slot, progress word) -> a pending wait a later one on its slot replaced (_note_pending)
        self._superseded: OrderedDict[tuple[int, int], Pending] = OrderedDict()
        self._rec_tracks: dict[int, _Track] | None = None  # the same for a recording's streams
        self._equal: set[int] = set()  # pending slots waited for with EQ (call identities)
        self._tls = threading.local()

    # ---- noting waits -----------------------------------------------------------------------
    def track(self, s: int) -> _Track | None:
        """Stream ``s``'s progress word for the batch being enqueued: a recording's own
        (:meth:`recording_waits`), none while this thread's last capture query said its
        stream is captured (:meth:`stream_capturing`: a user's graph), else the stream's
        eager word, taken at its first batch."""
        rec = self._rec_tracks
        progress = self._streams.progress
        if rec is not None:
            track = rec.get(s)
            if track is None:  # a stream that joined the recording later: from the reserve
                track = rec[s] = _Track(progress.take(grow=False), reset=True)
            return track if track.word else None
        if getattr(self._tls, "user_capture", False):
            return None
        track = self._tracks.get(s)
        if track is None:
            try:
                word = progress.take(grow=True)
            except CudaError as exc:  # the waits go without one (the old rule), never fail
                log_once("progress-words", logging.WARNING,
                         "rank %d: no progress word for a stream (%s): its timeouts may name a peer "
                         "whose token wait passed", self.rank, exc)
                word = 0
            track = self._tracks[s] = _Track(word)
        return track if track.word else None

    def note_batch(self, s: int, slots: Sequence[int], values: Sequence[int], peers: Sequence[int],
                   whats: Sequence[str], word: int, seq: int, equal: bool) -> None:
        """A wait batch was enqueued on stream ``s`` (``peers``: node-local ranks): its waits
        become pending -- or the recording's."""
        pending = self._pending if self._waits_into is None else self._waits_into
        note = self._note_pending if pending is self._pending else pending.__setitem__
        off = self.rank_offset
        eq = self._equal
        for sl, v, p, w in zip(slots, values, peers, whats):
            note(sl, (v, p + off, s, w, word, seq))
            (eq.add if equal else eq.discard)(sl)

    def _note_pending(self, slot: int, entry: Pending) -> None:
        """``entry`` becomes slot ``slot``'s pending wait.  The wait it replaces is kept aside
        (``_superseded``) when it has a progress word other than the new one's: a
        replay of another recording noted behind a stuck run (FSDP2's backward enqueues the
        next layer's replay without waiting), whose own word still reads its last replay's
        count until its first node runs -- without it the stuck run's wait would leave the
        ledger and a timeout name nobody."""
        old = self._pending.get(slot)
        if old is not None and old[4] and old[4] != entry[4]:
            kept = self._superseded
            kept[(slot, old[4])] = old
            kept.move_to_end((slot, old[4]))
            while len(kept) > SUPERSEDED_KEPT:
                kept.popitem(last=False)
        self._pending[slot] = entry

    @contextmanager
    def recording_waits(self) -> Iterator[dict[int, Pending]]:
        """While a run is recorded into a graph (nothing runs), its waits go into the dict
        yielded instead of the pending waits -- :meth:`note_waits` notes them at each replay
        -- with progress words of the recording's own, one per stream
        (:data:`RECORDING_WORDS` set aside now, before the capture:
        :meth:`recording_tracks` and the waits take them)."""
        if self._waits_into is not None:
            raise RuntimeError("internal error: this transport records waits already")
        try:
            self._streams.progress.reserve(RECORDING_WORDS)
        except CudaError as exc:  # the recording's waits go without (the old rule)
            log_once("progress-words", logging.WARNING,
                     "rank %d: no progress words for a recording (%s): its timeouts may name a peer "
                     "whose token wait passed", self.rank, exc)
        self._waits_into = into = {}
        self._rec_tracks = {}
        try:
            yield into
        finally:
            self._waits_into = None
            self._rec_tracks = None

    def recording_tracks(self, stream: Any) -> tuple[int, list[int]]:
        """At a recording's start on ``stream``: the progress words of its streams -- ``stream``
        and the copy stream, which joins the capture through a fence from ``stream`` -- taken
        now; returns the stream's handle and the words the graph's first node writes to 0."""
        rec = self._rec_tracks
        if rec is None:
            raise RuntimeError("internal error: recording_started outside recording_waits")
        s = self._streams.stream_int(stream)
        words = []
        for h in (s, self._streams.copy_stream_int):
            if h not in rec:
                rec[h] = _Track(self._streams.progress.take(grow=False))
                if rec[h].word:
                    words.append(rec[h].word)
        return s, words

    def note_waits(self, waits: dict[int, Pending], stream: Any) -> None:
        """A replayed graph's waits (:meth:`recording_waits`), pending on ``stream`` (with the
        recording's progress words: the graph wrote them to 0 first)."""
        s = self._streams.stream_int(stream)
        note = self._note_pending
        for slot, (value, peer, _s, what, word, seq) in waits.items():
            note(slot, (value, peer, s, what, word, seq))

    def stream_capturing(self, stream: Any) -> bool:
        """Whether ``stream`` is being captured into a CUDA graph (one driver call) -- a
        prepared run asks before each run, and the only waits a capture can hold are a
        prepared run's.  The answer is kept for this thread: while it is True, wait batches
        get no progress word (the user's graph would write its fixed sequence numbers into an
        eager stream's word at every replay); the next run's query ends it."""
        with self._guard:
            err, status = self._cu.cuStreamIsCapturing(self._streams.stream_int(stream))
        check((err,), f"cuStreamIsCapturing(rank={self.rank})")
        captured = status != self._cu.CUstreamCaptureStatus.CU_STREAM_CAPTURE_STATUS_NONE
        self._tls.user_capture = captured
        return captured

    def user_capture_ended(self) -> None:
        """This thread's prepared run inside a user's capture is enqueued whole: its next
        waits (outside a capture -- an eager collective refuses one -- or in another run,
        which asks again) get progress words again, rather than at this thread's next
        prepared run's query (eager timeouts in between would name peers by the old rule)."""
        self._tls.user_capture = False

    # ---- host waits -------------------------------------------------------------------------
    def read_flag(self, slot: int) -> int:
        """This rank's flag ``slot``, read from the host (unchecked: the ledger's own slots)."""
        return self._streams.read_words(self.own_flags + 8 * slot, 1)[0]

    def host_wait_event(self, event: Any, *, timeout_s: float) -> None:
        """Block the host until ``event`` completed (the pacer's wait); past ``timeout_s``,
        :meth:`raise_stuck`."""
        if event.query():
            return
        deadline = time.monotonic() + timeout_s
        nap = 5e-6
        with host_range("tide_triton::pace"):  # the pacer's wait (group.parts.Pacer), its only use
            while not event.query():
                if time.monotonic() >= deadline:
                    self.raise_stuck(timeout_s, None)
                time.sleep(nap)
                nap = min(nap * 2, 1e-3)

    @in_host_range("tide_triton::synchronize")
    def synchronize(self, *, timeout_s: float, stream: Any = None,
                    poll: Callable[[], None] | None = None) -> None:
        """Block until stream ``s`` (default: the copy stream) is idle; ``poll`` runs every
        :data:`POLL_S` while it is not (it may raise: a peer that gave up)."""
        s = self._streams.stream_int(stream)
        start = time.monotonic()
        deadline, next_poll = start + timeout_s, start + POLL_S
        nap = 20e-6
        while True:
            res = self._cu.cuStreamQuery(s)
            code = int(res[0])
            if code == 0:
                self._pending = {k: v for k, v in self._pending.items() if v[2] != s}
                kept = self._superseded
                for k in [k for k, v in kept.items() if v[2] == s]:
                    del kept[k]
                return
            if code != NOT_READY:
                check(res, f"cuStreamQuery(rank={self.rank})")
            now = time.monotonic()
            if now >= deadline:
                break
            if poll is not None and now >= next_poll:
                poll()
                next_poll = now + POLL_S
            time.sleep(nap)
            nap = min(nap * 2, 2e-3)
        self.raise_stuck(timeout_s, s)

    # ---- stuck reports ----------------------------------------------------------------------
    def raise_stuck(self, timeout_s: float, s: int | None) -> None:
        """Raise ``PeerTimeoutError`` for a pending wait that has not passed and whose flag is
        still short, else ``TimeoutError``.  Which one (:meth:`_short_waits`): a wait of the
        batch stream ``s`` is at -- what it is blocked on -- then of the batch another stream is
        at (a stream can be stuck behind another's wait: the copy queue fenced behind a replay
        on the caller's stream), then waits without a progress word (the old rule: a short
        token word may be a finished wait's, reset by its reader), then waits further on; on
        stream ``s`` first, counters before tokens and the lowest slot within each.  A finished
        token wait whose reader reset its word is never named: its progress word says it
        passed."""
        short = self._short_waits()
        if short:
            eq = self._equal
            w = min(short, key=lambda w: (w.tier == 2, w.stream != s, w.tier, w.slot in eq, w.slot))
            raise PeerTimeoutError(
                w.peer, w.what or f"flag {w.slot} of rank {self.rank + self.rank_offset} to reach "
                f"{w.value}, last read {self.read_flag(w.slot)}", timeout_s)
        raise TimeoutError(f"rank {self.rank + self.rank_offset}: GPU work still busy after {timeout_s:.1f} s "
                           "(no pending flag wait is short)")

    def _short_waits(self) -> list[Stuck]:
        """The pending waits that have not passed and whose flag is still short of their
        value.  Passed: on a stream that is idle, or -- read from its progress word, before
        its flag -- in a batch whose sequence number the word has reached (a token word is
        reset by its reader once its wait passed: it reads short, but the wait is done).  Each
        wait's :attr:`Stuck.tier` says whether its batch is the one its stream is at.  Reads
        words from the host (error paths only)."""
        idle: dict[int, bool] = {}
        progress: dict[int, int] = {}  # word -> what it reads
        out = []
        eq = self._equal
        waits = sorted(self._pending.items()) + [(k[0], v) for k, v in self._superseded.items()]
        for slot, (value, peer, sh, what, word, seq) in waits:
            if sh not in idle:
                with self._guard:
                    idle[sh] = int(self._cu.cuStreamQuery(sh)[0]) != NOT_READY
            if idle[sh]:
                continue
            tier = 1
            if word:
                done = progress.get(word)
                if done is None:
                    done = progress[word] = self._streams.read_words(word, 1)[0]
                if done >= seq:
                    continue
                tier = 0 if seq == done + 1 else 2
            cur = self.read_flag(slot)
            if (cur != value) if slot in eq else (cur < value):
                out.append(Stuck(slot, value, peer, sh, tier, what))
        return out

    def stuck_peers(self) -> set[int]:
        """Global ranks that pending stream waits of this rank still wait for."""
        return {w.peer for w in self._short_waits()}

    def release_own_waits(self, deadline: float) -> int:
        """Last resort of a close whose streams did not drain (a peer that will never signal:
        a broken group's): write into this rank's own flag words the value each pending
        stream wait that has not passed expects -- never lowering a counter, never a wait that
        passed (its token word was reset by its reader: writing the token again would leave
        it there) -- so the stuck streams run to their end.  Without it they wait forever, the
        heap cannot be unmapped, and every later device-wide synchronize of the process
        (``torch.cuda.synchronize``) hangs.  What the released work then computes was already
        reported as an error; its copies land in mappings this rank still holds (unmapped only
        after the streams are idle).  An earlier wait on a word for another value than its
        latest (two calls' identities on one parity word) cannot be released: the close then
        leaks.  Returns the words written."""
        # one value per word: a slot short for two waits (a replay noted behind a stuck run)
        # gets the one of the batch its stream is at -- a later write would hide it from an
        # exact-value wait
        chosen: dict[int, Stuck] = {}
        for w in self._short_waits():
            if w.slot not in chosen or w.tier < chosen[w.slot].tier:
                chosen[w.slot] = w
        writes = [(w.slot, w.value) for w in chosen.values()]
        if not writes:
            return 0
        cu, streams = self._cu, self._streams
        with self._guard:
            for slot, value in writes:
                check(cu.cuStreamWriteValue64(streams.host_stream, self.own_flags + 8 * slot, value,
                                              self.WRITE), f"cuStreamWriteValue64(rank={self.rank}, release {slot})")
        if not streams.drain({streams.host_stream_int}, deadline):
            log.error("rank %d: releasing its own stuck flag waits did not complete", self.rank)
        return len(writes)

    def release_at_close(self, may_release: Callable[[set[int]], bool], drain: Callable[[float], bool],
                         drain_s: float) -> bool:
        """Streams still busy at close: if ``may_release`` (a broken group's close) returns True
        for the peers of the short waits (global ranks) -- they abandoned their calls and will
        neither signal nor consume any more -- release this rank's own pending flag waits
        (:meth:`release_own_waits`: else the streams, and every later device-wide synchronize of
        the process, wait forever) and ``drain`` again, for ``drain_s`` at most.  Never for a
        peer that may only be slow: the released work would push into its slots before it has
        read them.  True when the streams are idle then (the heap can be unmapped)."""
        deadline = time.monotonic() + drain_s
        try:
            peers = self.stuck_peers()
            if not peers or not may_release(peers):
                log.error("rank %d: streams stuck on flag waits for ranks %s, which have not all abandoned "
                          "their calls: not released", self.rank, sorted(peers))
                return False
            n = self.release_own_waits(deadline)
        except Exception as e:  # noqa: BLE001 - close never raises for this; it leaks instead
            log.error("rank %d: could not release its stuck flag waits at close: %s", self.rank, e)
            return False
        if n == 0:
            return False
        idle = drain(max(0.0, deadline - time.monotonic()))
        log.warning("rank %d: released %d stuck flag wait(s) at close; streams %s", self.rank, n,
                    "idle" if idle else "still busy")
        return idle

    def close(self) -> None:
        """Forget the streams' progress words (freed with the streams)."""
        self._tracks.clear()
