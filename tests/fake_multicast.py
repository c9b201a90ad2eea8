"""A fake cuda-python driver module for multicast: records calls, emulates the object over
ordinary (CPU) memory, injects failures.  No GPU, no real driver.

* Multicast handles are ints; an export hands out a real memfd whose inode names the
  object, so the fd travels between threads over the real fd passing (Unix sockets).
* ``cuMulticastBindAddr`` binds a registered CPU tensor's bytes (:meth:`FakeDriver.register`);
  binding before every device was added fails, as the driver documents.
* :class:`EmulatedBuffers` is the :class:`~tide_triton.multicast_exec.MulticastBuffers` of
  one rank over the emulated object: a store to the multicast range is copied to every
  bound buffer, a reducing load sums them in fp32 (the kernels' torch references).
* ``fail={"cuMulticastBindAddr"}`` makes the first call of that name fail (whichever rank
  makes it); :meth:`FakeDriver.live` lists what is still acquired.
"""
from __future__ import annotations

import os
import threading
import types
from typing import Any, Callable, Iterable

import torch

from tide_triton.kernels.multimem import multimem_reduce_ref, multimem_store_ref

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
    """One rank's :class:`~tide_triton.multicast_exec.MulticastBuffers` over the fake object
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
