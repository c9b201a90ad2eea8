"""Flags of the CUDA transport: SM-free signals and stream waits (stream memory operations).

``signal`` writes a flag of a peer with ``cuStreamWriteValue64`` -- straight to the peer's
mapped address where a probe at creation shows that works (also across devices), otherwise
into a local scratch word followed by an 8-byte copy-engine copy (NCCL's CE-collective
recipe).  ``wait`` is ``cuStreamWaitValue64(GEQ)`` on the local flag (``EQ`` for call
identities).  Several of either go in one ``cuStreamBatchMemOp`` where the driver accepts it;
each wait batch ends with a write into its stream's progress word and is noted in the wait
ledger (:mod:`~tide_triton.transport.waits`).  Neither uses an SM.

Layout of the words this module uses (:class:`HiddenWords`): below heap offset 0 of every
rank, ``local_size`` probe words then ``local_size * n_flags`` scratch words; the flags are the
first ``n_flags`` words at offset 0.
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Sequence

from ..runtime.checks import is_int
from ..errors import PeerTimeoutError
from ..runtime.profiling import in_host_range
from ._once import log_once, round_up
from .driver import CtxGuard, CudaError, check
from .streams import RankStreams
from .waits import WaitLedger

SIGNAL_MODES = ("auto", "direct", "copy")

PROBE_MAGIC = 0x7469_6465_0000_0000  # "tide" in the high half, the writer's rank below
_DATA_ALIGN = 4096
_MEMOPS_PER_CALL = 255
MEMOP_BATCH = True
"""Diagnostics: False makes flag waits and signals one driver call each instead of one
``cuStreamBatchMemOp``.  Read when a transport chooses its memop path."""


@dataclass(frozen=True)
class HiddenWords:
    """Byte offsets, from the start of a rank's mapping, of the transport's own words."""

    probe_off: int
    scratch_off: int
    user_off: int
    """Where heap offset 0 (flag 0) starts."""

    @classmethod
    def of(cls, local_size: int, n_flags: int) -> "HiddenWords":
        scratch = 8 * local_size
        return cls(0, scratch, round_up(scratch + 8 * local_size * n_flags, _DATA_ALIGN))


def _check_value(value: Any, name: str = "value") -> None:
    if not is_int(value) or not 0 <= value < 1 << 63:
        raise ValueError(f"{name} must be an int in [0, 2**63), got {value!r}")


class Flags:
    """The signals and flag waits of one rank (see the module notes).

    ``bases[r]`` is the address, in this process, of rank ``r``'s mapping (set by the owner
    once the peers' ranges are known); ``own_va`` is this rank's own."""

    def __init__(self, cu: Any, guard: CtxGuard, streams: RankStreams, waits: WaitLedger, *, rank: int,
                 local_size: int, n_flags: int, own_va: int, words: HiddenWords) -> None:
        self._cu = cu
        self._guard = guard
        self._streams = streams
        self._waits = waits
        self.rank = rank
        self.local_size = local_size
        self.n_flags = n_flags
        self.own_va = own_va
        self.words = words
        self.bases: list[int] = []
        self.signal_path = "direct"
        self.memop_batch = False
        self._tls = threading.local()
        self.WRITE = int(cu.CUstreamWriteValue_flags.CU_STREAM_WRITE_VALUE_DEFAULT)
        self.GEQ = int(cu.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_GEQ)
        self.EQ = int(cu.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_EQ)
        self._WAIT_OP = cu.CUstreamBatchMemOpType.CU_STREAM_MEM_OP_WAIT_VALUE_64
        self._WRITE_OP = cu.CUstreamBatchMemOpType.CU_STREAM_MEM_OP_WRITE_VALUE_64

    # ---- checks -----------------------------------------------------------------------------
    def check_rank(self, name: str, rank: Any) -> None:
        if not is_int(rank) or not 0 <= rank < self.local_size:
            raise ValueError(f"{name} must be an int in [0, {self.local_size}), got {rank!r}")

    def check_slot(self, slot: Any) -> None:
        if not is_int(slot) or not 0 <= slot < self.n_flags:
            raise ValueError(f"slot must be an int in [0, {self.n_flags}), got {slot!r}")

    def flag_addr(self, rank: int, slot: int) -> int:
        return self.bases[rank] + self.words.user_off + 8 * slot

    # ---- path probes ------------------------------------------------------------------------
    def probe_write(self, peers: Sequence[int]) -> str | None:
        """First half of the signal-path probe: write this rank's probe word into every
        peer's mapping with a stream write; returns the error, if any."""
        cu = self._cu
        host = self._streams.host_stream
        try:
            with self._guard:
                own_probe = self.own_va + self.words.probe_off + 8 * self.rank
                check(cu.cuStreamWaitValue64(host, own_probe, 0, self.GEQ),
                      "cuStreamWaitValue64(probe)")
                for p in peers:
                    check(cu.cuStreamWriteValue64(host, self.bases[p] + self.words.probe_off + 8 * self.rank,
                                                  PROBE_MAGIC + self.rank, self.WRITE),
                          f"cuStreamWriteValue64(rank={self.rank} -> peer={p})")
                check(cu.cuStreamSynchronize(host), "cuStreamSynchronize(probe)")
        except CudaError as exc:
            return str(exc)
        return None

    def probe_read(self, peers: Sequence[int], err: str | None) -> tuple[bool, str]:
        """Second half, once every peer's writes are done: ``(ok, why not)``."""
        words = self._streams.read_words(self.own_va + self.words.probe_off, self.local_size)
        wrong = [p for p in peers if words[p] != PROBE_MAGIC + p]
        why = err or (f"probe words from rank(s) {wrong} did not arrive" if wrong else "")
        return err is None and not wrong, why

    def choose_memop_path(self) -> None:
        """Probe ``cuStreamBatchMemOp`` (a wait that is already satisfied and a write, on
        this rank's own scratch word); fall back to one call per flag if refused."""
        cu = self._cu
        self.memop_batch = False
        if not hasattr(cu, "cuStreamBatchMemOp") or not MEMOP_BATCH:
            return
        word = self.own_va + self.words.scratch_off
        try:
            self._memops(self._streams.host_stream_int, [(self._WRITE_OP, word, 7, self.WRITE),
                                                         (self._WAIT_OP, word, 7, self.GEQ),
                                                         (self._WRITE_OP, word, 0, self.WRITE)], "probe")
            with self._guard:
                check(cu.cuStreamSynchronize(self._streams.host_stream), "cuStreamSynchronize(memop probe)")
            self.memop_batch = True
        except CudaError as exc:
            log_once("memop-loop", logging.INFO,
                     "flag waits and signals use one call each (cuStreamBatchMemOp: %s)", exc)

    def zero_words(self, nbytes: int) -> None:
        """Zero the first ``nbytes`` of the own mapping (probe, scratch and flag words)."""
        cu = self._cu
        host = self._streams.host_stream
        with self._guard:
            check(cu.cuMemsetD8Async(self.own_va, 0, nbytes, host), "cuMemsetD8Async(flags)")
            check(cu.cuStreamSynchronize(host), "cuStreamSynchronize")

    # ---- signals ----------------------------------------------------------------------------
    def signal(self, rank: int, slot: int, value: int, *, stream: Any = None) -> None:
        self.check_rank("rank", rank)
        self.check_slot(slot)
        _check_value(value)
        s = self._streams.stream_int(stream)
        cu = self._cu
        addr = self.flag_addr(rank, slot)
        with self._guard:
            if rank == self.rank or self.signal_path == "direct":
                check(cu.cuStreamWriteValue64(s, addr, value, self.WRITE),
                      f"cuStreamWriteValue64(rank={self.rank} -> {rank}, slot={slot})")
                return
            scratch = self.own_va + self.words.scratch_off + 8 * (rank * self.n_flags + slot)
            check(cu.cuStreamWriteValue64(s, scratch, value, self.WRITE),
                  f"cuStreamWriteValue64(rank={self.rank}, scratch for {rank}/{slot})")
            check(cu.cuMemcpyAsync(addr, scratch, 8, s),
                  f"cuMemcpyAsync(rank={self.rank} -> {rank}, flag {slot})")

    def signal_all(self, ranks: Sequence[int], slots: Sequence[int], values: Sequence[int], *,
                   stream: Any = None) -> None:
        n = len(ranks)
        if len(slots) != n or len(values) != n:
            raise ValueError(f"ranks, slots and values must have one entry per signal, got "
                             f"{n}, {len(slots)} and {len(values)}")
        if n == 0:
            return
        if n == 1 or not self.memop_batch or self.signal_path != "direct":
            for r, sl, v in zip(ranks, slots, values):
                self.signal(r, sl, v, stream=stream)
            return
        for r, sl, v in zip(ranks, slots, values):
            self.check_rank("rank", r)
            self.check_slot(sl)
            _check_value(v)
        s = self._streams.stream_int(stream)
        self._memops(s, [(self._WRITE_OP, self.flag_addr(r, sl), v, self.WRITE)
                         for r, sl, v in zip(ranks, slots, values)], "write")

    # ---- stream waits -----------------------------------------------------------------------
    def wait(self, slot: int, value: int, *, peer: int, timeout_s: float, stream: Any = None,
             what: str = "", equal: bool = False) -> None:
        self.check_slot(slot)
        self.check_rank("peer", peer)
        _check_value(value)
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self._enqueue_waits(self._streams.stream_int(stream), (slot,), (value,), (peer,), (what,), equal)

    def wait_all(self, slots: Sequence[int], values: Sequence[int], *, peers: Sequence[int],
                 timeout_s: float, stream: Any = None, what: str = "", equal: bool = False) -> None:
        """Waits until each flag is >= its value (``equal``: exactly its value -- a call
        identity, which a later call's must not satisfy): one wait batch (see
        :meth:`_enqueue_waits`)."""
        n = len(slots)
        if len(values) != n or len(peers) != n:
            raise ValueError(f"slots, values and peers must have one entry per wait, got "
                             f"{n}, {len(values)} and {len(peers)}")
        if n == 0:
            return
        for sl, p in zip(slots, peers):
            self.check_slot(sl)
            self.check_rank("peer", p)
        if n == 1 or not self.memop_batch:  # the checks of wait(), as when this path called it
            for v in values:
                _check_value(v)
            if not timeout_s > 0:
                raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        off = self._waits.rank_offset
        self._enqueue_waits(self._streams.stream_int(stream), slots, values, peers,
                            [what.format(peer=p + off) for p in peers], equal)

    def _enqueue_waits(self, s: int, slots: Sequence[int], values: Sequence[int], peers: Sequence[int],
                       whats: Sequence[str], equal: bool) -> None:
        """One wait batch on stream ``s``: its waits, then the write of its sequence number
        into the stream's progress word (:meth:`WaitLedger.track`; none under a user's
        capture) -- one ``cuStreamBatchMemOp`` where batches work (a lone wait without a word:
        one ``cuStreamWaitValue64``), else one call per wait plus one ``cuStreamWriteValue64``
        -- and their pending entries (or the recording's)."""
        mode = self.EQ if equal else self.GEQ
        own = self.rank
        ops = [(self._WAIT_OP, self.flag_addr(own, sl), v, mode) for sl, v in zip(slots, values)]
        track = self._waits.track(s)
        word = seq = 0
        writes: list[tuple[Any, int, int, int]] = []  # the progress word's: (0 first,) seq after
        if track is not None:
            word = track.word
            if track.reset:  # a recording's stream that joined after its start: 0 first
                writes.append((self._WRITE_OP, word, 0, self.WRITE))
                track.reset = False
            track.seq = seq = track.seq + 1
            writes.append((self._WRITE_OP, word, seq, self.WRITE))
        if self.memop_batch and len(ops) + len(writes) > 1:
            self._memops(s, [*writes[:-1], *ops, *writes[-1:]], "wait")
        else:
            cu = self._cu
            with self._guard:
                for _op, addr, v, flags in writes[:-1]:
                    check(cu.cuStreamWriteValue64(s, addr, v, flags),
                          f"cuStreamWriteValue64(rank={own}, progress reset)")
                for (_op, addr, v, flags), sl, p in zip(ops, slots, peers):
                    check(cu.cuStreamWaitValue64(s, addr, v, flags),
                          f"cuStreamWaitValue64(rank={own}, slot={sl}, peer={p})")
                for _op, addr, v, flags in writes[-1:]:
                    check(cu.cuStreamWriteValue64(s, addr, v, flags), f"cuStreamWriteValue64(rank={own}, progress)")
        self._waits.note_batch(s, slots, values, peers, whats, word, seq, equal)

    def recording_started(self, stream: Any) -> None:
        """The first operation of a recording, right after its capture began on ``stream``:
        the progress words of the recording's streams (:meth:`WaitLedger.recording_tracks`)
        are written to 0, so each replay starts from 0 before any of its waits (replays of one
        graph run one after another).  One memop node of the graph; no driver call at a replay."""
        s, words = self._waits.recording_tracks(stream)
        ops = [(self._WRITE_OP, word, 0, self.WRITE) for word in words]
        if self.memop_batch and len(ops) > 1:
            self._memops(s, ops, "write")
            return
        with self._guard:
            for _op, addr, v, flags in ops:
                check(self._cu.cuStreamWriteValue64(s, addr, v, flags),
                      f"cuStreamWriteValue64(rank={self.rank}, progress reset)")

    def _memops(self, s: int, ops: Sequence[tuple[Any, int, int, int]], kind: str) -> None:
        """Enqueue ``(op, address, value, flags)`` stream memory operations, <= 255 a call."""
        cu = self._cu
        for i in range(0, len(ops), _MEMOPS_PER_CALL):
            part = ops[i:i + _MEMOPS_PER_CALL]
            params = self._memop_params(len(part))
            for p, (op, addr, value, flags) in zip(params, part):
                p.operation = op
                u = p.waitValue if op == self._WAIT_OP else p.writeValue
                u.operation = op
                u.address = addr
                u.value64 = value
                u.flags = flags
            with self._guard:
                check(cu.cuStreamBatchMemOp(s, len(part), params[:len(part)], 0),
                      f"cuStreamBatchMemOp(rank={self.rank}, {len(part)} {kind}s)")

    def _memop_params(self, n: int) -> list[Any]:
        # Kept for reuse (setting fields is cheaper than building the structs per call);
        # one list per thread, since ranks of the single-process mode enqueue concurrently.
        tls = self._tls
        params = getattr(tls, "memops", None)
        if params is None or len(params) < n:
            params = tls.memops = [self._cu.CUstreamBatchMemOpParams() for _ in range(max(n, 8))]
        return params

    # ---- host reads -------------------------------------------------------------------------
    def read_flag(self, slot: int, rank: int | None = None) -> int:
        self.check_slot(slot)
        r = self.rank if rank is None else rank
        self.check_rank("rank", r)
        return self._streams.read_words(self.flag_addr(r, slot), 1)[0]

    @in_host_range("tide_triton::host_wait_flag")
    def host_wait_flag(self, slot: int, value: int, peer: int, timeout_s: float, what: str = "") -> int:
        self.check_slot(slot)
        self.check_rank("peer", peer)
        deadline = time.monotonic() + timeout_s
        nap = 20e-6
        while True:
            cur = self.read_flag(slot)
            if cur >= value:
                return cur
            if time.monotonic() >= deadline:
                raise PeerTimeoutError(
                    peer, what or f"flag {slot} of rank {self.rank} to reach {value}, last "
                    f"read {cur}", timeout_s)
            time.sleep(nap)
            nap = min(nap * 2, 2e-3)
