"""NVSwitch multicast objects: the guard that decides whether one may exist, and its lifecycle.

**Safety.**  Creating a multicast object on a shared host can take its GPUs out of service, so
nothing here asks the driver for one unless the caller asked for multicast (``"auto"`` /
``"on"``) *and* :func:`multicast_allowed` passed on every rank of the node:

* every rank's device reports ``CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED``;
* the node's ranks agree (same mode; every rank's environment allows it);
* ``$TIDE_TRITON_MULTICAST`` is not ``0``, ``$NCCL_NVLS_ENABLE`` is not ``0`` and
  ``$TORCH_SYMM_MEM_DISABLE_MULTICAST`` is not ``1`` (read through :mod:`tide_triton.runtime.envs`).

:func:`resolve_multicast` is the collective form (it shares each rank's facts over
``exchange`` and every rank decides from the same list); with ``mode="off"`` it returns at
once, touching neither the driver nor the peers.

**Lifecycle** (:class:`MulticastObject`, one node's ranks; every step agreed across ranks, every
acquisition undone by a :class:`~.driver.Transaction` when any rank fails):

1. granularity (``cuMulticastGetGranularity``, minimum: the recommended one can be far larger
   than the bound range), the size rounded up to it -- the same on every rank, checked (rank 0
   creates the object with its size, every rank binds and maps its own);
2. rank 0 creates the object (``cuMulticastCreate``) and exports a POSIX fd
   (``cuMemExportToShareableHandle``), which reaches the other ranks over the fd passing of
   :mod:`~tide_triton.transport.handles`; they import it (``cuMemImportFromShareableHandle``);
3. every rank adds its device (``cuMulticastAddDevice``) -- all before any binding;
4. every rank binds its own heap memory (``cuMulticastBindAddr``);
5. every rank maps the multicast address: ``cuMemAddressReserve`` + ``cuMemMap`` of the
   object + ``cuMemSetAccess`` for its device.

:meth:`MulticastObject.close` unmaps, frees the address range, unbinds and releases, in that
order (local, idempotent; the caller makes sure no peer still reads through it).

The driver module ``cu`` is an argument everywhere (tests pass a fake that records calls and
emulates the object over ordinary memory: ``tests/fake_multicast.py``).  Not run on multicast
hardware: see docs/multicast.md.
"""
from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass
from typing import Any, Callable, Mapping, NamedTuple, Sequence

from ..runtime import envs
from ._once import describe, log_once, raise_if_failed, round_up
from .driver import Transaction, check
from .handles import FdChannel, close_fds

log = logging.getLogger("tide_triton")

MULTICAST_MODES = ("off", "auto", "on")
MULTICAST_CALLS = ("cuMulticastCreate", "cuMulticastAddDevice", "cuMulticastBindMem",
                   "cuMulticastBindAddr", "cuMulticastGetGranularity", "cuMulticastUnbind")
"""The driver calls that concern a multicast object; none runs unless the guard passed."""


class Decision(NamedTuple):
    """Whether multicast may be used, and the reason (said in the log or the error)."""

    allowed: bool
    reason: str


@dataclass(frozen=True)
class RankFacts:
    """What one rank contributes to the decision."""

    mode: str
    """The rank's ``GroupOptions.multicast``."""
    supported: bool | None
    """Its device's ``CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED`` (None: no CUDA device / not asked)."""
    env_block: str | None
    """The environment variable that forbids multicast on this rank, or None."""
    device: str | None = None
    """Its GPU's identifier (the driver's UUID; None: unknown): a multicast object binds each
    GPU once, so ranks sharing a GPU cannot take the path."""


def env_facts(env: Mapping[str, str] | None = None) -> str | None:
    """The first kill switch set in the environment, as ``"NAME=value"``, or None."""
    if not envs.multicast_enabled(env):
        return f"{envs.MULTICAST}=0"
    if not envs.nccl_nvls_enabled(env):
        return "NCCL_NVLS_ENABLE=0"
    if envs.torch_symm_mem_multicast_disabled(env):
        return "TORCH_SYMM_MEM_DISABLE_MULTICAST=1"
    return None


def multicast_allowed(facts: Sequence[RankFacts]) -> Decision:
    """The guard, on every rank's facts of one node (rank order); pure, no driver call.

    Allowed only when every rank asked for it (``"auto"`` / ``"on"``, the same mode), no
    rank's environment forbids it, every rank's device reports multicast support, and the
    node has at least two ranks."""
    if not facts:
        return Decision(False, "no ranks")
    modes = {f.mode for f in facts}
    if any(m not in MULTICAST_MODES for m in modes):
        return Decision(False, f"unknown multicast mode(s) {sorted(modes)}; expected {MULTICAST_MODES}")
    if "off" in modes:
        return Decision(False, 'multicast="off" (the default)' if modes == {"off"}
                        else f"the node's ranks disagree on multicast: {[f.mode for f in facts]}")
    if len(modes) > 1:
        return Decision(False, f"the node's ranks disagree on multicast: {[f.mode for f in facts]}")
    blocked = [(r, f.env_block) for r, f in enumerate(facts) if f.env_block]
    if blocked:
        return Decision(False, "forbidden by the environment: "
                        + ", ".join(f"rank {r}: {why}" for r, why in blocked)
                        + " (unset it to allow multicast)")
    unknown = [r for r, f in enumerate(facts) if f.supported is None]
    if unknown:
        return Decision(False, f"rank(s) {unknown} have no CUDA device (multicast needs NVSwitch-connected GPUs)")
    unsupported = [r for r, f in enumerate(facts) if not f.supported]
    if unsupported:
        return Decision(False, f"rank(s) {unsupported}: CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED is 0 "
                        "(no NVSwitch multicast: needs an NVSwitch system with the fabric manager, CUDA >= 12.1)")
    first: dict[str, int] = {}
    for r, f in enumerate(facts):
        if f.device is not None and first.setdefault(f.device, r) != r:
            return Decision(False, f"ranks {first[f.device]} and {r} share one GPU (a multicast object binds each "
                            "GPU once: one rank per GPU)")
    if len(facts) < 2:
        return Decision(False, "a node of one rank has nothing to multicast")
    return Decision(True, f"every one of {len(facts)} ranks supports multicast and asked for it")


def device_supports_multicast(cu: Any, cudev: Any) -> bool:
    """``CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED`` of ``cudev`` (a query, not a multicast call);
    False when the driver does not know the attribute."""
    attr = getattr(getattr(cu, "CUdevice_attribute", None), "CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED", None)
    if attr is None:
        return False
    try:
        return bool(check(cu.cuDeviceGetAttribute(attr, cudev), "cuDeviceGetAttribute(MULTICAST_SUPPORTED)"))
    except Exception:  # noqa: BLE001 - an old driver: no multicast
        log_once("mc-attr", logging.INFO, "cannot read CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED; "
                 "treating the device as without multicast", exc_info=True)
        return False


def resolve_multicast(mode: str, *, rank: int, exchange: Callable[[Any], Sequence[Any]] | None,
                      query: Callable[[], bool | None], env: Mapping[str, str] | None = None,
                      device: Callable[[], str | None] | None = None) -> Decision:
    """Collective (over the node's ``exchange``) unless ``mode == "off"``: every rank shares
    its :class:`RankFacts`, every rank decides from the same list.

    ``query()`` returns this rank's device support (None: no CUDA device); it is only called
    when the mode asks for multicast and the environment allows it.  ``"auto"`` that is not
    allowed logs the reason once and returns it; ``"on"`` raises ``RuntimeError`` on every
    rank, saying why.  ``exchange=None``: a node of this rank alone.  ``device()``: this
    rank's GPU identifier (:attr:`RankFacts.device`), asked where the device supports it."""
    if mode not in MULTICAST_MODES:
        raise ValueError(f"multicast must be one of {MULTICAST_MODES}, got {mode!r}")
    if mode == "off":
        return Decision(False, 'multicast="off" (the default)')
    block = env_facts(env)
    supported = None if block else query()
    mine = RankFacts(mode, supported, block, device() if supported and device is not None else None)
    facts = list(exchange(mine)) if exchange is not None else [mine]
    d = multicast_allowed(facts)
    if not d.allowed:
        if any(f.mode == "on" for f in facts):
            raise RuntimeError(f'GroupOptions(multicast="on") cannot be honoured on rank {rank}: {d.reason}. '
                               'Use multicast="auto" to fall back to the copy-engine path, or "off".')
        log_once(f"mc-fallback:{d.reason}", logging.INFO,
                 "multicast=\"auto\": using the copy-engine path (%s)", d.reason)
    else:
        log_once("mc-on", logging.INFO, "NVSwitch multicast enabled: %s", d.reason)
    return d


# ---------------------------------------------------------------------------------------
# lifecycle
# ---------------------------------------------------------------------------------------
class MulticastObject:
    """One multicast object of a node's ``local_size`` ranks, this rank's view of it.

    Collective: every rank of the node constructs it together, with equal ``size``.
    ``bind_ptr``: this rank's heap address whose ``size`` bytes are bound (a multiple of
    the granularity; :meth:`granularity` tells it first).  After construction
    :attr:`mc_ptr` is this process's address of the multicast range: a store there lands in
    every rank's bound memory, a ``multimem.ld_reduce`` there sums them.

    ``exchange``: all-gather of small objects among the node's ranks (rank order).
    ``cudev``: this rank's ``CUdevice``; ``device_index`` its ordinal (for access).
    ``guard``: a context manager making this rank's context current (None: already current).
    """

    def __init__(self, cu: Any, *, rank: int, local_size: int, exchange: Callable[[Any], Sequence[Any]],
                 cudev: Any, device_index: int, bind_ptr: int, size: int, guard: Any = None,
                 fd_passing: str = "auto", timeout_s: float = 120.0) -> None:
        self._closed = True
        self._cu = cu
        self.rank = rank
        self.local_size = local_size
        self._exchange = exchange
        self._cudev = cudev
        self._guard = guard
        self.device_index = device_index
        self.bind_ptr = bind_ptr
        self.handle: Any = None
        self.mc_ptr = 0
        self.H = cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        with Transaction() as tx:
            self._step("granularity", lambda: self._granularity(size))
            self._agree_size()
            self._share(tx, fd_passing, timeout_s)
            self._step("cuMulticastAddDevice", lambda: self._add_device())
            self._step("cuMulticastBindAddr", lambda: self._bind(tx))
            self._step("multicast mapping", lambda: self._map(tx))
        self._closed = False

    # ---- steps ----------------------------------------------------------------------------
    def _ctx(self) -> Any:
        return self._guard if self._guard is not None else contextlib.nullcontext()

    def _step(self, what: str, fn: Callable[[], Any]) -> None:
        """Run ``fn`` on this rank, then agree: every rank raises if any rank failed (and the
        caller's transaction undoes what this rank acquired)."""
        err = None
        try:
            with self._ctx():
                fn()
        except Exception as exc:  # noqa: BLE001 - shared with the peers
            err = describe(exc)
        raise_if_failed(self._exchange({"err": err}), f"multicast object: {what}")

    def _prop(self, size: int) -> Any:
        cu = self._cu
        prop = cu.CUmulticastObjectProp()
        prop.numDevices = self.local_size
        prop.size = size
        prop.handleTypes = int(self.H)
        prop.flags = 0
        return prop

    def _granularity(self, size: int) -> None:
        cu = self._cu
        if not isinstance(size, int) or size < 1:
            raise ValueError(f"size must be an int >= 1, got {size!r}")
        gran = int(check(cu.cuMulticastGetGranularity(
            self._prop(size), cu.CUmulticastGranularity_flags.CU_MULTICAST_GRANULARITY_MINIMUM),
            f"cuMulticastGetGranularity(rank={self.rank})"))
        self.gran = gran
        self.size = round_up(size, gran)
        if self.bind_ptr % gran:
            raise ValueError(f"bind_ptr must be a multiple of the multicast granularity {gran}, "
                             f"got {self.bind_ptr:#x}; align the bound heap range to it")

    def _agree_size(self) -> None:
        """Every rank's rounded size and granularity are the same, or every rank raises (each
        sees the same list): a rank binding less than the others would miss, silently, every
        store past its end."""
        got = self._exchange((self.size, self.gran))
        if any(x != got[0] for x in got):
            raise ValueError("multicast object: the ranks' sizes differ ("
                             + ", ".join(f"rank {r}: {sz} bytes, granularity {g}" for r, (sz, g) in enumerate(got))
                             + "); every rank must pass the same size")

    def _release(self, handle: Any) -> None:
        with self._ctx():
            check(self._cu.cuMemRelease(handle), f"cuMemRelease(multicast, rank={self.rank})")

    def _share(self, tx: Transaction, fd_passing: str, timeout_s: float) -> None:
        """Rank 0 creates and exports; the fd goes to every peer; they import."""
        cu = self._cu
        channel: FdChannel | None = None
        own_fd = -1
        sent: list[int] = []
        err = None
        peers = [p for p in range(self.local_size) if p != self.rank]
        try:
            channel = FdChannel(self.rank, self.local_size, fd_passing=fd_passing, timeout_s=timeout_s, tx=tx)
        except Exception as exc:  # noqa: BLE001
            err = describe(exc)
        infos = self._exchange({"err": err, "sock": channel.name if channel else b"", "pid": os.getpid()})
        raise_if_failed(infos, "multicast object: fd channel")
        if channel is None:  # every rank made one, or every rank raised above
            raise RuntimeError("internal error: multicast fd channel missing after an agreed success")
        try:
            channel.set_peers([i["sock"] for i in infos], [i["pid"] for i in infos])
            if self.rank == 0:
                with self._ctx():
                    self.handle = check(cu.cuMulticastCreate(self._prop(self.size)),
                                        f"cuMulticastCreate({self.size} bytes, {self.local_size} devices)")
                    tx.on_rollback(self._release, self.handle)
                    own_fd = int(check(cu.cuMemExportToShareableHandle(self.handle, self.H, 0),
                                       "cuMemExportToShareableHandle(multicast)"))
                sent = channel.send(own_fd, 1, peers)
        except Exception as exc:  # noqa: BLE001
            err = describe(exc)
        try:
            infos = self._exchange({"err": err, "fd": own_fd, "sent": sent})
            raise_if_failed(infos, "multicast object: creation on rank 0")
            err = None
            fds: dict[int, int] = {}
            try:
                if self.rank != 0:
                    fds = channel.recv({0} if self.rank in infos[0]["sent"] else set(), 1)
                    channel.fill_missing(fds, [0], [infos[0]["fd"]])
                    with self._ctx():
                        self.handle = check(cu.cuMemImportFromShareableHandle(fds[0], self.H),
                                            f"cuMemImportFromShareableHandle(multicast, rank={self.rank})")
                        tx.on_rollback(self._release, self.handle)
            except Exception as exc:  # noqa: BLE001
                err = describe(exc)
            finally:
                close_fds(fds.values())
            raise_if_failed(self._exchange({"err": err}), "multicast object: import")
        finally:
            if own_fd >= 0:
                os.close(own_fd)
            channel.close()

    def _add_device(self) -> None:
        check(self._cu.cuMulticastAddDevice(self.handle, self._cudev),
              f"cuMulticastAddDevice(rank={self.rank}, cuda:{self.device_index})")

    def _unbind(self) -> None:
        with self._ctx():
            check(self._cu.cuMulticastUnbind(self.handle, self._cudev, 0, self.size),
                  f"cuMulticastUnbind(rank={self.rank})")

    def _bind(self, tx: Transaction) -> None:
        check(self._cu.cuMulticastBindAddr(self.handle, 0, self.bind_ptr, self.size, 0),
              f"cuMulticastBindAddr(rank={self.rank}, {self.size} bytes at {self.bind_ptr:#x})")
        tx.on_rollback(self._unbind)

    def _free_va(self, va: int) -> None:
        with self._ctx():
            check(self._cu.cuMemAddressFree(va, self.size), f"cuMemAddressFree(multicast, rank={self.rank})")

    def _unmap(self, va: int) -> None:
        with self._ctx():
            check(self._cu.cuMemUnmap(va, self.size), f"cuMemUnmap(multicast, rank={self.rank})")

    def _map(self, tx: Transaction) -> None:
        cu = self._cu
        va = int(check(cu.cuMemAddressReserve(self.size, self.gran, 0, 0),
                       f"cuMemAddressReserve(multicast, rank={self.rank})"))
        tx.on_rollback(self._free_va, va)
        check(cu.cuMemMap(va, self.size, 0, self.handle, 0), f"cuMemMap(multicast, rank={self.rank})")
        tx.on_rollback(self._unmap, va)
        acc = cu.CUmemAccessDesc()
        acc.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        acc.location.id = self.device_index
        acc.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        check(cu.cuMemSetAccess(va, self.size, [acc], 1), f"cuMemSetAccess(multicast, rank={self.rank})")
        self.mc_ptr = va

    # ---- teardown ---------------------------------------------------------------------------
    def close(self) -> None:
        """Unmap, free the address range, unbind, release -- in that order; local and
        idempotent.  Failures are logged and the remaining steps still run."""
        if self._closed:
            return
        self._closed = True
        steps: list[tuple[Callable[..., Any], tuple]] = [
            (self._unmap, (self.mc_ptr,)), (self._free_va, (self.mc_ptr,)), (self._unbind, ()),
            (self._release, (self.handle,))]
        for fn, args in steps:
            try:
                fn(*args)
            except Exception:  # noqa: BLE001 - teardown goes on
                log.warning("multicast teardown step %s failed", fn.__name__, exc_info=True)
        self.mc_ptr = 0

    def __enter__(self) -> "MulticastObject":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
