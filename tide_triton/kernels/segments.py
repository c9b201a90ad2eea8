"""The segment engine (public part of :mod:`tide_triton.kernels`): the cached tables that
drive the one segmented kernel, for the launchers here and the executors above.

A *span* (:class:`Span`) copies (or reduces) ``numel`` contiguous elements from source slot ``src_idx`` at
element ``src_off`` to destination slot ``dst_idx`` at element ``dst_off``.  Runs are cut
into tiles of at most ``tile_numel`` elements so a bounded grid balances big and small
parameters alike.  The tile table depends only on the layout, so it is built once and kept
on every device it is used on; the pointer tables (addresses of the tensors of one call)
are cached by address, so a call with the same tensors as an earlier one sends nothing to
the device.

On CPU tensors a launch runs, by default (``TIDE_TRITON_CPU_KERNELS=torch``), as plain torch
ops on views of the bound addresses, one op per run (:meth:`SegmentProgram.torch_plan`):
the kernel's arithmetic in the kernel's order -- fp32 sum over k = 0..K-1 starting from
source 0, then the scale, then the old value, one rounding (to nearest even) at the store --
so its results equal the kernel's bit for bit.  ``interpret`` runs the Triton kernel through
Triton's interpreter instead (the kernels' own tests).
"""
from __future__ import annotations

import math
import threading
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

import torch
import triton.language as tl
from triton import knobs as _knobs

from ..runtime import device_wide
from ..runtime import envs
from ..runtime import host_capture
from ._segment_kernels import TILE_FIELDS, segmented_reduce_kernel
from ._tables import SharedPointers
from ._tables import upload_pointer_tables as upload_pointer_tables  # the executors' way to the tables
from ._tables import upload_table_pairs as upload_table_pairs
from ._tables import alignment as _alignment
from ._tables import upload as _upload
from ._torch_path import TorchPlan, cpu_runs_torch, run_torch, torch_plan, torch_views

_TL_DTYPES: dict[torch.dtype, str] = {
    torch.bfloat16: "bfloat16",
    torch.float16: "float16",
    torch.float32: "float32",
}

# Pointer tables kept per program (distinct address sets seen): enough for double
# buffering and a handful of parameter groups sharing a layout.
_POINTER_CACHE_SIZE = 16
_INTERPRETER_LOCK = threading.Lock()
JIT_LAUNCH = False
"""Diagnostics: True launches through Triton's JIT entry point instead of the cached compiled kernel."""
_COMPILED: dict = {}  # specialisation -> loaded CompiledKernel (see Binding.prepare)
_COMPILED_LOCK = threading.Lock()


def interpreting() -> bool:
    """True when Triton runs kernels through its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return envs.triton_interpret()


@dataclass(frozen=True)
class Span:
    """``numel`` contiguous elements from ``src[src_idx][src_off:]`` to ``dst[dst_idx][dst_off:]``."""

    dst_idx: int
    dst_off: int
    src_idx: int
    src_off: int
    numel: int


@dataclass(frozen=True)
class LaunchConfig:
    block: int
    """Elements per inner step of a program."""
    num_warps: int


def launch_config(dst_dtype: torch.dtype, k: int) -> LaunchConfig:
    """Launch settings for a segmented copy/reduce (``k`` sources per element).

    Measured on the H200 (bench/sweep_launch.py, docs/design.md "Why the kernels look as they do"):
    * copies (k = 1): BLOCK=8192, 16 warps -- same 91-92% of the copy ceiling as 2048/8 on
      Llama-3.1-70B, and 83% vs 75% on Qwen3's W=64 shards (24 Ki-element runs), where
      fewer, larger steps amortise each tile's table reads;
    * reductions (k > 1): BLOCK=2048, 8 warps -- 8 elements per thread per source (one
      16 B bf16 vector), 90.5% at K=8 on Llama W=8, 83% at W=64; 8192/16 drops to 76%/57%.
    """
    del dst_dtype
    if interpreting():
        # The interpreter runs programs one by one in numpy: small blocks keep test sizes
        # cheap while still exercising many-block, many-tile paths.
        return LaunchConfig(block=64, num_warps=1)
    if k == 1:
        return LaunchConfig(block=8192, num_warps=16)
    return LaunchConfig(block=2048, num_warps=8)


@lru_cache(maxsize=None)
def _sm_count() -> int:
    if torch.cuda.is_available():
        return torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    return 132  # an H100/H200


def tile_numel_for(total_numel: int) -> int:
    """Largest piece of a run one program takes at a time.

    Enough tiles for ~8 per SM (small outputs -- a W=64 shard -- still fill the GPU), but
    no fewer than 4 blocks per tile nor more than 64 (a Llama-3.1-70B layer: ~6.5 K tiles),
    a power of two times the block.
    """
    if interpreting():
        return 256
    block = launch_config(torch.float32, 2).block
    want = max(1, total_numel // (8 * _sm_count()))
    tile = block * 4
    while tile * 2 <= want and tile < block * 64:
        tile *= 2
    return tile


NEEDS_INTERPRETER = "(or the CPU under TRITON_INTERPRET=1), got cpu"
"""The tail of :func:`check_device`'s error for CPU tensors bound for the interpreter where
Triton runs compiled (the test suite turns it into a skip on such machines)."""


def check_device(name: str, device: torch.device) -> None:
    """The kernels run on CUDA tensors, and on CPU tensors as plain torch (the default) or
    through Triton's interpreter (``TIDE_TRITON_CPU_KERNELS=interpret`` under
    ``TRITON_INTERPRET=1``)."""
    if device.type == "cuda" or (device.type == "cpu" and (cpu_runs_torch(device) or interpreting())):
        return
    if device.type == "cpu":
        raise ValueError(
            f"{name}: ${envs.CPU_KERNELS}=interpret runs the kernels on CPU tensors through Triton's "
            f"interpreter, which is off here (set TRITON_INTERPRET=1 before tide_triton is imported, or "
            f"unset ${envs.CPU_KERNELS} for plain torch); {name} must be on a CUDA device {NEEDS_INTERPRETER}")
    raise ValueError(f"{name} must be on a CUDA device or the CPU, got {device}")


@dataclass(eq=False)
class SegmentProgram:
    """The tile table for a fixed set of runs, cached on each device it is used on."""

    runs: tuple[Span, ...]
    n_dst: int
    n_src: int
    tile_numel: int = 0
    """0: chosen from the total size by :func:`tile_numel_for`."""
    tiles: torch.Tensor = field(init=False, repr=False)
    total_numel: int = field(init=False)
    _dst_off_gcd: int = field(init=False, repr=False)
    _src_off_gcd: int = field(init=False, repr=False)
    _device_tiles: dict = field(default_factory=dict, init=False, repr=False)
    _pointer_cache: OrderedDict = field(default_factory=OrderedDict, init=False, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False)

    def __post_init__(self) -> None:
        rows: list[tuple[int, int, int, int, int]] = []
        if self.tile_numel <= 0:
            self.tile_numel = tile_numel_for(sum(r.numel for r in self.runs if r.numel > 0))
        step = self.tile_numel
        dst_offs: list[int] = []
        src_offs: list[int] = []
        for r in self.runs:
            if r.numel <= 0:
                continue
            for start in range(0, r.numel, step):
                n = min(step, r.numel - start)
                rows.append((r.dst_idx, r.dst_off + start, r.src_idx, r.src_off + start, n))
            dst_offs.append(r.dst_off)
            src_offs.append(r.src_off)
        self.tiles = torch.tensor(rows, dtype=torch.int64, device="cpu").reshape(-1, TILE_FIELDS)
        self.total_numel = sum(r.numel for r in self.runs if r.numel > 0)
        # Offsets in elements; tiles start at run offsets plus multiples of tile_numel.
        self._dst_off_gcd = math.gcd(*dst_offs, step) if dst_offs else 0
        self._src_off_gcd = math.gcd(*src_offs, step) if src_offs else 0

    @property
    def n_tiles(self) -> int:
        return int(self.tiles.shape[0])

    def torch_plan(self) -> TorchPlan:
        """The runs as the plain-torch path executes them (made once, kept)."""
        plan = self.__dict__.get("_torch_plan")
        if plan is None:
            plan = self.__dict__["_torch_plan"] = torch_plan(self.runs, self.n_dst, self.n_src)
        return plan

    def tiles_on(self, device: torch.device) -> tuple[torch.Tensor, object, object]:
        """The tile table on ``device``, the event its upload recorded and the stream it went
        up on -- the stream current at the program's first binding on ``device``, which later
        bindings (other streams, other groups: programs are shared) need not share."""
        hit = self._device_tiles.get(device)
        if hit is None:
            hit = _upload(self.tiles, device)
            self._device_tiles[device] = hit
        return hit

    def pointer_tables(
        self, device: torch.device, dst_ptrs: tuple[int, ...], src_ptrs: tuple[int, ...],
        dst_elem: int, src_elem: int,
    ) -> tuple[torch.Tensor, torch.Tensor, int, int, object, object]:
        """Device tables of destination and source addresses (cached by address), the
        byte alignment every tile's destination and source address is known to have, and
        the event and stream of the upload (a cache hit: maybe long ago, on another stream)."""
        key = (device, dst_ptrs, src_ptrs, dst_elem, src_elem)
        with self._lock:
            hit = self._pointer_cache.get(key)
            if hit is not None:
                self._pointer_cache.move_to_end(key)
                return hit
        host = torch.frombuffer(array("q", dst_ptrs + src_ptrs), dtype=torch.int64).clone()  # 2x torch.tensor
        table, event, up = _upload(host, device)
        dst_align = _alignment(dst_ptrs + (self._dst_off_gcd * dst_elem,))
        src_align = _alignment(src_ptrs + (self._src_off_gcd * src_elem,))
        hit = (table[: len(dst_ptrs)], table[len(dst_ptrs):], dst_align, src_align, event, up)
        with self._lock:
            self._pointer_cache[key] = hit
            while len(self._pointer_cache) > _POINTER_CACHE_SIZE:
                self._pointer_cache.popitem(last=False)
        return hit


@dataclass(eq=False)
class Binding:
    """A program bound to concrete tensors: launching it costs one kernel launch.

    Holds references to its tensors (they cannot be freed under it) and re-reads their
    addresses at launch when ``check_addresses`` is set, so storage that was resized in
    place (FSDP2 frees unsharded parameters with ``storage.resize_(0)``) is caught
    instead of written through a stale pointer.
    """

    program: SegmentProgram
    dsts: tuple[torch.Tensor, ...]
    srcs: tuple[torch.Tensor, ...]
    k: int
    max_ctas: int | None
    known_ptrs: tuple[tuple[int, ...], tuple[int, ...]] | None = field(default=None, repr=False)
    """(dst addresses, src addresses) when the caller already read them (one read per call
    for many bindings over the same tensors, as the reduce-scatter's chunks are)."""
    shared: SharedPointers | None = field(default=None, repr=False)
    """Those addresses' device tables, uploaded with other bindings' (:func:`upload_pointer_tables`,
    on the stream current now; with ``known_ptrs``): no table of this binding's own."""
    dst_ptrs: tuple[int, ...] = field(init=False, repr=False)
    src_ptrs: tuple[int, ...] = field(init=False, repr=False)
    _tables: tuple = field(init=False, repr=False)
    _static: dict = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._grid = (0,)
        if self.program.n_tiles == 0:
            self.dst_ptrs, self.src_ptrs = (), ()
            return
        if len(self.dsts) != self.program.n_dst or len(self.srcs) != self.k * self.program.n_src:
            raise ValueError(
                f"binding needs {self.program.n_dst} destinations and {self.k} x "
                f"{self.program.n_src} sources, got {len(self.dsts)} and {len(self.srcs)}"
            )
        if self.known_ptrs is not None:
            self.dst_ptrs, self.src_ptrs = self.known_ptrs
        else:
            self.dst_ptrs = tuple(map(torch.Tensor.data_ptr, self.dsts))
            self.src_ptrs = tuple(map(torch.Tensor.data_ptr, self.srcs))
        dst0, src0 = self.dsts[0], self.srcs[0]
        device = dst0.device
        check_device("the tensors", device)
        self._torch = cpu_runs_torch(device)
        self._views: tuple | None = None  # the plain-torch path's views, made at its first launch
        if self.shared is not None:
            sp = self.shared
            if self.known_ptrs is None or (len(sp.dst), len(sp.src)) != (len(self.dst_ptrs), len(self.src_ptrs)):
                raise ValueError("shared pointer tables need known_ptrs of the same lengths")
            dst_tbl, src_tbl, ptr_event, ptr_stream = sp.dst, sp.src, sp.event, sp.stream
            dst_align, src_align = self._shared_alignment(sp)
        else:
            dst_tbl, src_tbl, dst_align, src_align, ptr_event, ptr_stream = self.program.pointer_tables(
                device, self.dst_ptrs, self.src_ptrs, dst0.element_size(), src0.element_size()
            )
        tiles, tile_event, tile_stream = self.program.tiles_on(device)
        self._tile_upload = (tile_event, tile_stream)
        cfg = launch_config(dst0.dtype, self.k)
        n_tiles = self.program.n_tiles
        grid = n_tiles if self.max_ctas is None else max(1, min(self.max_ctas, n_tiles))
        self._tables = (tiles, dst_tbl, src_tbl)
        self._cuda = device.type == "cuda"
        self._upload_stream = ptr_stream  # where they went up (a cache hit: maybe long ago, elsewhere)
        self._set_uploads(ptr_event)
        self._streams_seen: set = set()
        self._streams_kept: set = set()  # streams replays of a recorded launch ran on
        self._compiled: dict = {}
        self._same_dtype = src0.dtype == dst0.dtype
        self._static = dict(
            K=self.k,
            SRC_DTYPE=getattr(tl, _TL_DTYPES[src0.dtype]),
            DST_DTYPE=getattr(tl, _TL_DTYPES[dst0.dtype]),
            SRC_ALIGN=src_align,
            DST_ALIGN=dst_align,
            SOFT=interpreting(),
            BLOCK=cfg.block,
            num_warps=cfg.num_warps,
        )
        if not interpreting():
            # No fused multiply-add: ``scale * sum + old`` rounds twice, like the reference.
            self._static["enable_fp_fusion"] = False
        self._grid = (grid,)
        self._n_iters = -(-n_tiles // grid)

    def rebound(self, known_ptrs: tuple[tuple[int, ...], tuple[int, ...]], shared: SharedPointers) -> "Binding":
        """This binding on other addresses, with ``shared``'s tables (uploaded by the caller,
        :func:`upload_table_pairs`): a copy sharing the program's tile table, the launch
        settings and the compiled kernels, where everything a compiled kernel is specialised on
        agrees -- the alignment the addresses and offsets give, each table's 16-byte
        alignment; else a binding made anew.  What a reduce-scatter on new gradient addresses
        (FSDP2's MoE layers, every step) makes per chunk, without the construction's checks and
        lookups (~40 us per binding on the H200's host).  The copy keeps this binding's
        tensors (stand-ins, where the caller binds by address): launch it with
        ``check_addresses=False``."""
        agrees = (self.shared is not None and self.program.n_tiles > 0
                  and (len(shared.dst), len(shared.src)) == (len(self.dst_ptrs), len(self.src_ptrs))
                  and self._shared_alignment(shared) == (self._static["DST_ALIGN"], self._static["SRC_ALIGN"])
                  and all((new.data_ptr() % 16 == 0) == (old.data_ptr() % 16 == 0)
                          for new, old in ((shared.dst, self._tables[1]), (shared.src, self._tables[2]))))
        if not agrees:
            return Binding(self.program, self.dsts, self.srcs, self.k, self.max_ctas, known_ptrs=known_ptrs,
                           shared=shared)
        b = object.__new__(Binding)
        b.__dict__.update(self.__dict__)
        b.known_ptrs, b.shared = known_ptrs, shared
        b.dst_ptrs, b.src_ptrs = known_ptrs
        b._tables = (self._tables[0], shared.dst, shared.src)
        b._upload_stream = shared.stream
        b._set_uploads(shared.event)
        b._streams_seen, b._streams_kept = set(), set()
        b._views = None
        return b  # _compiled: the same dict (the same kernels serve every agreeing binding)

    def _set_uploads(self, ptr_event: Any) -> None:
        """Each table's upload as (event, stream): the tile table's went up with the program's
        first binding on this device, the pointer tables' on ``_upload_stream`` -- two streams
        where a program bound on one stream is rebound (or bound by another group) on another.
        A launch waits for the uploads of the streams it is not ordered after, and keeps each
        table for the streams other than the one its memory came from."""
        ups = ((self._tile_upload[0], self._tile_upload[1]), (ptr_event, self._upload_stream))
        self._uploads = tuple(u for u in ups if u[0] is not None)
        self._table_streams = (self._tile_upload[1], self._upload_stream, self._upload_stream)

    def _shared_alignment(self, sp: SharedPointers) -> tuple[int, int]:
        """(DST_ALIGN, SRC_ALIGN) this binding's kernel may assume with the tables ``sp``: what
        their addresses and the program's offsets have in common."""
        prog = self.program
        return (_alignment((sp.dst_gcd, prog._dst_off_gcd * self.dsts[0].element_size())),
                _alignment((sp.src_gcd, prog._src_off_gcd * self.srcs[0].element_size())))

    def keep_tables_for(self, stream: Any) -> None:
        """A graph that recorded this binding's launch is being replayed on ``stream``: keep
        the tables' memory from being reused before ``stream`` is done with them.  Without
        it, a binding dropped while its replay still waited on another stream than the
        uploads' (``async_op``: the group's side stream) freed its tables to the caching
        allocator, whose next allocation on the upload stream -- the next binding's tables --
        could overwrite them before the replayed kernel read them.  (The uploads themselves
        had finished: the host waited for them before the first replay.)"""
        if not getattr(self, "_cuda", False) or stream in self._streams_kept:
            return
        self._record_tables(stream)
        self._streams_kept.add(stream)

    def _record_tables(self, stream: Any) -> None:
        for t, home in zip(self._tables, self._table_streams):
            if home != stream:
                t.record_stream(stream)

    def uploaded_on(self, stream: Any) -> bool:
        """Every table of this binding went up on ``stream`` (work on it is ordered after them;
        CUDA).  Not so where the program's tile table went up with an earlier binding on
        another stream."""
        return all(home == stream for _, home in getattr(self, "_uploads", ()))

    @property
    def upload_stream(self) -> Any:
        """The stream this binding's pointer tables went up on (CUDA; None on the host); the
        tile table's may differ (:meth:`uploaded_on`)."""
        return getattr(self, "_upload_stream", None)

    @property
    def upload_events(self) -> tuple:
        """Events of this binding's table uploads (CUDA; empty on the host or with no tiles):
        what a launch recorded into a CUDA graph cannot wait for itself."""
        return tuple(e for e, _ in getattr(self, "_uploads", ()))

    def addresses_unchanged(self) -> bool:
        if self.program.n_tiles == 0:
            return True
        return (
            tuple(map(torch.Tensor.data_ptr, self.dsts)) == self.dst_ptrs
            and tuple(map(torch.Tensor.data_ptr, self.srcs)) == self.src_ptrs
        )

    def launch(
        self, *, scale: float | None = None, accumulate: bool = False, check_addresses: bool = True,
        capturing: bool = False, ordered: bool = False, stream: Any = None, record: bool = True,
    ) -> None:
        """Enqueue the kernel on the current stream of the destinations' device:
        ``dst = [dst +] scale * sum_k src_k`` over every tile.  ``capturing``: the stream is
        being captured into a CUDA graph, whose capture began with the device idle
        (``torch.cuda.graph`` synchronizes first): the tables are uploaded, and a capture may
        not wait on an event recorded outside it -- so no wait for the uploads.  ``ordered``:
        the caller has ordered this stream after the uploads' streams (:meth:`uploaded_on`) and
        orders that stream after this launch before the tables can be freed (the collectives'
        copy queue: fenced from the compute stream at a run's start, joined to it at its end) --
        no wait and no ``record_stream`` here (the copy queue's stream is the transport's own,
        destroyed at close: a table recorded on it would make torch's allocator touch a dead
        stream).
        ``stream``: the stream to launch on, where the caller has it (a ``torch.cuda.Stream``;
        default the current stream of the destinations' device, one query).  ``record=False``:
        at the first launch on a stream, wait there for the uploads made on others but do not
        ``record_stream`` the tables on it (a stream torch must not see: the caller keeps the
        tables alive past the launch)."""
        if self.program.n_tiles == 0:
            return
        if check_addresses and not self.addresses_unchanged():
            raise RuntimeError(
                "a tensor of this binding moved since it was bound (storage resized or "
                "replaced); bind the tensors again"
            )
        key = self._variant(scale, accumulate)
        if not self._cuda:
            self._launch_on_host(scale, key, capturing)
            return
        has_scale, accumulate, raw = key
        args = self._args(scale)
        if stream is None:
            stream = torch.cuda.current_stream(self.dsts[0].device)
        if not (capturing or ordered) and stream not in self._streams_seen:
            # First launch on this stream: wait for the table uploads made on other streams,
            # and keep the tables' memory from being reused before this stream is done with them.
            for event, home in self._uploads:
                if home != stream:
                    stream.wait_event(event)
            if record:
                self._record_tables(stream)
            self._streams_seen.add(stream)
        if JIT_LAUNCH:  # diagnostics: Triton's own launch path instead of the direct call
            with torch.cuda.stream(stream):
                segmented_reduce_kernel[self._grid](
                    *args, HAS_SCALE=has_scale, ACCUMULATE=accumulate, RAW=raw, **self._static)
            return
        compiled = self._compiled.get(key)
        if compiled is None:  # first launch of this variant: compile or load, then run directly
            if capturing:  # loading a module inside a capture is not allowed (and would sync)
                raise RuntimeError("a kernel variant of this binding was not loaded before the CUDA graph "
                                   "capture; prepare() it (or run once) outside the capture")
            self.prepare(scale=scale, accumulate=accumulate)
            compiled = self._compiled[key]
        kernel, consts = compiled
        s = stream.cuda_stream
        all_args = args + consts
        kernel.run(self._grid[0], 1, 1, s, kernel.function, kernel.packed_metadata,
                   kernel.launch_metadata(self._grid, s, *all_args),
                   _knobs.runtime.launch_enter_hook, _knobs.runtime.launch_exit_hook, *all_args)

    def _launch_on_host(self, scale: float | None, key: tuple[bool, bool, bool], capturing: bool) -> None:
        """:meth:`launch` on CPU tensors: plain torch, or the kernel through Triton's interpreter;
        under the host's capture (tests) recorded, to run at each replay."""
        has_scale, accumulate, raw = key
        if self._torch:
            scale_f = None if scale is None else float(scale)

            def run() -> None:
                if self._views is None:
                    self._views = torch_views(self.program.torch_plan(), self.program.n_src, self.k, self.dst_ptrs,
                                              self.src_ptrs, self.dsts[0].dtype, self.srcs[0].dtype)
                run_torch(self._views, self.k, scale_f, accumulate, raw)
        else:
            args = self._args(scale)

            def run() -> None:
                # The interpreter keeps global state per launch: one launch at a time (threads
                # of the single-process multi-rank mode launch concurrently).
                with _INTERPRETER_LOCK:
                    segmented_reduce_kernel[self._grid](
                        *args, HAS_SCALE=has_scale, ACCUMULATE=accumulate, RAW=raw, **self._static
                    )
        graph = host_capture.recording() if capturing else None
        if graph is not None:
            graph.record(run)
        else:
            run()

    def prepare(self, *, scale: float | None = None, accumulate: bool = False) -> None:
        """Compile and load the kernel variant ``launch`` will use, without launching.

        Loading a module waits for every stream of the process (and stops the process's
        other driver calls meanwhile): the groups of this process settle first
        (:mod:`tide_triton.runtime.device_wide`).  Ranks driven from one process (the single-process
        mode) must do all of it before they enqueue waits on each other's flags, or the load
        waits on a stream that waits on a peer whose thread is itself stuck behind the load."""
        if self.program.n_tiles == 0 or not self._cuda:
            return
        key = self._variant(scale, accumulate)
        if key in self._compiled:
            return
        has_scale, acc, raw = key
        args = self._args(scale)
        # What Triton specialises a compiled kernel on (and the device it is loaded on): the
        # constexprs, each table's 16-byte alignment, and each int's ``== 1`` / ``% 16 == 0``.
        # Bindings that agree share one compiled kernel, found without Triton's JIT lookup.
        spec = (self.dsts[0].device.index, tuple(sorted((k, str(v)) for k, v in self._static.items())), key,
                tuple(t.data_ptr() % 16 == 0 for t in args[:3]),
                tuple((v == 1, v % 16 == 0, v >= 1 << 31) for v in args[3:6]))
        with _COMPILED_LOCK:
            kernel = _COMPILED.get(spec)
        if kernel is None:
            # The module load below waits for every stream of the process, and stops every
            # other thread's driver calls meanwhile: settle first (tide_triton.runtime.device_wide).
            device_wide.before(f"loading a kernel variant (segmented_reduce_kernel {key}, {self._static})",
                               self.dsts[0].device.index)
            # Later launches call the compiled kernel directly, skipping Triton's per-launch
            # argument binding and specialisation (~30 us of host time).
            kernel = segmented_reduce_kernel.warmup(
                *args, grid=self._grid, HAS_SCALE=has_scale, ACCUMULATE=acc, RAW=raw, **self._static)
            kernel._init_handles()
            with _COMPILED_LOCK:
                _COMPILED[spec] = kernel
        self._compiled[key] = (kernel, self._constexpr_values(*key))

    def _variant(self, scale: float | None, accumulate: bool) -> tuple[bool, bool, bool]:
        """(HAS_SCALE, ACCUMULATE, RAW): the compile-time switches of one launch."""
        has_scale = scale is not None
        raw = self.k == 1 and self._same_dtype and not has_scale and not accumulate
        return has_scale, bool(accumulate), raw

    def _args(self, scale: float | None) -> tuple:
        tiles, dst_tbl, src_tbl = self._tables
        return (tiles, dst_tbl, src_tbl, self.program.n_tiles, self._n_iters, self.program.n_src,
                1.0 if scale is None else float(scale))

    def _constexpr_values(self, has_scale: bool, accumulate: bool, raw: bool) -> tuple:
        st = self._static
        return (st["K"], st["SRC_DTYPE"], st["DST_DTYPE"], has_scale, accumulate, raw,
                st["SRC_ALIGN"], st["DST_ALIGN"], st["SOFT"], st["BLOCK"])
