"""Node-local collectives over an NVSwitch multicast object (``GroupOptions.multicast``).

The collectives call :func:`path` only when the option is not ``"off"``; it resolves the
option once per group and device through the guard
(:func:`tide_triton.transport.multicast.resolve_multicast`) and returns a
:class:`MulticastBuffers` where multicast is on, else None (the copy-engine path runs;
``"auto"`` logged once, ``"on"`` raised on every rank).

The programs, over any :class:`MulticastBuffers` (the GPU one here, the CPU emulation of
``tests/fake_multicast.py``), in chunks of the bound range (:func:`chunk_plan`):

* reduce-scatter: each rank copies its bf16 gradient pieces into its own bound memory (local
  writes), barrier, each rank reads its shard's pieces through the multicast address with an
  in-switch sum (:func:`~tide_triton.kernels.multimem.multimem_reduce`), scales / accumulates
  in fp32 into its fp32 shards, barrier (the memory may be overwritten).
* all-gather: barrier (nothing queued ahead of the stores); each rank stores its shard pieces
  once to the multicast address, cast to bf16
  (:func:`~tide_triton.kernels.multimem.multimem_store`): every rank's bound memory receives
  them; barrier; each rank copies the pieces into its parameters; barrier.

Barriers synchronise through the host (the stream, with the group's deadline, then the group's
exchange) -- simple and correct, not fast; a stream-ordered version with flags is future
work.  Never run on multicast hardware (docs/multicast.md).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol, Sequence

import torch

from . import state
from ..plan.heap import round_up
from ..kernels.multimem import GROUP, multimem_reduce, multimem_store
from ..plan.layout import ShardLayout
from ..transport import driver
from ..transport._once import describe, log_once, raise_if_failed
from ..transport.driver import wait_with_deadline
from ..transport.multicast import MulticastObject, device_supports_multicast, resolve_multicast

log = logging.getLogger("tide_triton")

REGION_KEY = "tide_triton.multicast"
"""Name of the heap region bound to the multicast object."""


class MulticastBuffers(Protocol):
    """One rank's access to a bound range of bf16 elements (offsets in elements)."""

    numel: int
    """bf16 elements bound per rank."""

    def local(self, offset: int, numel: int) -> torch.Tensor:
        """This rank's own bound memory ``[offset, offset + numel)`` as a bf16 view."""
        ...

    def reduce(self, offset: int, out: torch.Tensor, *, scale: float | None, accumulate: bool) -> None:
        """``out (+)= scale * sum over ranks of bound[offset : offset + out.numel()]``."""
        ...

    def store(self, src: torch.Tensor, offset: int) -> None:
        """Every rank's ``bound[offset : offset + src.numel()] = bf16(src)``."""
        ...

    def barrier(self) -> None:
        """Every rank's work so far is complete and visible to every rank."""
        ...


class Piece(NamedTuple):
    """``numel`` elements of parameter ``param``, shard ``shard``, from element ``start`` of
    the shard, at element ``offset`` of the bound range (a multiple of 8)."""

    param: int
    shard: int
    start: int
    numel: int
    offset: int


def chunk_plan(layout: ShardLayout, numel: int) -> list[list[Piece]]:
    """Every shard's real elements of every parameter, in (parameter, shard) order, packed
    into chunks of at most ``numel`` bound elements (pieces start on 16-byte boundaries;
    a shard larger than a chunk is split)."""
    if numel < GROUP:
        raise ValueError(f"numel must be >= {GROUP} bound elements, got {numel}")
    numel -= numel % GROUP
    chunks: list[list[Piece]] = [[]]
    used = 0
    for i in range(len(layout)):
        for s in range(layout.world_size):
            n = layout.shard_numels(s)[i]
            start = 0
            while start < n:
                if used + GROUP > numel:
                    chunks.append([])
                    used = 0
                take = min(n - start, numel - used)
                chunks[-1].append(Piece(i, s, start, take, used))
                used = round_up(used + take, GROUP)
                start += take
    return [c for c in chunks if c]


def reduce_scatter_node(buf: MulticastBuffers, grads: Sequence[torch.Tensor], shards: Sequence[torch.Tensor],
                        layout: ShardLayout, rank: int, *, scale: float | None, accumulate: bool) -> None:
    """``shards[i][:rows] (+)= scale * sum over ranks of grads[i]``'s shard ``rank`` (see
    the module notes); grads bf16, shards fp32; without ``accumulate`` padding rows of padded
    shards become zero."""
    c = layout.padded_shard_numels
    flat_g = [g.reshape(-1) for g in grads]
    flat_s = [s.reshape(-1) for s in shards]
    if not accumulate:
        for i, s in enumerate(flat_s):
            s[layout.shard_numels(rank)[i]:].zero_()
    for chunk in chunk_plan(layout, buf.numel):
        for p in chunk:  # local writes: my contribution to every shard
            g0 = p.shard * c[p.param] + p.start
            buf.local(p.offset, p.numel).copy_(flat_g[p.param][g0:g0 + p.numel])
        buf.barrier()
        for p in chunk:
            if p.shard == rank:
                buf.reduce(p.offset, flat_s[p.param][p.start:p.start + p.numel], scale=scale,
                           accumulate=accumulate)
        buf.barrier()


def all_gather_node(buf: MulticastBuffers, shards: Sequence[torch.Tensor], params: Sequence[torch.Tensor],
                    layout: ShardLayout, rank: int) -> None:
    """``params[i][s*c : s*c + rows_s] = shard of rank s`` (bf16 params; padding rows of
    padded params become zero); see the module notes."""
    c = layout.padded_shard_numels
    flat_s = [s.reshape(-1) for s in shards]
    flat_p = [p.reshape(-1) for p in params]
    # Nothing queued ahead of the stores into the peers' memory: a store left behind a stuck
    # wait when a barrier raises could run after close unmapped the object.
    buf.barrier()
    for i, p in enumerate(flat_p):  # padding rows of padded parameters
        if p.numel() > layout.numels[i]:
            for s in range(layout.world_size):
                p[s * c[i] + layout.shard_numels(s)[i]:(s + 1) * c[i]].zero_()
    for chunk in chunk_plan(layout, buf.numel):
        for p in chunk:
            if p.shard == rank:
                buf.store(flat_s[p.param][p.start:p.start + p.numel], p.offset)
        buf.barrier()
        for p in chunk:
            d0 = p.shard * c[p.param] + p.start
            flat_p[p.param][d0:d0 + p.numel].copy_(buf.local(p.offset, p.numel))
        buf.barrier()


# ---------------------------------------------------------------------------------------
# the GPU form and the group's resolution
# ---------------------------------------------------------------------------------------
@dataclass
class GpuMulticast:
    """:class:`MulticastBuffers` over a real multicast object bound to a heap region."""

    obj: MulticastObject
    local_base: torch.Tensor
    """This rank's bound memory as a 1-D bf16 tensor."""
    exchange: Any
    device: torch.device

    @property
    def numel(self) -> int:
        return self.local_base.numel()

    def local(self, offset: int, numel: int) -> torch.Tensor:
        return self.local_base[offset:offset + numel]

    def reduce(self, offset: int, out: torch.Tensor, *, scale: float | None, accumulate: bool) -> None:
        multimem_reduce(self.obj.mc_ptr, offset, out, scale=scale, accumulate=accumulate)

    def store(self, src: torch.Tensor, offset: int) -> None:
        multimem_store(src.contiguous(), self.obj.mc_ptr, offset)

    def barrier(self) -> None:
        # with a deadline: the stream may hold an earlier collective's waits on a peer that died
        wait_with_deadline(torch.cuda.current_stream(self.device).synchronize, self.timeout_s,
                           lambda: self._busy("multicast barrier: this rank's stream still busy"))
        self.exchange(None)

    def _busy(self, what: str) -> BaseException:
        if self.busy_error is not None:
            return self.busy_error(what)
        return TimeoutError(f"rank {self.obj.rank}: {what} after {self.timeout_s:.1f} s")

    release: Any = None
    """Undoes the context retained for the object's driver calls."""
    timeout_s: float = 120.0
    """The group's deadline for the barrier's stream wait."""
    busy_error: Any = None
    """``busy_error(what)``: the transport's error for a stream wait past the deadline (a
    ``PeerTimeoutError`` naming the peer its pending waits wait for); None: a TimeoutError."""

    def close_extra(self) -> None:
        self.obj.close()
        if self.release is not None:
            self.release()
            self.release = None


_BOUND_BYTES = 64 << 20
"""Bytes bound per rank (chunks of the collectives).  Not measured: no multicast hardware."""


def path(g: Any, device: torch.device, t: Any) -> MulticastBuffers | None:
    """The multicast buffers of group ``g`` on ``device`` (transport ``t``), or None for the
    copy-engine path.  Collective the first time per group and device type (every rank of
    the node calls it at the same point of the same collective); cached afterwards."""
    mode = g.options.multicast
    if mode == "off":
        return None
    per_group = state.of(g).multicast  # closed with the group
    if device.type in per_group:
        return per_group[device.type]
    if device.type != "cuda":
        resolve_multicast(mode, rank=g.rank, exchange=g.exchange, query=lambda: None)
        per_group[device.type] = None
        return None

    cu = driver.init()

    def query() -> bool:
        return device_supports_multicast(cu, driver.check(cu.cuDeviceGet(device.index), "cuDeviceGet"))

    def uuid() -> str | None:  # ranks sharing one GPU fall back (or "on" raises) instead of failing to bind
        try:
            cudev = driver.check(cu.cuDeviceGet(device.index), "cuDeviceGet")
            return bytes(driver.check(cu.cuDeviceGetUuid(cudev), "cuDeviceGetUuid").bytes).hex()
        except Exception:  # noqa: BLE001 - unknown: the binding itself would refuse a shared GPU
            return None

    d = resolve_multicast(mode, rank=g.rank, exchange=g.exchange, query=query, device=uuid)
    if not d.allowed:
        per_group[device.type] = None
        return None
    buf = _create(g, device, t, cu)
    per_group[device.type] = buf
    return buf


def _create(g: Any, device: torch.device, t: Any, cu: Any) -> GpuMulticast:
    """The object over a heap region (aligned inside it to the granularity); every rank together."""
    gran = 2 << 20  # minimum multicast granularity expected on H100/H200; checked by MulticastObject
    region = g.heap_region(REGION_KEY, _BOUND_BYTES + gran, device)
    t.ensure_heap(region.offset + region.nbytes)
    g.heap_barrier()
    base = t.address(g.rank, region.offset)
    ptr = round_up(base, gran)
    # One thread per rank may drive it: push the context.  The primary context, which the
    # transport made already: no device_context(), whose torch.cuda.synchronize(device) would
    # wait, mid-collective and with no deadline, for streams that may wait on peers.
    cudev, ctx = driver.primary_context(device.index)
    try:
        obj = MulticastObject(cu, rank=g.rank, local_size=g.world_size, exchange=g.exchange, cudev=cudev,
                              device_index=device.index, bind_ptr=ptr, size=_BOUND_BYTES,
                              guard=driver.CtxGuard(ctx), timeout_s=g.options.timeout_s)
    except BaseException:
        cu.cuDevicePrimaryCtxRelease(cudev)
        raise
    err = None
    try:
        local = t.heap_tensor(g.rank, region.offset + (ptr - base), _BOUND_BYTES // 2, torch.bfloat16)
        buf = GpuMulticast(obj, local, g.exchange, device, release=lambda: cu.cuDevicePrimaryCtxRelease(cudev),
                           timeout_s=g.options.timeout_s, busy_error=getattr(t, "busy_error", None))
    except Exception as exc:  # noqa: BLE001 - shared with the peers
        err = describe(exc)
    try:  # agreed: every rank keeps its buffers (and takes the path from now on), or none does
        raise_if_failed(g.exchange({"err": err}), "multicast buffers")
    except BaseException:  # nothing reads through it yet: undo this rank's part
        obj.close()
        cu.cuDevicePrimaryCtxRelease(cudev)
        raise
    log_once("mc-created", logging.INFO, "multicast object of %d bytes bound on %d ranks", obj.size, g.world_size)
    return buf


AG_APART = ("the multicast all-gather reads the shards chunk by chunk while it writes the parameters, so a shard "
            "over parameter bytes would send rows another chunk already overwrote")
"""Why the multicast all-gather's shards may not share memory with its parameters (the
copy-engine path stages them in its block first)."""


def eligible_rs(gdt: torch.dtype, sdt: torch.dtype, staging: object) -> bool:
    """Whether a reduce-scatter can take the multicast path (bf16 grads, fp32 shards, no staging)."""
    return gdt == torch.bfloat16 and sdt == torch.float32 and staging is None


def eligible_ag(pdt: torch.dtype) -> bool:
    """Whether an all-gather can take the multicast path (bf16 parameters)."""
    return pdt == torch.bfloat16
