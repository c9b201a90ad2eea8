"""Copies of the CUDA transport: copy descriptors, checked and converted once, enqueued many times.

A list of copies is prepared once (:meth:`Copies.prepare_copies`: checked, cut where an
allocation ends, addresses turned into driver objects) and enqueued on a stream with one
``cuMemcpyBatchAsync`` per call where the driver has it (CUDA >= 12.8), otherwise one
``cuMemcpyAsync`` per piece; the path is chosen at creation and logged once.  A stream being
captured into a CUDA graph gets the loop (``cuMemcpyBatchAsync`` cannot be captured).  Strided
runs (equal rows at constant pitches, :class:`tide_triton.executors.copy_plan.Strided`) are one
``cuMemcpy2DAsync`` each, or on one GPU with wide rows one ``cuMemcpy3DAsync`` of sub-rows
(:func:`sub_row_bytes`).  A prepared list used again is replayed as a CUDA graph of its copies
(:mod:`~tide_triton.transport.copy_graphs`).  Addresses may lie on another GPU (a peer's heap
mapped with peer access): the copy engines of this rank's device move the bytes.  No copy or
strided run spans two allocations: the driver refuses that, so prepared lists are cut where one
ends (:mod:`tide_triton.transport.allocations`).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Sequence

import torch

from ..runtime import envs
from ._once import log_once
from .allocations import AllocationRanges, split_copies, split_strided
from .driver import CtxGuard, check, driver_version
from .streams import RankStreams

if TYPE_CHECKING:  # the graphs part enqueues with this module's enqueue_each
    from .copy_graphs import CopyGraphs

COPY_MODES = ("auto", "batch", "loop")

_BATCH_MIN_DRIVER = 12080

SUB_ROWS_MIN_ROW_BYTES = 128 << 10
SUB_ROWS_BYTES = (64 << 10, 512 << 10)
"""A strided run whose both ends lie on this rank's GPU and whose rows span at least
:data:`SUB_ROWS_MIN_ROW_BYTES` goes as a ``cuMemcpy3DAsync`` with each row cut into equal
sub-rows (the largest power of two in :data:`SUB_ROWS_BYTES` dividing the row and both
pitches, at most half a row): the driver runs a same-GPU ``cuMemcpy2DAsync`` of wide rows as a
kernel at ~41% of a contiguous copy's bandwidth, the 3-D form at 59% (64 KiB sub-rows) to 73%
(512 KiB) -- measured on the H200 for the MoE layers' expert rows
(docs/constraints.md#strided-copies-of-wide-rows).  Across GPUs (copy engines over NVLink)
the 2-D form stays: the 3-D one is unmeasured there."""


def memcpy2d_struct(cu: Any, dst: int, src: int, nbytes: int, rows: int, dst_pitch: int, src_pitch: int) -> Any:
    """``CUDA_MEMCPY2D`` of ``rows`` device rows of ``nbytes``, at the given pitches."""
    m = cu.CUDA_MEMCPY2D()
    dev = cu.CUmemorytype.CU_MEMORYTYPE_DEVICE
    m.srcMemoryType, m.srcDevice, m.srcPitch = dev, cu.CUdeviceptr(int(src)), int(src_pitch)
    m.dstMemoryType, m.dstDevice, m.dstPitch = dev, cu.CUdeviceptr(int(dst)), int(dst_pitch)
    m.srcXInBytes = m.srcY = m.dstXInBytes = m.dstY = 0
    m.WidthInBytes, m.Height = int(nbytes), int(rows)
    return m


def memcpy3d_struct(cu: Any, dst: int, src: int, nbytes: int, rows: int, dst_pitch: int, src_pitch: int,
                    sub: int) -> Any:
    """The same rows as a ``CUDA_MEMCPY3D`` with each row cut into sub-rows of ``sub`` bytes
    (``sub`` divides ``nbytes`` and both pitches): width ``sub``, height ``nbytes // sub``,
    depth ``rows``; a row starts every pitch bytes (pitch ``sub`` x height ``pitch // sub``)."""
    m = cu.CUDA_MEMCPY3D()
    dev = cu.CUmemorytype.CU_MEMORYTYPE_DEVICE
    m.srcMemoryType, m.srcDevice, m.srcPitch, m.srcHeight = dev, cu.CUdeviceptr(int(src)), sub, int(src_pitch) // sub
    m.dstMemoryType, m.dstDevice, m.dstPitch, m.dstHeight = dev, cu.CUdeviceptr(int(dst)), sub, int(dst_pitch) // sub
    m.srcXInBytes = m.srcY = m.srcZ = m.srcLOD = m.dstXInBytes = m.dstY = m.dstZ = m.dstLOD = 0
    m.WidthInBytes, m.Height, m.Depth = sub, int(nbytes) // sub, int(rows)
    return m


def sub_row_bytes(nbytes: int, dst_pitch: int, src_pitch: int) -> int | None:
    """The sub-row size a same-GPU strided run of ``nbytes``-byte rows is cut into for
    ``cuMemcpy3DAsync`` (see :data:`SUB_ROWS_BYTES`), or None where it stays 2-D."""
    if nbytes < SUB_ROWS_MIN_ROW_BYTES:
        return None
    lo, hi = SUB_ROWS_BYTES
    sub = hi
    while sub >= lo:
        if 2 * sub <= nbytes and nbytes % sub == 0 and dst_pitch % sub == 0 and src_pitch % sub == 0:
            return sub
        sub //= 2
    return None


@dataclass(frozen=True)
class PreparedCopies:
    """Copies checked and converted once (:meth:`Copies.prepare_copies`)."""

    dsts: list[int]
    srcs: list[int]
    nbytes: list[int]
    dst_ptrs: list[Any]
    src_ptrs: list[Any]
    strided: tuple[Any, ...] = ()
    """``CUDA_MEMCPY2D`` structs (one ``cuMemcpy2DAsync`` each) and ``CUDA_MEMCPY3D`` ones
    (same-GPU runs cut into sub-rows, :func:`sub_row_bytes`; one ``cuMemcpy3DAsync`` each)."""
    replay: dict = field(default_factory=dict, compare=False, repr=False)
    """The graph replay's state (:meth:`CopyGraphs.graph_of
    <tide_triton.transport.copy_graphs.CopyGraphs.graph_of>`): ``uses`` so far, and
    ``graph`` -- the executable graph of these copies, or None where capturing failed."""

    @property
    def descriptors(self) -> int:
        """Copy descriptors one enqueue hands the driver (a strided run counts one)."""
        return len(self.nbytes) + len(self.strided)


def enqueue_each(cu: Any, rank: int, prepared: PreparedCopies, s: int, *, plain: bool = True) -> None:
    """``prepared`` on stream ``s`` as one ``cuMemcpy2DAsync`` / ``cuMemcpy3DAsync`` per strided
    run and (``plain``) one ``cuMemcpyAsync`` per piece -- the loop path, and what a stream
    capture records (the batch call cannot be captured).  The caller holds the context."""
    for m in prepared.strided:
        if isinstance(m, cu.CUDA_MEMCPY3D):
            check(cu.cuMemcpy3DAsync(m, s), f"cuMemcpy3DAsync(rank={rank}, {m.Depth} rows)")
        else:
            check(cu.cuMemcpy2DAsync(m, s), f"cuMemcpy2DAsync(rank={rank}, {m.Height} rows)")
    if plain:
        for d, x, b in zip(prepared.dsts, prepared.srcs, prepared.nbytes):
            check(cu.cuMemcpyAsync(d, x, b, s), f"cuMemcpyAsync(rank={rank})")


class Copies:
    """The copies of one rank (see the module notes): the path choice, preparing lists and
    enqueueing them -- as one batch call, one call per piece, or a graph replay (``graphs``)."""

    def __init__(self, cu: Any, guard: CtxGuard, streams: RankStreams, graphs: CopyGraphs, *,
                 rank: int, device: torch.device) -> None:
        self._cu = cu
        self._guard = guard
        self._streams = streams
        self.graphs = graphs
        self.rank = rank
        self.device = device
        self.copy_path = "loop"
        self._attrs: list[Any] = []

    def choose_path(self, copy_mode: str, *, probe_src: int, probe_dst: int, ranks_in_process: int = 1) -> None:
        """``batch`` where ``cuMemcpyBatchAsync`` copies 8 bytes from ``probe_src`` to
        ``probe_dst`` (a probe word and a scratch word of this rank's heap), else ``loop``
        (``copy_mode`` pins one; ``batch`` that cannot work raises); and the copy-graph mode
        (``ranks_in_process`` > 1 in the single-process mode: :func:`tide_triton.runtime.envs.graphs_in_process`)."""
        cu = self._cu
        why = ""
        path = "loop"
        if copy_mode == "loop":
            why = "copy_mode='loop'"
        elif not hasattr(cu, "cuMemcpyBatchAsync"):
            why = "this cuda-python has no cuMemcpyBatchAsync"
        elif driver_version() < _BATCH_MIN_DRIVER:
            why = f"driver {driver_version()} < {_BATCH_MIN_DRIVER} (CUDA 12.8)"
        else:
            a = cu.CUmemcpyAttributes()
            a.srcAccessOrder = cu.CUmemcpySrcAccessOrder.CU_MEMCPY_SRC_ACCESS_ORDER_STREAM
            a.flags = cu.CUmemcpyFlags.CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE
            self._attrs = [a]
            try:  # 8 bytes from a probe word to a scratch word of our own heap
                dp = cu.CUdeviceptr
                with self._guard:
                    check(cu.cuMemcpyBatchAsync([dp(probe_dst)], [dp(probe_src)], [8], 1, self._attrs, [0], 1,
                                                self._streams.copy_stream_int),
                          f"cuMemcpyBatchAsync(rank={self.rank}, probe)")
                    check(cu.cuStreamSynchronize(self._streams.copy_stream_int), "cuStreamSynchronize(copy)")
                path, why = "batch", "cuMemcpyBatchAsync works"
            except Exception as exc:  # noqa: BLE001
                if copy_mode == "batch":
                    raise
                why = f"cuMemcpyBatchAsync failed: {exc}"
        if copy_mode == "batch" and path != "batch":
            raise RuntimeError(f"copy_mode='batch' but {why}")
        self.copy_path = path
        self.graphs.mode = envs.copy_graphs(ranks_in_process=ranks_in_process)
        level = logging.INFO if path == "batch" else logging.WARNING
        log_once(f"copy-{path}", level, "copies use %s (%s)",
                 "cuMemcpyBatchAsync" if path == "batch" else "a cuMemcpyAsync loop", why)

    def prepare_copies(self, dsts: Sequence[int], srcs: Sequence[int], nbytes: Sequence[int], *,
                       strided: Sequence[Any] = (), cut: bool = True) -> PreparedCopies:
        """``strided``: ``(dst, src, nbytes, rows, dst_pitch, src_pitch)`` runs
        (:class:`tide_triton.executors.copy_plan.Strided`), pitches >= nbytes.  ``cut``: cut copies and
        runs where an allocation ends (a list made once and kept, whose pieces the planner may
        have merged across tensors); ``False`` for a raw per-call list of pieces that each lie
        inside one tensor (:meth:`CudaTransport.copy`: no driver queries on that path)."""
        n = len(nbytes)
        if len(dsts) != n or len(srcs) != n:
            raise ValueError(f"dsts, srcs and nbytes must have one entry per copy, got "
                             f"{len(dsts)}, {len(srcs)} and {n}")
        if any(b < 0 for b in nbytes):
            raise ValueError(f"nbytes must be >= 0, got {min(nbytes)}")
        keep = [i for i in range(n) if nbytes[i]]
        d = [int(dsts[i]) for i in keep]
        x = [int(srcs[i]) for i in keep]
        b = [int(nbytes[i]) for i in keep]
        for run in strided:
            self._check_run(*run)
        # no copy may span two allocations (the driver refuses it): cut where one ends; the
        # context held once for all the queries (one driver call each, not three)
        runs = [tuple(map(int, run)) for run in strided]
        if cut:
            ends = AllocationRanges(self._address_range)
            with self._guard:
                runs, rows = split_strided(runs, ends.end_of)
                d, x, b = split_copies(d + [r[0] for r in rows], x + [r[1] for r in rows],
                                       b + [r[2] for r in rows], ends)
        dp = self._cu.CUdeviceptr
        return PreparedCopies(d, x, b, [dp(v) for v in d], [dp(v) for v in x],
                              tuple(self._strided_struct(*run) for run in runs))

    def _address_range(self, address: int) -> tuple[int, int] | None:
        """``(base, size)`` of the allocation holding ``address`` (None where the driver
        does not know it: host memory)."""
        with self._guard:
            err, base, size = self._cu.cuMemGetAddressRange(self._cu.CUdeviceptr(address))
        return (int(base), int(size)) if int(err) == 0 else None

    @staticmethod
    def _check_run(dst: int, src: int, nbytes: int, rows: int, dst_pitch: int, src_pitch: int) -> None:
        if not (nbytes > 0 and rows > 0 and nbytes <= dst_pitch and nbytes <= src_pitch):
            raise ValueError(f"strided copy must have nbytes > 0, rows > 0 and pitches >= nbytes, got "
                             f"nbytes={nbytes}, rows={rows}, dst_pitch={dst_pitch}, src_pitch={src_pitch}")

    def _strided_struct(self, dst: int, src: int, nbytes: int, rows: int, dst_pitch: int, src_pitch: int) -> Any:
        """The driver struct of one strided run: :func:`memcpy3d_struct` of sub-rows where both
        ends are on this GPU and :func:`sub_row_bytes` finds a size, else :func:`memcpy2d_struct`."""
        sub = sub_row_bytes(nbytes, dst_pitch, src_pitch)
        if sub is not None and self._on_this_gpu(dst) and self._on_this_gpu(src):
            return memcpy3d_struct(self._cu, dst, src, nbytes, rows, dst_pitch, src_pitch, sub)
        return memcpy2d_struct(self._cu, dst, src, nbytes, rows, dst_pitch, src_pitch)

    def _on_this_gpu(self, address: int) -> bool:
        """Whether ``address``'s memory resides on this rank's GPU (the driver's pointer
        attribute; False where the driver cannot tell)."""
        cu = self._cu
        if self.device.index is None:
            return False
        try:
            with self._guard:
                err, ordinal = cu.cuPointerGetAttribute(
                    cu.CUpointer_attribute.CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, cu.CUdeviceptr(int(address)))
        except Exception:  # noqa: BLE001 - an unknown answer keeps the 2-D form
            return False
        return err == cu.CUresult.CUDA_SUCCESS and int(ordinal) == self.device.index

    def copy_prepared(self, prepared: PreparedCopies, *, stream: Any = None, capturable: bool = False) -> None:
        """Enqueue ``prepared`` on ``stream`` (None: the copy stream); ``capturable``: one call
        per descriptor, which a capture of that stream records."""
        if not prepared.nbytes and not prepared.strided:
            return
        s = self._streams.stream_int(stream)
        cu = self._cu
        if capturable:  # inside a capture: neither cuMemcpyBatchAsync nor cuGraphLaunch (docs/design.md)
            with self._guard:
                enqueue_each(cu, self.rank, prepared, s)
            return
        if self.graphs.mode != "off":
            graph = self.graphs.graph_of(prepared)
            if graph is not None:
                with self._guard:
                    check(cu.cuGraphLaunch(graph, s),
                          f"cuGraphLaunch(rank={self.rank}, {prepared.descriptors} copies)")
                return
        with self._guard:
            # Graph capture never reaches here: the eager collectives refuse it before any
            # transport call (collectives._refuse_capture), and a captured prepared run asks
            # for capturable copies -- so no per-call capture query on this path.
            if prepared.nbytes and self.copy_path == "batch" and s not in (0, 1, 2):
                enqueue_each(cu, self.rank, prepared, s, plain=False)
                check(cu.cuMemcpyBatchAsync(prepared.dst_ptrs, prepared.src_ptrs, prepared.nbytes,
                                            len(prepared.nbytes), self._attrs, [0], 1, s),
                      f"cuMemcpyBatchAsync(rank={self.rank}, {len(prepared.nbytes)} copies)")
                return
            if prepared.nbytes and self.copy_path == "batch":
                log_once("copy-legacy", logging.INFO, "copies on a default stream use a cuMemcpyAsync "
                         "loop (cuMemcpyBatchAsync refuses it)")
            enqueue_each(cu, self.rank, prepared, s)
