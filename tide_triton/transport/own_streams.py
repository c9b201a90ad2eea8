"""CUDA streams of the library's own, made by the driver -- never from torch's stream pool.

torch hands out its pooled streams round-robin (32 per device and priority): a stream a group
took from it is, sooner or later, the very stream some caller's ``torch.cuda.Stream()`` gets.
A group's side stream (``async_op`` collectives, the cross-node executor) that is also a
caller's stream puts the group's flag waits in front of the caller's work: in the
single-process mode, where that caller is another rank, the two ranks then wait on each other
until the deadline.  So side streams are the driver's (``cuStreamCreateWithPriority``,
non-blocking, like torch's pool), handed to torch as ``ExternalStream``.

They are never destroyed: torch's allocator and events may still name a stream after a group
closed (its blocks are freed later against it, and destroying it made such frees fail on the
H200 -- the reason the copy queue's torch handle is not destroyed either).  A closed group gives
its stream back once it is idle; the next group takes it, so a process holds as many as it had
groups open at once.  A stream still busy at close (a broken group's stuck waits) is never
handed out again.
"""
from __future__ import annotations

import threading

import torch

from .driver import CtxGuard, check, cu, primary_context

_lock = threading.Lock()
_free: dict[tuple[int, int], list[int]] = {}  # (device index, priority) -> idle handles
_guards: dict[int, CtxGuard] = {}  # device index -> its primary context (retained once), made current
_key_of: dict[int, tuple[int, int]] = {}  # handle -> (device index, priority) of every stream made


def take(device: torch.device, priority: int) -> torch.cuda.ExternalStream:
    """A stream of the library's own on ``device`` (an idle one given back, or a new one)."""
    key = (int(device.index), int(priority))
    with _lock:
        free = _free.get(key)
        handle = free.pop() if free else None
        if handle is None:
            guard = _guards.get(key[0])
            if guard is None:  # torch's primary context, not synchronized: a side stream is made at
                # a group's first async call, when its streams may wait on peers
                guard = _guards[key[0]] = CtxGuard(primary_context(key[0])[1])
            with guard:
                nb = int(cu.CUstream_flags.CU_STREAM_NON_BLOCKING)
                handle = int(check(cu.cuStreamCreateWithPriority(nb, key[1]), "cuStreamCreateWithPriority(side)"))
            _key_of[handle] = key
    return torch.cuda.ExternalStream(handle, device=device)


def give_back(stream: torch.cuda.ExternalStream) -> bool:
    """Return a stream from :func:`take` for reuse, if it is idle (True); a busy one is kept
    out of circulation for good."""
    handle = int(stream.cuda_stream)
    key = _key_of.get(handle)
    if key is None:
        raise ValueError("give_back: not a stream of tide_triton.transport.own_streams.take")
    if not stream.query():
        return False
    with _lock:
        free = _free.setdefault(key, [])
        if handle not in free:
            free.append(handle)
    return True
