"""Named heap regions: persistent byte ranges at the same offset in every rank's heap.

A region is memory the caller owns (the FSDP2 drop-in keeps unsharded parameters in one)
and that peers may write into once the owner hands it over.  That is Slot-Reuse: a
reduce-scatter can stage its peers' contributions in a region whose contents the owner no
longer needs (``reduce_scatter(..., staging=region)``) instead of in the group's receive ring.

Hand-over protocol, per region and rank (an epoch counts the uses):

* the owner calls :meth:`HeapRegion.vacate` once its last use of its copy of the region is
  enqueued (on a GPU the signal is ordered on ``stream`` after that work): every peer's flag
  ``vacated(region, owner)`` becomes the number of hand-overs so far;
* a reduce-scatter staging in the region for the ``e``-th time waits, before its first
  write into rank ``d``'s copy, until ``d`` has handed it over ``e`` times (or as often as
  this rank has, where a hand-over went unused: a staged call refused) -- with the
  group's timeout, naming ``d`` (a stream-side wait on a GPU, surfaced by
  :func:`tide_triton.synchronize` or the pacing);
* when a reduce-scatter is done with a region (its reduction has read every contribution),
  :meth:`HeapRegion.wait_consumed` orders later writes of the owner's own (an all-gather
  into the region) after it.  On the host transport everything is synchronous.

Release (Slot-Reuse between steps): a region starts and ends on segment boundaries of the
heap (nothing else shares its segments), so :meth:`HeapRegion.release` can give its physical
memory back on every rank and :meth:`HeapRegion.restore` map new memory at the same addresses
(views made before stay valid; the contents are not kept).  Both are collective over the
group; while released the region refuses every use (``tensor``, ``vacate``, staging) with a
RuntimeError, and views made before must not be touched.

Heap layout of every rank: ``[flags | reduce-scatter ring | regions... | all-gather block]``
(:mod:`tide_triton.plan.heap`).  A region is placed past everything the heap holds when it is created, and the
all-gather block moves past the regions, so no byte that a collective may still be using is handed out.
Create regions before the first all-gather (a block that moved leaves its old bytes unused).
"""
from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from ..runtime.checks import is_int
from ..plan.heap import region_end, regions_floor, round_up

class RegionTable:
    """A group's named heap regions by (device type, key): at most ``most`` (its flag map
    has their hand-over words); ``end``: heap bytes below which they lie (0: none)."""

    def __init__(self, most: int) -> None:
        self.most = most
        self.end = 0
        self._by_key: dict[tuple[str, str], HeapRegion] = {}

    def get(self, device_type: str, key: str) -> "HeapRegion | None":
        return self._by_key.get((device_type, key))

    def add(self, region: "HeapRegion") -> "HeapRegion":
        self._by_key[(region.device.type, region.key)] = region
        self.end = max(self.end, region.end)
        return region

    def room(self) -> int:
        """How many more regions the group can hold."""
        return self.most - len(self._by_key)

    def __len__(self) -> int:
        return len(self._by_key)

    def __iter__(self) -> Iterator["HeapRegion"]:
        return iter(list(self._by_key.values()))


class HeapRegion:
    """``nbytes`` bytes at byte ``offset`` of every rank's heap on ``device`` (one device
    type per group transport).  Made by :meth:`tide_triton.Group.heap_region`; lives as
    long as the group."""

    def __init__(self, group: Any, device: torch.device, key: str, index: int, offset: int, nbytes: int,
                 end: int | None = None) -> None:
        self.group = group
        self.device = device
        self.key = key
        self.index = index
        self.offset = offset
        self.nbytes = nbytes
        self.end = round_up(offset + nbytes) if end is None else end
        """Where the heap bytes it owns end (a segment boundary: what :meth:`release` gives back)."""
        self.released = False
        """True between :meth:`release` and :meth:`restore`: no physical memory behind it."""
        self.vacated = 0
        """Hand-overs this rank has signalled."""
        self.uses = 0
        """The hand-over epoch of the last reduce-scatter that staged in this region (the
        count of them, unless a hand-over was not used)."""
        self._consumed: list = []  # CUDA events: the last staging's reduction has read it
        self._read_epoch = 0
        """The last all-gather epoch whose peers read this rank's rows from its copy
        (``all_gather(..., params_region=self)``); :meth:`vacate` waits for them."""

    def __repr__(self) -> str:
        return (f"HeapRegion({self.key!r}, index={self.index}, offset={self.offset}, "
                f"nbytes={self.nbytes}, device={self.device.type}{', released' if self.released else ''})")

    @property
    def mapped_nbytes(self) -> int:
        """Heap bytes this region holds mapped now (0 while released)."""
        return 0 if self.released else self.end - self.offset

    def _check_mapped(self, what: str) -> None:
        if self.released:
            raise RuntimeError(f"{what}: heap region {self.key!r} is released (no memory behind it); "
                               "call restore() on every rank first")

    def release(self) -> None:
        """Collective over the group: give this region's physical memory back on every rank
        (its own copy and every peer's mapping of it), after every stream that may touch the
        heaps is idle (blocks the host until then).  The addresses stay reserved; until
        :meth:`restore` the region refuses use and views of it must not be touched."""
        g = self.group
        err: BaseException | None = None
        try:
            self._check_mapped("release")
        except RuntimeError as e:
            err = e
        g.agree(("heap_region.release", self.key, self.device.type), err)
        t = g.transport(self.device)
        g.heap_barrier()  # single process: every rank has enqueued its last use before any unmaps
        t.release_range(self.offset, self.end - self.offset)
        self.released = True
        self._consumed = []  # the release waited for them

    def restore(self) -> None:
        """Collective over the group: new memory behind the released region at the same
        addresses on every rank (views made before are valid again; contents undefined)."""
        g = self.group
        err: BaseException | None = None
        if not self.released:
            err = RuntimeError(f"restore: heap region {self.key!r} is not released")
        g.agree(("heap_region.restore", self.key, self.device.type), err)
        t = g.transport(self.device)
        t.restore_range(self.offset, self.end - self.offset)
        g.heap_barrier()  # single process: nobody addresses a peer's range before it is mapped
        self.released = False

    def tensor(self, dtype: torch.dtype, numel: int | None = None, offset: int = 0) -> torch.Tensor:
        """A 1-D ``dtype`` view of this rank's copy, ``offset`` bytes in (no copy; its
        storage is not resizable and must not be freed)."""
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"dtype must be a torch.dtype, got {type(dtype).__name__}")
        self._check_mapped("tensor")
        item = dtype.itemsize
        if not is_int(offset) or offset < 0 or offset % item:
            raise ValueError(f"offset must be a non-negative multiple of {item}, got {offset!r}")
        if numel is None:
            numel = (self.nbytes - offset) // item
        if not is_int(numel) or numel < 0:
            raise ValueError(f"numel must be a non-negative int, got {numel!r}")
        if offset + numel * item > self.nbytes:
            raise ValueError(f"offset + numel * {item} = {offset + numel * item} exceeds region "
                             f"{self.key!r} of {self.nbytes} bytes")
        t = self.group.transport(self.device)
        return t.heap_tensor(self.group.rank, self.offset + offset, numel, dtype)

    def vacate(self, stream: object = None) -> int:
        """Hand this rank's copy over to the peers' writes: every later use by this rank is
        done (on a GPU: enqueued before this point on ``stream``, default the current
        stream).  Signals the ranks of this rank's node (across nodes only they write into
        it).  If peers all-gathered from this copy (``all_gather(..., params_region=...)``),
        the signal waits until each has finished reading it (the host transport: this call
        waits, with the group's timeout, naming the peer; a GPU: ``stream`` waits).  Returns
        the epoch signalled.  Not collective."""
        self._check_mapped("vacate")
        g = self.group
        t = g.transport(self.device)
        # the ranks that write into this rank's copy: its node's (regions live in node heaps)
        first = g.rank - g.rank % g.local_size
        peers = [r for r in range(first, first + g.local_size) if r != g.rank]
        slot = g.flags.vacated(self.index, g.rank)
        kw = {}
        if self.device.type == "cuda":
            kw["stream"] = stream if stream is not None else torch.cuda.current_stream(self.device)
            with torch.cuda.stream(kw["stream"]):
                captured = torch.cuda.is_current_stream_capturing()
            if captured:
                raise RuntimeError(
                    f"heap region {self.key!r}: vacate() cannot be captured in a CUDA graph: its signal carries "
                    f"this hand-over's epoch ({self.vacated + 1}), which a graph would bake in -- every replay "
                    f"would signal the same epoch, and the peers' waits for the next hand-overs would never "
                    f"be met; call vacate() outside the captured region (nothing was signalled)")
        elif getattr(t, "host_compute", None) is not None:  # the caller's thread, ahead of an async queue
            kw["stream"] = t.host_compute
        with t.session():
            if self._read_epoch:  # nobody writes into my copy while a peer still reads my rows from it
                t.wait_all([g.flags.ag_done(r) for r in peers], [self._read_epoch] * len(peers), peers=peers,
                           timeout_s=g.options.timeout_s,
                           what=f"rank {{peer}} to finish reading this rank's rows of heap region {self.key!r} "
                           f"(all-gather epoch {self._read_epoch}) before it is vacated", **kw)
            self.vacated += 1
            t.signal_all(peers, [slot] * len(peers), [self.vacated] * len(peers), **kw)
        return self.vacated

    def _read(self, epoch: int) -> None:
        """An all-gather (``epoch``) had the peers read this rank's rows from its copy."""
        self._read_epoch = epoch

    def param_offsets(self, layout: Any, pdt: torch.dtype, sdt: torch.dtype, pptrs: tuple[int, ...],
                      sptrs: tuple[int, ...], snumels: tuple[int, ...]) -> tuple[int, ...]:
        """For ``all_gather(..., params_region=self)``: byte offset of every parameter (at
        ``pptrs``, shapes ``layout.shapes``, dtype ``pdt``) in this rank's copy, checked once
        per set of addresses (the group's cache).  ValueError naming the first parameter that
        does not lie inside the region, or the first shard (at ``sptrs``, ``snumels`` elements of
        ``sdt``) that overlaps the rows of its parameter it is copied to (its own rows: a copy
        onto itself, shifted, would be undefined)."""
        g = self.group
        key = ("ag-region", self.offset, self.nbytes, layout, pdt, sdt, pptrs, sptrs, snumels)
        offs = g.cached(key)
        if offs is not None:
            return offs
        base = g.transport(self.device).address(g.rank, self.offset)
        es, S = pdt.itemsize, layout.padded_shard_numels
        offs = tuple(p - base for p in pptrs)
        for i, (o, numel) in enumerate(zip(offs, layout.numels)):
            n = numel * es
            if o < 0 or o + n > self.nbytes:
                raise ValueError(
                    f"params[{i}] must lie inside params_region {self.key!r} (bytes [0, {self.nbytes}) of this "
                    f"rank's copy, e.g. region.tensor(dtype, numel, offset).view(shape)), got {n} bytes at byte "
                    f"offset {o} of it; pass params_region=None to all-gather into memory outside the heap")
        for i, (sp, k) in enumerate(zip(sptrs, snumels)):
            rows = pptrs[i] + g.rank * S[i] * es
            if k and sp < rows + k * es and rows < sp + k * sdt.itemsize:
                raise ValueError(f"shards[{i}] overlaps this rank's rows of params[{i}] (bytes {sp - base}.. and "
                                 f"{rows - base}.. of params_region {self.key!r}): pass a shard stored apart")
        return g.cache(key, offs)

    # ---- used by reduce_scatter ---------------------------------------------------------
    def _begin_staging(self) -> int:
        self._check_mapped("reduce_scatter(staging=...)")
        # The hand-over this use waits for: the next one -- or, where this rank's own ran
        # ahead (a vacate() whose staged call was refused on every rank), its latest: every
        # rank vacated as often, and an older one would let writers in while the owner still
        # uses its copy.
        self.uses = max(self.uses + 1, self.vacated)
        return self.uses

    def _staged(self, stream: object) -> None:
        """The reduction that read this region's contributions is enqueued on ``stream``."""
        if self.device.type == "cuda" and stream is not None:
            ev = torch.cuda.Event()
            ev.record(stream)
            self._consumed = [ev]

    def wait_consumed(self, stream: object = None) -> None:
        """``stream`` (default: the current stream) waits until the last reduce-scatter
        that staged here has read its contributions: before the owner writes the region
        again.  A no-op on the host transport (its reduce-scatter is synchronous)."""
        if self.device.type != "cuda":
            return
        s = stream if stream is not None else torch.cuda.current_stream(self.device)
        for ev in self._consumed:
            s.wait_event(ev)


def heap_region(g: Any, key: str, nbytes: int, device: object) -> HeapRegion:
    """Implementation of :meth:`tide_triton.Group.heap_region` (collective)."""
    err: BaseException | None = None
    sig: object = None
    dev = None
    try:
        if not isinstance(key, str) or not key:
            raise TypeError(f"key must be a non-empty str, got {key!r}")
        if not is_int(nbytes) or nbytes < 1:
            raise ValueError(f"nbytes must be an int >= 1, got {nbytes!r}")
        dev = torch.device(device)
        if dev.type not in ("cpu", "cuda"):
            raise ValueError(f"device must be a CPU or CUDA device, got {dev}")
        have = g.regions.get(dev.type, key)
        if have is not None and have.nbytes < nbytes:
            raise ValueError(f"heap region {key!r} exists with {have.nbytes} bytes, fewer than "
                             f"nbytes={nbytes}")
        if have is None and g.regions.room() <= 0:
            raise ValueError(f"this group holds {g.regions.most} heap regions already (the most it can)")
        sig = ("heap_region", key, nbytes, dev.type)
    except (TypeError, ValueError) as e:
        err = e
    g.agree(sig, err)
    have = g.regions.get(dev.type, key)
    if have is not None:
        return have
    t = g.transport(dev)
    # Past the ring (and the cross-node path's fixed areas), past every region, past whatever
    # the heap holds now (an all-gather block that a peer may still be reading): agreed, so
    # every rank picks the same offset.
    fixed = [g.ring_layout().ag_off]
    if g.nodes > 1:
        fixed.append(g.cross_node_layout().end)
    here = regions_floor(fixed, g.heap_regions_end, t.heap_nbytes())
    offset = round_up(max(g.exchange(here)))
    # The region owns whole segments (so release() frees nothing else): everything below it
    # is mapped first, so it starts where the heap ends, and it ends where its growth ends.
    t.ensure_heap(offset)
    g.heap_barrier()
    offset = max(g.exchange(t.heap_nbytes()))
    t.ensure_heap(offset + nbytes)
    g.heap_barrier()
    end = region_end(offset + nbytes, t.heap_nbytes())
    return g.regions.add(HeapRegion(g, dev, key, len(g.regions), offset, nbytes, end))
