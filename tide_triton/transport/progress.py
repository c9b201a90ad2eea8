"""Progress words: how a timeout tells a flag wait that passed from the one its stream is stuck on.

A token word's reader resets it to 0 once its wait passed, so from the host a finished token
wait and a stuck one read alike ("short") until their stream is idle.  Each wait batch of the
CUDA transport (:class:`~tide_triton.transport.flags.Flags`) is therefore followed, in the
same ``cuStreamBatchMemOp`` (one ``cuStreamWriteValue64`` more where batches are refused), by a
write of the batch's sequence number into a word of its stream: a pending wait of batch ``seq``
has passed iff that word reads ``>= seq``.  The protocol's words are untouched; the progress
words are read on the error paths only (a timeout, a close that releases stuck waits).

Whose word:

* an eager stream's: one per stream handle, numbered by a host counter from 1 (the word starts 0);
* a recording's (:mod:`tide_triton.executors.recorded`): one per stream of the recording -- the graph's
  branches run concurrently, and sequence numbers only order one stream's batches -- numbered
  1..k in the graph, and written to 0 by the graph's first node
  (:meth:`~tide_triton.transport.flags.Flags.recording_started`), so every replay starts
  from 0 (replays of one graph run one after another);
* none while the caller's stream is captured by the user (``torch.cuda.graph`` around a prepared
  ``run()``): the graph's writes would land whenever the user replays it, moving an eager
  stream's word; those waits keep the old rule (a short flag is a stuck wait).

The words are 8 bytes each, handed out for good from chunks of :data:`CHUNK_WORDS` words
(``cuMemAlloc``, zeroed) and freed at close: a recording's word is never handed out again,
since a dropped recording's graph may still run when it is dropped.
"""
from __future__ import annotations

from typing import Any, Callable

from .driver import CtxGuard, check

CHUNK_WORDS = 512
"""Words per ``cuMemAlloc`` (4 KiB): a stream or a recording's stream takes one; the first
chunk is allocated with the transport, more only past 512 streams and recordings."""


class ProgressWords:
    """The device words one rank's engine hands out (see the module notes).  ``host_stream``:
    the engine's stream for host reads, on which new chunks are zeroed."""

    def __init__(self, cu: Any, guard: CtxGuard, host_stream: Any, rank: int) -> None:
        self._cu = cu
        self._guard = guard
        self._host_stream = host_stream
        self._rank = rank
        self._chunks: list[int] = []
        self._next = 0  # the next free word
        self._end = 0  # the end of the current chunk

    def available(self) -> int:
        """Words left without a new allocation."""
        return (self._end - self._next) // 8

    def grow(self) -> None:
        """One more chunk: allocated and zeroed (its words start 0, below every sequence
        number).  Never inside a stream capture: the caller makes sure (an allocation there
        would invalidate the capture)."""
        cu, nbytes = self._cu, 8 * CHUNK_WORDS
        with self._guard:
            ptr = int(check(cu.cuMemAlloc(nbytes), f"cuMemAlloc(rank={self._rank}, progress words)"))
            try:
                check(cu.cuMemsetD8Async(ptr, 0, nbytes, self._host_stream),
                      f"cuMemsetD8Async(rank={self._rank}, progress words)")
                check(cu.cuStreamSynchronize(self._host_stream), "cuStreamSynchronize(progress words)")
            except BaseException:
                check(cu.cuMemFree(ptr), f"cuMemFree(rank={self._rank}, progress words)")
                raise
        self._chunks.append(ptr)
        self._next, self._end = ptr, ptr + nbytes

    def reserve(self, n: int) -> None:
        """At least ``n`` words available (a recording takes its words during its capture,
        where nothing may be allocated)."""
        if self.available() < n:
            self.grow()

    def take(self, *, grow: bool) -> int:
        """A word of its own (its address), or 0 where none is left and ``grow`` is False."""
        if self._next == self._end:
            if not grow:
                return 0
            self.grow()
        word = self._next
        self._next += 8
        return word

    def free_all(self, quiet: Callable[..., None] | None = None) -> None:
        """Free every chunk (at close, the streams idle; ``quiet`` runs each step)."""
        chunks, self._chunks = self._chunks, []
        self._next = self._end = 0
        for ptr in chunks:
            if quiet is None:
                self._free(ptr)
            else:
                quiet(self._free, ptr)

    def _free(self, ptr: int) -> None:
        with self._guard:
            check(self._cu.cuMemFree(ptr), f"cuMemFree(rank={self._rank}, progress words)")
