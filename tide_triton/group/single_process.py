"""The single-process mode (:func:`local_groups`): one process drives every rank of a group,
one thread per rank -- what its ranks share (:class:`LocalRanks`) and the CUDA
preconditions of driving several ranks from one context (hardware queues, eager module
loading; docs/constraints.md)."""
from __future__ import annotations

import logging
import os
import threading
from collections.abc import Sequence
from typing import Any

import torch

from ..runtime.checks import is_int
from .bootstrap import LocalKeyValue
from ..transport import driver  # module, not name: tests patch driver.module_loading_is_lazy
from ..runtime.envs import cuda_device_max_connections, cuda_module_loading
from .core import Group
from .options import GroupOptions
from ..plan.topology import Topology

log = logging.getLogger("tide_triton")


def local_groups(world_size: int, *, local_size: int | None = None,
                 devices: Sequence[Any] | None = None, **options: Any) -> list[Group]:
    """Single-process multi-rank mode: ``world_size`` groups whose ranks are driven by
    threads of this process (one thread per rank calls the collectives with its group).
    Each rank has its own heap and streams, so on one GPU their work overlaps the way it
    does on a real node (processes sharing a GPU time-slice instead).  ``local_size``
    declares nodes (default: one node; ``LOCAL_WORLD_SIZE`` is not read here).
    ``devices``: rank r's CUDA device (``world_size`` entries; e.g. ``["cuda:0"] * W`` to
    share one GPU); default ``cuda:(r % n)`` over the ``n`` visible GPUs.

    With CUDA, this process's ranks need a hardware queue per busy stream (2W+2): where
    ``CUDA_DEVICE_MAX_CONNECTIONS`` is unset and CUDA not initialised yet, this sets it in
    ``os.environ`` to that (at most 32) -- the one place tide_triton writes the environment,
    for this process only (a launcher's one-process-per-rank children keep theirs); set it
    before the first CUDA call to choose otherwise (:func:`hardware_queues`)."""
    if not is_int(world_size) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
    opts = GroupOptions(**options)
    Topology(world_size, world_size if local_size is None else local_size)  # errors before threads
    ranks = LocalRanks(world_size, devices)
    queues = hardware_queues(2 * world_size + 2)
    if queues is not None:
        os.environ[_MAX_CONNECTIONS] = str(queues)
        log.info("single-process mode: %s=%d (streams of different ranks must not share "
                 "hardware queues)", _MAX_CONNECTIONS, queues)
    groups: list[Group | None] = [None] * world_size

    def make(r: int) -> None:  # Group() agrees on the topology: every rank at once
        groups[r] = Group(None, opts, local_size=local_size, _local=ranks, _rank=r)

    threads = [threading.Thread(target=make, args=(r,)) for r in range(world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if any(g is None for g in groups):
        raise RuntimeError("local_groups: a rank failed to create its group")
    return groups  # type: ignore[return-value]


class LocalRanks:
    """What the ranks of one process share: the key-value store of their exchanges, objects
    made once for all of them (the CUDA transports) and the streams their calls claimed."""

    def __init__(self, world_size: int, devices: Sequence[Any] | None = None) -> None:
        self.world_size = world_size
        self.kv = LocalKeyValue()
        self._lock = threading.Lock()
        self._shared: dict = {}
        self._streams: dict[tuple[int, int, int], int] = {}
        self._devices = None if devices is None else _local_rank_devices(world_size, devices)

    def devices(self) -> list[torch.device]:
        """Rank r's CUDA device: as given to :func:`local_groups`, else ``cuda:(r % n)`` over
        the ``n`` visible GPUs (the torchrun convention)."""
        if self._devices is not None:
            return self._devices
        from ..transport.cuda_setup import local_devices  # CUDA transport module: loads at the first CUDA run

        return local_devices(self.world_size)

    def placement(self) -> str:
        if self._devices is not None:
            return "the devices given to local_groups"
        return f"rank r on cuda:(r % {torch.cuda.device_count()}) over the visible GPUs"

    def check_module_loading(self) -> None:
        """Raise where this process loads CUDA kernels lazily (see :func:`_lazy_loading_problem`)."""
        why = _lazy_loading_problem(self.world_size, driver.module_loading_is_lazy())
        if why:
            raise RuntimeError(why)

    def cuda_transport(self, rank: int, device: torch.device, n_flags: int) -> Any:
        """Rank ``rank``'s CUDA transport (the ranks' transports are made together, by the
        first rank that asks); ``device``, the tensors' device, must be the rank's."""
        from ..transport.cuda import CudaTransport  # loads at the first CUDA collective: CPU runs never need it

        devices = self.devices()
        want = devices[rank]
        if device.index is not None and device != want:
            raise ValueError(
                f"single-process mode: rank {rank}'s tensors must be on {want} ({self.placement()}), got "
                f"{device}; pass local_groups(..., devices=[...]) to place the ranks otherwise")
        return self.shared("cuda", lambda: CudaTransport.create_local_group(
            self.world_size, devices=devices, n_flags=n_flags))[rank]

    def check_stream(self, rank: int, seq: int, stream: Any, device: torch.device) -> None:
        """CUDA: the stream rank ``rank``'s call ``seq`` enqueues on (``stream``, else the
        current stream of ``device``) is no other rank's (see :meth:`Group.check_own_stream`)."""
        s = stream if stream is not None else torch.cuda.current_stream(device)
        owner = self.claim_stream(rank, seq, s.device.index, s.cuda_stream)
        if owner != rank:
            what = "the default stream" if s.cuda_stream == 0 else f"stream {hex(s.cuda_stream)}"
            raise ValueError(
                f"stream: rank {rank} enqueues on {what} of {s.device}, which rank {owner} of this "
                "single-process group uses too; ranks that share a stream wait on each other forever -- give "
                "each rank's thread its own (`with torch.cuda.stream(torch.cuda.Stream(device)):`) or pass "
                "stream=")

    def claim_stream(self, rank: int, seq: int, device_index: int, handle: int) -> int:
        """The rank that first enqueued call ``seq`` on CUDA stream ``handle`` of device
        ``device_index`` (``rank`` if none did).  The last 4096 claims are kept (a rank
        would have to run that many calls ahead of a peer for one to be missed)."""
        with self._lock:
            owner = self._streams.setdefault((seq, device_index, handle), rank)
            while len(self._streams) > 4096:
                del self._streams[next(iter(self._streams))]
            return owner

    def shared(self, key: object, make: Any) -> Any:
        """One object per key for all local ranks, made by the first rank that asks."""
        with self._lock:
            if key not in self._shared:
                self._shared[key] = make()
            return self._shared[key]


def _local_rank_devices(world_size: int, devices: Sequence[Any]) -> list[torch.device]:
    """``local_groups``' ``devices`` checked: one CUDA device with an index per rank."""
    if isinstance(devices, (str, torch.device)) or not isinstance(devices, Sequence):
        raise ValueError(f"devices must be a sequence of {world_size} CUDA devices (rank r's device at "
                         f"index r), got {devices!r}")
    if len(devices) != world_size:
        raise ValueError(f"devices must name one CUDA device per rank: {world_size} entries, "
                         f"got {len(devices)}")
    out = []
    for r, d in enumerate(devices):
        try:
            dev = torch.device(d)
        except (TypeError, RuntimeError) as e:
            raise ValueError(f"devices[{r}] must be a CUDA device such as 'cuda:0', got {d!r} ({e})") from None
        if dev.type != "cuda":
            raise ValueError(f"devices[{r}] must be a CUDA device such as 'cuda:0', got {dev} "
                             "(the CPU ranks of local_groups need no device list)")
        if dev.index is None:  # "cuda": the current device, as torch reads it
            dev = torch.device("cuda", torch.cuda.current_device() if torch.cuda.is_available() else 0)
        out.append(dev)
    return out


_MAX_CONNECTIONS = "CUDA_DEVICE_MAX_CONNECTIONS"
_MOST_CONNECTIONS = 32
"""The most hardware queues ``CUDA_DEVICE_MAX_CONNECTIONS`` can give a context."""


def hardware_queues(streams: int) -> int | None:
    """The ``CUDA_DEVICE_MAX_CONNECTIONS`` this process should get for ``streams`` busy
    streams of its ranks, where it can still be set (unset, CUDA not initialised), else None
    (no CUDA, already enough, or too late: warned).

    One process driving W ranks has ~2W busy streams (copies, reductions).  The driver
    multiplexes streams onto ``CUDA_DEVICE_MAX_CONNECTIONS`` hardware queues (default 8);
    two streams on one queue run in order, so a flag wait on one blocks the other -- and
    when the other is the peer that would release it, the ranks deadlock.  The limit is read
    when the CUDA context is created; what the ranks need (at most 32) and not beyond: queues
    cost the GPU's capacity for contexts of all processes (H200: 62 contexts at 8 queues
    each, 9 at 32; docs/constraints.md#contexts-per-gpu-and-hardware-queues)."""
    if not torch.cuda.is_available():
        return None
    want = min(max(streams, 8), _MOST_CONNECTIONS)
    if streams > _MOST_CONNECTIONS:
        log.warning("single-process mode: its ranks use ~%d streams, more than the %d hardware queues CUDA "
                    "offers: streams of different ranks will share queues, and a flag wait can then hold up the "
                    "peer that would release it (on the H200 at W=4 with 8 queues every rank stalled until its "
                    "deadline); beyond %d ranks run one process per rank", streams, _MOST_CONNECTIONS,
                    (_MOST_CONNECTIONS - 2) // 2)
    have = cuda_device_max_connections()
    if have is not None and have.isdigit() and int(have) >= want:
        return None
    if not torch.cuda.is_initialized() and have is None:
        return want
    log.warning("single-process mode with %d streams but %s=%s (default 8): streams sharing a "
                "hardware queue can deadlock on each other's flag waits; set %s=%d before CUDA "
                "is initialised", streams, _MAX_CONNECTIONS, have or "unset", _MAX_CONNECTIONS, want)
    return None


_MODULE_LOADING = "CUDA_MODULE_LOADING"


def _lazy_loading_problem(world_size: int, lazy: bool) -> str | None:
    """The error of a CUDA transport for ``world_size`` ranks of one process whose driver
    loads kernels lazily, or None (one rank, or eager loading).

    Lazy module loading (torch's default) loads a kernel at its first launch, and that load
    can synchronize the whole CUDA context.  One process driving several ranks then
    deadlocks when one rank's thread launches a kernel for the first time (``Tensor.to``,
    ``torch.full`` ...) while another rank's stream waits for a flag that rank will only set
    later: seen on an H200, 3 of 3 runs of the planned-collectives test under load with
    ``LAZY`` (both ranks' threads stopped in ``Tensor.to``), 3 of 3 passed with ``EAGER``
    (docs/constraints.md#lazy-module-loading).  The driver reads ``CUDA_MODULE_LOADING`` once, at ``cuInit`` -- which
    ``torch.cuda.is_available()`` already calls (checked on the H200: set after it, the
    driver still loads lazily) -- so the library cannot switch it; the process must."""
    if world_size < 2 or not lazy:
        return None
    return (f"single-process mode (local_groups) with {world_size} ranks needs eager CUDA module "
            f"loading, but this process loads kernels lazily ({_MODULE_LOADING}="
            f"{cuda_module_loading() or 'unset: LAZY, torch default'}): a kernel's first launch "
            f"synchronizes the CUDA context, and while one rank's stream waits for a peer's flag "
            f"that synchronization can deadlock the ranks. Set {_MODULE_LOADING}=EAGER in the "
            f"environment before the process's first CUDA call (the driver reads it once, at "
            f"cuInit: torch.cuda.is_available() is already too late), or run one process per "
            f"rank (torchrun)")
