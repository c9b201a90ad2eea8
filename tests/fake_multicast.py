"""A fake cuda-python driver module for multicast: records calls, emulates the object over
ordinary (CPU) memory, injects failures.  No GPU, no real driver.

* Multicast handles are ints; an export hands out a real memfd whose inode names the
  object, so the fd travels between threads over the real fd passing (Unix sockets).
* ``cuMulticastBindAddr`` binds a registered CPU tensor's bytes (:meth:`FakeDriver.register`);
  binding before every device was added fails, as the driver documents.
* :class:`EmulatedBuffers` is the :class:`~tide_triton.executors.multicast.MulticastBuffers` of
  one rank over the emulated object: a store to the multicast range is copied to every
  bound buffer, a reducing load sums them in fp32 (the kernels' torch references).
* ``fail={"cuMulticastBindAddr"}`` makes the first call of that name fail (whichever rank
  makes it); :meth:`FakeDriver.live` lists what is still acquired.
* The GPU form (``multicast_exec.path`` -> ``GpuMulticast``) on CPU: :class:`FakeGroup`,
  :class:`FakeHeaps` (each rank's heap a CPU tensor registered as its device memory),
  :class:`OnCuda` (a CPU tensor the kernel launchers take for a CUDA one) and
  :class:`FakeKernel` (records each launch and runs the kernel's torch reference).
"""
from __future__ import annotations

import os
import threading
import types
from typing import Any, Callable, Iterable

import torch

from tide_triton.errors import PeerTimeoutError
from tide_triton.kernels.multimem import multimem_reduce_ref, multimem_store_ref
from tide_triton.group.options import GroupOptions

SUCCESS = 0
INVALID_VALUE = 1
NOT_SUPPORTED = 801


class _Res(int):
    @property
    def name(self) -> str:
        return {0: "CUDA_SUCCESS", 1: "CUDA_ERROR_INVALID_VALUE", 801: "CUDA_ERROR_NOT_SUPPORTED"}.get(
            int(self), f"CUDA_ERROR_{int(self)}")


class _Struct:
    def __init__(self) -> None:
        self.location = types.SimpleNamespace(type=None, id=None)
        self.flags = 0


class _Prop:
    numDevices = 0
    size = 0
    handleTypes = 0
    flags = 0


class _McObject:
    def __init__(self, size: int, n: int) -> None:
        self.size, self.n = size, n
        self.devices: list[int] = []
        self.bound: dict[int, tuple[int, int]] = {}  # device -> (ptr, size)
        self.refs = 1


class FakeDriver:
    """The fake ``cu`` module (one instance shared by every rank's thread)."""

    CUmulticastObjectProp = _Prop
    CUmemAccessDesc = _Struct
    CUmemAllocationHandleType = types.SimpleNamespace(CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR=1)
    CUmulticastGranularity_flags = types.SimpleNamespace(CU_MULTICAST_GRANULARITY_MINIMUM=0,
                                                         CU_MULTICAST_GRANULARITY_RECOMMENDED=1)
    CUmemLocationType = types.SimpleNamespace(CU_MEM_LOCATION_TYPE_DEVICE=1)
    CUmemAccess_flags = types.SimpleNamespace(CU_MEM_ACCESS_FLAGS_PROT_READWRITE=3)
    CUdevice_attribute = types.SimpleNamespace(CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED=132)

    def __init__(self, *, supported: bool = True, granularity: int = 256,
                 fail: Iterable[str] = ()) -> None:
        self.supported = supported
        self.granularity = granularity
        self.fail = set(fail)
        self.calls: list[str] = []
        self._lock = threading.Lock()
        self._next = 1000
        self.objects: dict[int, _McObject] = {}  # handle -> object (imports share the object)
        self.by_inode: dict[int, _McObject] = {}
        self.va: dict[int, int] = {}  # reserved va -> size
        self.maps: dict[int, _McObject] = {}  # mapped va -> object
        self.tensors: dict[int, torch.Tensor] = {}  # registered ptr -> uint8 tensor
        self.access: list[tuple[int, int]] = []
        self.owner: dict[int, int] = {}  # registered ptr -> device
        self.contexts: dict[int, int] = {}  # device -> primary context retains not released

    # ---- helpers --------------------------------------------------------------------------
    def register(self, t: torch.Tensor, device: int) -> int:
        """Make ``t``'s bytes bindable, as memory of ``device``; returns its address."""
        self.tensors[t.data_ptr()] = t.view(-1).view(torch.uint8)
        self.owner[t.data_ptr()] = device
        return t.data_ptr()

    def _call(self, name: str) -> bool:
        with self._lock:
            self.calls.append(name)
            if name in self.fail:
                self.fail.discard(name)
                return False
        return True

    def _id(self) -> int:
        with self._lock:
            self._next += 1
            return self._next

    def multicast_calls(self) -> list[str]:
        return [c for c in self.calls if c.startswith("cuMulticast")]

    def live(self) -> dict[str, Any]:
        """What is still acquired (empty after a complete teardown or rollback)."""
        out = {"handles": dict(self.objects), "va": dict(self.va), "maps": dict(self.maps),
               "bound": {k: dict(o.bound) for k, o in self.objects.items() if o.bound}}
        return {k: v for k, v in out.items() if v}

    def bound_buffers(self, mc_va: int) -> list[torch.Tensor]:
        """The bound memory of the object mapped at ``mc_va``, as bf16, in device order."""
        obj = self.maps[mc_va]
        out = []
        for dev in sorted(obj.bound):
            ptr, size = obj.bound[dev]
            base = next(p for p, t in self.tensors.items() if p <= ptr and ptr + size <= p + t.numel())
            out.append(self.tensors[base][ptr - base:ptr - base + size].view(torch.bfloat16))
        return out

    # ---- driver calls -------------------------------------------------------------------
    def cuDeviceGet(self, index: int) -> tuple:
        return (_Res(SUCCESS), index)

    def cuDevicePrimaryCtxRetain(self, dev: int) -> tuple:
        with self._lock:
            self.contexts[dev] = self.contexts.get(dev, 0) + 1
        return (_Res(SUCCESS), f"ctx{dev}")

    def cuDevicePrimaryCtxRelease(self, dev: int) -> tuple:
        with self._lock:
            self.contexts[dev] -= 1
            if not self.contexts[dev]:
                del self.contexts[dev]
        return (_Res(SUCCESS),)

    def cuDeviceGetAttribute(self, attr: int, dev: int) -> tuple:
        self.calls.append("cuDeviceGetAttribute")
        return (_Res(SUCCESS), int(self.supported))

    def cuMulticastGetGranularity(self, prop: _Prop, flags: int) -> tuple:
        if not self._call("cuMulticastGetGranularity"):
            return (_Res(NOT_SUPPORTED), 0)
        return (_Res(SUCCESS), self.granularity)

    def cuMulticastCreate(self, prop: _Prop) -> tuple:
        if not self._call("cuMulticastCreate"):
            return (_Res(NOT_SUPPORTED), None)
        h = self._id()
        self.objects[h] = _McObject(prop.size, prop.numDevices)
        return (_Res(SUCCESS), h)

    def cuMemExportToShareableHandle(self, h: int, ht: int, flags: int) -> tuple:
        if not self._call("cuMemExportToShareableHandle"):
            return (_Res(INVALID_VALUE), -1)
        fd = os.memfd_create("fake-multicast")
        self.by_inode[os.fstat(fd).st_ino] = self.objects[h]
        return (_Res(SUCCESS), fd)

    def cuMemImportFromShareableHandle(self, fd: int, ht: int) -> tuple:
        if not self._call("cuMemImportFromShareableHandle"):
            return (_Res(INVALID_VALUE), None)
        obj = self.by_inode[os.fstat(fd).st_ino]
        h = self._id()
        obj.refs += 1
        self.objects[h] = obj
        return (_Res(SUCCESS), h)

    def cuMulticastAddDevice(self, h: int, dev: int) -> tuple:
        if not self._call("cuMulticastAddDevice"):
            return (_Res(INVALID_VALUE),)
        obj = self.objects[h]
        with self._lock:
            if dev in obj.devices or len(obj.devices) >= obj.n:
                return (_Res(INVALID_VALUE),)
            obj.devices.append(dev)
        return (_Res(SUCCESS),)

    def cuMulticastBindAddr(self, h: int, mc_off: int, ptr: int, size: int, flags: int) -> tuple:
        if not self._call("cuMulticastBindAddr"):
            return (_Res(INVALID_VALUE),)
        obj = self.objects[h]
        if len(obj.devices) != obj.n or ptr % self.granularity or size % self.granularity:
            return (_Res(INVALID_VALUE),)  # every device first; aligned ranges only
        base = [p for p, t in self.tensors.items() if p <= ptr and ptr + size <= p + t.numel()]
        if not base:
            return (_Res(INVALID_VALUE),)
        obj.bound[self.owner[base[0]]] = (ptr, size)
        return (_Res(SUCCESS),)

    def cuMulticastUnbind(self, h: int, dev: int, mc_off: int, size: int) -> tuple:
        self._call("cuMulticastUnbind")
        self.objects[h].bound.pop(dev, None)
        return (_Res(SUCCESS),)

    def cuMemAddressReserve(self, size: int, align: int, addr: int, flags: int) -> tuple:
        if not self._call("cuMemAddressReserve"):
            return (_Res(INVALID_VALUE), 0)
        va = self._id() << 32
        self.va[va] = size
        return (_Res(SUCCESS), va)

    def cuMemAddressFree(self, va: int, size: int) -> tuple:
        self._call("cuMemAddressFree")
        del self.va[va]
        return (_Res(SUCCESS),)

    def cuMemMap(self, va: int, size: int, off: int, h: int, flags: int) -> tuple:
        if not self._call("cuMemMap"):
            return (_Res(INVALID_VALUE),)
        self.maps[va] = self.objects[h]
        return (_Res(SUCCESS),)

    def cuMemUnmap(self, va: int, size: int) -> tuple:
        self._call("cuMemUnmap")
        del self.maps[va]
        return (_Res(SUCCESS),)

    def cuMemSetAccess(self, va: int, size: int, descs: list, n: int) -> tuple:
        if not self._call("cuMemSetAccess"):
            return (_Res(INVALID_VALUE),)
        self.access.append((va, size))
        return (_Res(SUCCESS),)

    def cuMemRelease(self, h: int) -> tuple:
        self._call("cuMemRelease")
        obj = self.objects.pop(h)
        obj.refs -= 1
        return (_Res(SUCCESS),)


class EmulatedBuffers:
    """One rank's :class:`~tide_triton.executors.multicast.MulticastBuffers` over the fake object
    mapped at ``mc_va``: stores and reducing loads through the kernels' torch references."""

    def __init__(self, fake: FakeDriver, mc_va: int, local: torch.Tensor, barrier: Callable[[], Any]) -> None:
        self.fake, self.mc_va, self.local_base = fake, mc_va, local
        self.numel = local.numel()
        self._barrier = barrier

    def local(self, offset: int, numel: int) -> torch.Tensor:
        return self.local_base[offset:offset + numel]

    def reduce(self, offset: int, out: torch.Tensor, *, scale: float | None, accumulate: bool) -> None:
        multimem_reduce_ref(self.fake.bound_buffers(self.mc_va), offset, out, scale=scale, accumulate=accumulate)

    def store(self, src: torch.Tensor, offset: int) -> None:
        multimem_store_ref(src, self.fake.bound_buffers(self.mc_va), offset)

    def barrier(self) -> None:
        self._barrier()


class ThreadExchange:
    """All-gather of small objects among ``n`` threads (rank order)."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.box: list = [None] * n
        self.b = threading.Barrier(n, timeout=30)

    def of(self, rank: int) -> Callable[[Any], list]:
        def ex(obj: Any) -> list:
            self.b.wait()
            self.box[rank] = obj
            self.b.wait()
            out = list(self.box)
            self.b.wait()
            return out
        return ex


# ---------------------------------------------------------------------------------------
# the GPU form on CPU
# ---------------------------------------------------------------------------------------
class FakeGroup:
    """What ``multicast_exec.path`` / ``_create`` use of a :class:`tide_triton.Group`."""

    def __init__(self, rank: int, world_size: int, exchange: Callable[[Any], list], *,
                 multicast: str = "on", timeout_s: float = 10.0) -> None:
        self.rank, self.world_size = rank, world_size
        self.options = GroupOptions(multicast=multicast, timeout_s=timeout_s)
        self._ex = exchange
        self.executor_state: Any = None
        self.regions: list[tuple[str, int]] = []

    def exchange(self, obj: Any) -> list:
        return self._ex(obj)

    def heap_region(self, key: str, nbytes: int, device: Any) -> Any:
        self.regions.append((key, nbytes))
        return types.SimpleNamespace(offset=4096, nbytes=nbytes)  # not on a granularity boundary

    def heap_barrier(self) -> None:
        pass

    def close(self) -> None:
        if self.executor_state is not None:
            self.executor_state.close_extra()


class FakeHeaps:
    """Every rank's heap as a CPU tensor registered with ``fake`` as that rank's device memory;
    :meth:`of` is rank ``r``'s transport (the calls ``_create`` and the barrier make)."""

    def __init__(self, fake: FakeDriver, world_size: int, nbytes: int) -> None:
        self.heaps = [torch.zeros(nbytes, dtype=torch.uint8) for _ in range(world_size)]
        for r, h in enumerate(self.heaps):
            fake.register(h, r)
        self.fail_heap_tensor: set[int] = set()
        self.stuck_on: int | None = None

    def of(self, rank: int) -> Any:
        heaps = self

        class _T:
            def ensure_heap(self, nbytes: int) -> None:
                if nbytes > heaps.heaps[rank].numel():
                    raise ValueError(f"fake heap of {heaps.heaps[rank].numel()} bytes, asked for {nbytes}")

            def address(self, r: int, offset: int) -> int:
                return heaps.heaps[r].data_ptr() + offset

            def heap_tensor(self, r: int, offset: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
                if rank in heaps.fail_heap_tensor:
                    raise RuntimeError(f"heap_tensor failed on rank {rank} (injected)")
                return heaps.heaps[r][offset:offset + numel * dtype.itemsize].view(dtype)

            def busy_error(self, what: str) -> BaseException:
                if heaps.stuck_on is None:
                    return TimeoutError(f"rank {rank}: {what}")
                return PeerTimeoutError(heaps.stuck_on, f"{what}: this rank's streams wait for it", 0.0)
        return _T()


class OnCuda:
    """A CPU tensor that the multimem launchers take for a CUDA one (their checks run; the
    kernels are :class:`FakeKernel`)."""

    def __init__(self, t: torch.Tensor, index: int = 0) -> None:
        self.t = t
        self.device = torch.device("cuda", index)

    @property
    def dtype(self) -> torch.dtype:
        return self.t.dtype

    def is_contiguous(self) -> bool:
        return self.t.is_contiguous()

    def numel(self) -> int:
        return self.t.numel()

    def data_ptr(self) -> int:
        return self.t.data_ptr()


def _at(fake: FakeDriver, addr: int) -> tuple[int, int]:
    """(mapped multicast va, bf16 element offset) of a multicast address."""
    va = max(v for v in fake.maps if v <= addr)
    return va, (addr - va) // 2


def run_reduce(fake: FakeDriver, addr: int, out: OnCuda, n: int, scale: float, *, HAS_SCALE: bool,
               ACCUMULATE: bool, **_: Any) -> None:
    va, off = _at(fake, addr)
    multimem_reduce_ref(fake.bound_buffers(va), off, out.t, scale=scale if HAS_SCALE else None, accumulate=ACCUMULATE)


def run_store(fake: FakeDriver, src: OnCuda, addr: int, n: int, **_: Any) -> None:
    va, off = _at(fake, addr)
    multimem_store_ref(src.t, fake.bound_buffers(va), off)


class FakeKernel:
    """Stands in for a multimem kernel: ``kernel[grid](*args, **kw)`` records the launch and
    runs ``run(fake, *args, **kw)`` (the torch reference over the bound buffers)."""

    def __init__(self, fake: FakeDriver, run: Callable[..., None]) -> None:
        self.fake, self.run = fake, run
        self.launches: list[tuple[Any, tuple, dict]] = []
        self._lock = threading.Lock()

    def __getitem__(self, grid: Any) -> Callable[..., None]:
        def launch(*args: Any, **kw: Any) -> None:
            with self._lock:
                self.launches.append((grid, args, kw))
            self.run(self.fake, *args, **kw)
        return launch
