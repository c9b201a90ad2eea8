"""What every executor shares: the :class:`Work` handle, the stream policy, the zeroing of
padding rows and the wait for a staging region's hand-over.

Copy plans (:func:`plan_copies`): a collective's copy list, prepared once per set of
addresses, is shrunk before it reaches the transport -- copies back to back on both sides
merge into one, and runs of equal-sized copies at constant strides (the experts of a MoE
layer, allocated one after another) become one strided copy -- so the descriptors a call
enqueues grow with the world size and the number of distinct parameter shapes, not with the
number of parameters.

The executors -- node-local (:mod:`tide_triton.collectives`) and cross-node
(:mod:`tide_triton.hier_collectives`) -- run a collective the API has already validated and
agreed; they address the heap through :mod:`tide_triton.heap` and move bytes through the
group's transport.
"""
from __future__ import annotations

from contextlib import nullcontext
from itertools import repeat
from typing import Any, NamedTuple, Sequence

import numpy as np
import torch

__all__ = ["Work", "Streams", "prepare_padding_zeros", "wait_vacated", "Strided", "plan_copies",
           "expand_copies", "prepare_planned", "STRIDED_MIN_ROWS", "MAX_PITCH", "plan_copy_arrays", "ARRAY_PLAN_MIN"]

STRIDED_MIN_ROWS = 4
"""Shortest run of equal copies made one strided copy.  Below it the rows stay in the
transport's one batch call (a strided copy is one driver call of its own); not measured
yet -- bench/collectives_gpu.py reports the driver calls per collective to tune it."""

MAX_PITCH = (1 << 31) - 1
"""Largest row pitch (bytes) of a strided copy: ``CU_DEVICE_ATTRIBUTE_MAX_PITCH`` of every
NVIDIA GPU since Kepler; longer strides stay single copies."""


class Work:
    """Handle of a collective.  ``wait()`` makes the current stream wait for it (a no-op
    for the host transport, whose work is complete when the call returns)."""

    def __init__(self, event: object = None) -> None:
        self._event = event

    def wait(self) -> None:
        if self._event is not None:
            torch.cuda.current_stream().wait_event(self._event)

    def is_completed(self) -> bool:
        return self._event is None or self._event.query()


class _OnStream:
    """The transport with every copy, signal and wait on ``stream``."""

    def __init__(self, t: object, stream: object) -> None:
        self.t, self.stream = t, stream

    def __getattr__(self, name: str) -> object:
        return getattr(self.t, name)

    @property
    def watch(self) -> Any:
        """The transport's own abort watch (its host waits read it there): set through this
        view by a call's check-in, it must reach the transport, not stay on the view."""
        return self.t.watch

    @watch.setter
    def watch(self, fn: Any) -> None:
        self.t.watch = fn

    def _on(self, k: dict) -> dict:
        """``k`` with this stream: a caller's own ``stream=`` may only be None or name it (the
        host's check_in passes its compute stream, which is this one)."""
        s = k.pop("stream", None)
        if s is not None and s is not self.stream:
            raise RuntimeError(f"internal error: an operation on {s!r} through a transport bound to {self.stream!r}")
        k["stream"] = self.stream
        return k

    def copy(self, *a: object, **k: object) -> None:
        self.t.copy(*a, **self._on(k))

    def on_copy_queue(self, fn: Any) -> None:
        """Kernels meant for the copy queue go on this stream too (on the host: the caller's
        thread, now)."""
        fn(self.stream if isinstance(self.stream, torch.cuda.Stream) else None)

    def copy_prepared(self, *a: object, **k: object) -> None:
        self.t.copy_prepared(*a, **self._on(k))

    def signal(self, *a: object, **k: object) -> None:
        self.t.signal(*a, **self._on(k))

    def signal_all(self, *a: object, **k: object) -> None:
        self.t.signal_all(*a, **self._on(k))

    def wait(self, *a: object, **k: object) -> None:
        self.t.wait(*a, **self._on(k))

    def wait_all(self, *a: object, **k: object) -> None:
        self.t.wait_all(*a, **self._on(k))

    def wait_all_equal(self, *a: object, **k: object) -> None:
        # the call-identity check (Group.check_in) must precede this stream's data movement
        self.t.wait_all_equal(*a, **self._on(k))


class Streams:
    """Where a collective's work goes.  Host: everything is synchronous, in program order.

    CUDA: SM work (the Triton sums and casts, under :meth:`kernels`) runs on ``compute``:
    the caller's ``stream`` (default: the current stream), or -- with ``async_op`` or
    ``whole_on_side`` -- the group's side stream (:meth:`Group.side_stream`), after the work
    already on the caller's stream.  Copies and flags go on the transport's copy-engine
    stream (node-local executor), or, with ``whole_on_side`` (cross-node executor: node-local
    copies, flags, sums and NCCL groups in one program order), on ``compute`` as well:
    :attr:`t` is then the transport bound to it.  Not the transport's own copy stream for
    everything: torch work on it (allocations, kernel tables) would be recorded against a
    stream the transport destroys at close, and torch's allocator then fails freeing those
    blocks (seen on the H200 as ``cudaErrorContextIsDestroyed`` after ``Group.close()``).

    :meth:`finish`: with ``async_op`` the returned :class:`Work` carries an event on
    ``compute`` (the caller keeps the tensors alive until ``wait()``); otherwise the caller's
    stream waits for ``compute`` when they differ."""

    def __init__(self, g: Any, t: Any, device: torch.device, stream: object, async_op: bool, *,
                 whole_on_side: bool = False) -> None:
        self.cuda = device.type == "cuda"
        self.async_op = async_op
        self.t = t
        self.user = None
        # the host transport's compute stream: the calling thread (None unless its copy queue
        # runs behind it, transport.host.COPY_QUEUE = "async")
        self.compute = getattr(t, "host_compute", None)
        if self.cuda:
            self.user = stream if stream is not None else torch.cuda.current_stream(device)
            if async_op or whole_on_side:
                self.compute = g.side_stream(device)
                self.compute.wait_stream(self.user)
            else:
                self.compute = self.user
        if whole_on_side and self.compute is not None:
            self.t = _OnStream(t, self.compute)

    def kernels(self):
        """Context for SM work: on ``compute`` (GPU)."""
        return torch.cuda.stream(self.compute) if self.cuda else nullcontext()

    def finish(self) -> Work:
        if not self.cuda:
            return Work()
        if self.async_op:
            ev = torch.cuda.Event()
            ev.record(self.compute)
            return Work(ev)
        if self.compute is not self.user:
            self.user.wait_stream(self.compute)
        return Work()


def capturing(stream: object = None, device: object = None) -> bool:
    """Whether ``stream`` (default: the current stream of ``device``, default the current
    device) is being captured into a CUDA graph; False while CUDA is not initialised."""
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return False
    s = stream if isinstance(stream, torch.cuda.Stream) else torch.cuda.current_stream(device)
    with torch.cuda.stream(s):
        return torch.cuda.is_current_stream_capturing()


def prepare_padding_zeros(g: Any, t: Any, shard_ptrs: Sequence[int], shard_numels: Sequence[int],
                          real_numels: Sequence[int], elem_bytes: int, device: torch.device) -> Any:
    """The zero-fill of padded shards' padding (the elements past each shard's real ones) as
    copies from the group's zero buffer, prepared once per set of addresses: one transport
    call per collective, not a view and a kernel per padded shard every call (771 at the
    256-expert layer with W=3).  Returns ``(prepared
    copies, the zero buffer -- kept alive with them)``, or None when no shard is padded."""
    pads = [(p, n) for p, n in enumerate(real_numels) if shard_numels[p] > n]
    if not pads:
        return None
    es = elem_bytes
    zeros = g.zeros(device, max(shard_numels[p] - n for p, n in pads) * es)
    z = zeros.data_ptr()
    plan = plan_copies([shard_ptrs[p] + n * es for p, n in pads], [z] * len(pads),
                       [(shard_numels[p] - n) * es for p, n in pads])
    return prepare_planned(t, plan), zeros


def wait_vacated(t: Any, flags: Any, staging: Any, peers: Sequence[int], timeout_s: float) -> None:
    """Slot-Reuse: count a new use of ``staging`` and wait until every rank of ``peers`` has
    vacated its copy that many times -- nobody writes into a peer's region before the peer
    handed it over (:meth:`HeapRegion.vacate`)."""
    e = staging._begin_staging()
    peers = list(peers)
    t.wait_all([flags.vacated(staging.index, d) for d in peers], [e] * len(peers), peers=peers,
               timeout_s=timeout_s, what=f"rank {{peer}} to vacate staging region {staging.key!r} "
               f"(use {e}: its staging.vacate())")


class Strided(NamedTuple):
    """``rows`` copies of ``nbytes``: row ``i`` from ``src + i * src_pitch`` to
    ``dst + i * dst_pitch`` (one row: a plain copy)."""

    dst: int
    src: int
    nbytes: int
    rows: int = 1
    dst_pitch: int = 0
    src_pitch: int = 0


def plan_copies(dsts: Sequence[int], srcs: Sequence[int], nbytes: Sequence[int], *,
                min_rows: int = STRIDED_MIN_ROWS) -> list[Strided]:
    """The same bytes moved by fewer descriptors, in list order: empty copies dropped,
    neighbours back to back on both sides merged, then runs of at least ``min_rows`` copies
    of one size at constant strides (each at least the size: rows never overlap) made one
    :class:`Strided`.  Exact for any copy list whose pieces may run in any order (the
    transports' contract): every byte has the same source as before.  Lists (or int64
    arrays) longer than :data:`ARRAY_PLAN_MIN` are planned with array operations (a reduce-scatter round of a MoE
    layer on new gradient addresses: thousands of pieces), the result the same."""
    n = len(nbytes)
    if len(dsts) != n or len(srcs) != n:
        raise ValueError(f"dsts, srcs and nbytes must have one entry per copy, got {len(dsts)}, {len(srcs)} and {n}")
    if n > ARRAY_PLAN_MIN:
        return plan_copy_arrays(np.asarray(dsts, dtype=np.int64), np.asarray(srcs, dtype=np.int64),
                                np.asarray(nbytes, dtype=np.int64), min_rows)
    return _plan_lists(dsts, srcs, nbytes, min_rows)


def _plan_lists(dsts: Sequence[int], srcs: Sequence[int], nbytes: Sequence[int], min_rows: int) -> list[Strided]:
    """:func:`plan_copies` element by element (short lists)."""
    flat: list[list[int]] = []
    for d, x, b in zip(dsts, srcs, nbytes):
        if b < 0:
            raise ValueError(f"nbytes must be >= 0, got {b}")
        if not b:
            continue
        if flat and flat[-1][0] + flat[-1][2] == d and flat[-1][1] + flat[-1][2] == x:
            flat[-1][2] += b
        else:
            flat.append([int(d), int(x), int(b)])
    out: list[Strided] = []
    i, m = 0, len(flat)
    while i < m:
        d, x, b = flat[i]
        j = i + 1
        if j < m and flat[j][2] == b:
            dp, sp = flat[j][0] - d, flat[j][1] - x
            if b <= dp <= MAX_PITCH and b <= sp <= MAX_PITCH:
                while j < m and flat[j][2] == b and flat[j][0] - flat[j - 1][0] == dp \
                        and flat[j][1] - flat[j - 1][1] == sp:
                    j += 1
                if j - i >= max(2, min_rows):
                    out.append(Strided(d, x, b, j - i, dp, sp))
                    i = j
                    continue
        out.append(Strided(d, x, b))
        i += 1
    return out


ARRAY_PLAN_MIN = 64
"""Copy lists longer than this are planned by :func:`plan_copy_arrays`."""


def plan_copy_arrays(d: np.ndarray, x: np.ndarray, b: np.ndarray, min_rows: int) -> list[Strided]:
    """:func:`plan_copies` on int64 arrays: the merge of back-to-back neighbours (a copy joins
    the one before when both its ends continue it -- pairwise, as the chained merge) and the
    greedy strided runs, found from pairwise differences; a Python loop only over the runs."""
    if (b < 0).any():
        raise ValueError(f"nbytes must be >= 0, got {int(b.min())}")
    keep = b > 0
    d, x, b = d[keep], x[keep], b[keep]
    if not len(b):
        return []
    joins = np.empty(len(b), dtype=bool)
    joins[0] = False
    joins[1:] = (d[1:] == d[:-1] + b[:-1]) & (x[1:] == x[:-1] + b[:-1])
    starts = np.flatnonzero(~joins)
    d, x, b = d[starts], x[starts], np.add.reduceat(b, starts)
    m = len(b)
    # pair k (k >= 1): copy k after copy k-1 -- same size and pitches (dp, sp) >= the size
    dp, sp = np.diff(d), np.diff(x)
    same_size = b[1:] == b[:-1]
    opens = same_size & (dp >= b[:-1]) & (dp <= MAX_PITCH) & (sp >= b[:-1]) & (sp <= MAX_PITCH)
    # pair k continues pair k-1's run: same size and the same pitches
    cont = np.zeros(m, dtype=bool)  # indexed by the pair's later copy
    cont[2:] = same_size[1:] & (dp[1:] == dp[:-1]) & (sp[1:] == sp[:-1])
    # the first copy at or after k whose pair does not continue (m: none)
    idx = np.where(cont, m, np.arange(m))
    stop = np.minimum.accumulate(idx[::-1])[::-1]
    dl, xl, bl = d.tolist(), x.tolist(), b.tolist()
    if not opens.any():  # every copy single: tuples made without a Python call each (2x faster)
        return list(map(tuple.__new__, repeat(Strided), zip(dl, xl, bl, repeat(1), repeat(0), repeat(0))))
    opens_l, stop_l, dpl, spl = opens.tolist(), stop.tolist(), dp.tolist(), sp.tolist()
    least = max(2, min_rows)
    out: list[Strided] = []
    i = 0
    while i < m:
        if i + 1 < m and opens_l[i]:
            j = stop_l[i + 2] if i + 2 < m else m
            if j - i >= least:
                out.append(Strided(dl[i], xl[i], bl[i], j - i, dpl[i], spl[i]))
                i = j
                continue
        out.append(Strided(dl[i], xl[i], bl[i]))
        i += 1
    return out


def expand_copies(plan: Sequence[Strided]) -> tuple[list[int], list[int], list[int]]:
    """A plan as plain ``(dsts, srcs, nbytes)`` (strided runs row by row)."""
    dsts: list[int] = []
    srcs: list[int] = []
    sizes: list[int] = []
    for c in plan:
        for r in range(c.rows):
            dsts.append(c.dst + r * c.dst_pitch)
            srcs.append(c.src + r * c.src_pitch)
            sizes.append(c.nbytes)
    return dsts, srcs, sizes


def prepare_planned(t: Any, plan: Sequence[Strided]) -> Any:
    """``plan`` prepared by transport ``t``: strided runs as strided copies where the
    transport has them (``t.strided_copies``: the CUDA transport), row by row elsewhere."""
    if getattr(t, "strided_copies", False):
        plain = [c for c in plan if c.rows == 1]
        return t.prepare_copies([c.dst for c in plain], [c.src for c in plain], [c.nbytes for c in plain],
                                strided=[c for c in plan if c.rows > 1])
    return t.prepare_copies(*expand_copies(plan))


def copy_batches_paced(g: Any, t: Any, device: torch.device, batches: Sequence[Any], ops_per_batch: int,
                       timeout_s: float, *, capturing: bool = False) -> None:
    """Enqueue prepared copy ``batches`` on the copy queue, the host at most a few batches
    ahead of the copy engines (:meth:`Group.pacer`): thousands of descriptors queued behind
    flag waits would fill the driver's queue and block the thread inside the driver.  A batch
    the transport replays as one graph (:meth:`replays`) is one queue entry: not paced.
    ``capturing``: the copy queue is being captured into a CUDA graph -- capturable copies,
    no pacing (nothing reaches the driver's queues until a replay, and a capture cannot wait
    on the host)."""
    if capturing:
        for batch in batches:
            t.copy_prepared(batch, capturable=True)
        return
    pace = g.pacer(device)
    pace.start(ops_per_batch)
    cuda = device.type == "cuda"
    for b, batch in enumerate(batches):
        if not t.replays(batch):
            pace.before(b, t, timeout_s)
        t.copy_prepared(batch)
        if cuda:
            pace.after(b, t.copy_stream)
