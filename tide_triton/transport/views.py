"""Tensors over heap memory that do not own it (the CUDA transport's ``heap_tensor``).

torch's non-owning storage constructor (the one its CUDA-graph trees use) involves no Python
object's reference count.  ``__cuda_array_interface__`` is not used: with torch 2.11 on the
H200, processes that wrapped heap memory that way crashed later inside the cyclic garbage
collector, the signature of a Python object freed while still referenced.  DLPack through
ctypes is the fallback for a torch without the constructor.
"""
from __future__ import annotations

import ctypes
import logging
from typing import Any, Callable

import torch

from ..runtime.checks import is_int
from ._once import log_once

class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int), ("device_id", ctypes.c_int)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p), ("device", _DLDevice), ("ndim", ctypes.c_int),
        ("dtype", _DLDataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64),
    ]


class _DLManagedTensor(ctypes.Structure):
    pass


_DLDeleter = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
_DLManagedTensor._fields_ = [
    ("dl_tensor", _DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", _DLDeleter),
]
_dl_keep: dict[int, Any] = {}  # address of the DLManagedTensor -> the ctypes objects behind it


@_DLDeleter
def _dl_delete(addr: int) -> None:
    _dl_keep.pop(addr, None)


def _dlpack_wrap(ptr: int, nbytes: int, device_index: int) -> torch.Tensor:
    shape = (ctypes.c_int64 * 1)(nbytes)
    m = _DLManagedTensor()
    m.dl_tensor.data = ctypes.c_void_p(ptr)
    m.dl_tensor.device = _DLDevice(2, device_index)  # kDLCUDA
    m.dl_tensor.ndim = 1
    m.dl_tensor.dtype = _DLDataType(1, 8, 1)  # uint8
    m.dl_tensor.shape = shape
    m.dl_tensor.strides = None
    m.dl_tensor.byte_offset = 0
    m.deleter = _dl_delete
    _dl_keep[ctypes.addressof(m)] = (m, shape)
    new = ctypes.pythonapi.PyCapsule_New
    new.restype, new.argtypes = ctypes.py_object, [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
    return torch.from_dlpack(new(ctypes.addressof(m), b"dltensor", None))


def wrap(ptr: int, nbytes: int, device: torch.device) -> torch.Tensor:
    """A uint8 tensor on ``device`` over ``nbytes`` at address ``ptr``, not owning it."""
    make = getattr(torch._C, "_construct_storage_from_data_pointer", None)
    if make is not None:
        storage = make(ptr, device, nbytes)
        t = torch.empty(0, dtype=torch.uint8, device=device).set_(storage)
    else:
        log_once("dlpack", logging.INFO, "heap views through DLPack (this torch has no "
                 "_construct_storage_from_data_pointer)")
        t = _dlpack_wrap(ptr, nbytes, device.index)
    if t.data_ptr() != ptr or t.numel() != nbytes:
        raise RuntimeError(f"wrapping heap address {ptr:#x} gave a tensor at {t.data_ptr():#x} "
                           f"of {t.numel()} bytes")
    return t


def heap_view(rank: int, offset: int, numel: int, dtype: torch.dtype, device: torch.device, *,
              heap_size: Callable[[], int], address: Callable[[], int]) -> torch.Tensor:
    """A 1-D ``dtype`` tensor on ``device`` viewing ``numel`` elements of ``rank``'s heap at byte
    ``offset`` (``heap_size()``: that heap's bytes; ``address()``: where ``offset`` lies), after
    checking the arguments and that the view fits the heap."""
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype, got {type(dtype).__name__}")
    item = dtype.itemsize
    if not is_int(offset) or offset < 0 or offset % item:
        raise ValueError(f"offset must be a non-negative multiple of {item} (the size of "
                         f"{dtype}), got {offset!r}")
    if not is_int(numel) or numel < 0:
        raise ValueError(f"numel must be a non-negative int, got {numel!r}")
    nbytes = numel * item
    size = heap_size()
    if offset + nbytes > size:
        raise ValueError(f"offset + numel * {item} = {offset + nbytes} exceeds rank {rank}'s "
                         f"heap of {size} bytes (call ensure_heap first)")
    if numel == 0:
        return torch.empty(0, dtype=dtype, device=device)
    return wrap(address(), nbytes, device).view(dtype)
