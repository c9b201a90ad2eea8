"""The creation rounds of the CUDA transport: arguments, devices and peer access agreed over the node.

Creation is collective through ``exchange`` (an all-gather of small objects among the node's
ranks): round 1 shares every rank's error, arguments, process, socket and device
(:func:`rendezvous`); round 2 checks peer access between every pair of distinct GPUs and
reserves one address range per peer (:func:`reserve_peers`), every rank raising the same error,
naming both ranks and devices, when two cannot reach each other; the signal path is then probed
collectively (:func:`choose_signal_path`).  The single-process mode checks its placement up
front (:func:`local_placement`) and probes its signals in one process (:func:`probe_local_signals`).
"""
from __future__ import annotations

import logging
import os
import weakref
from typing import Any, Callable, Sequence

import torch

from ..runtime.checks import is_int
from . import driver
from ._once import describe, log_once, raise_if_failed
from .driver import Transaction, check
from .flags import Flags
from .handles import FdChannel
from .vmm import VmmHeap

Allgather = Callable[[Any], list]


def check_int(name: str, value: Any, low: int) -> None:
    if not is_int(value):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < low:
        raise ValueError(f"{name} must be >= {low}, got {value}")


def as_device(device: Any) -> torch.device:
    dev = torch.device("cuda", device) if isinstance(device, int) and not isinstance(device, bool) \
        else torch.device(device)
    if dev.type != "cuda":
        raise ValueError(f"device must be a cuda device, got {dev}")
    if dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def local_devices(local_size: int, count: int | None = None) -> list[torch.device]:
    """The torchrun convention for ``local_size`` ranks over the visible GPUs: rank ``r``
    on ``cuda:(r % count)`` (``count`` defaults to ``torch.cuda.device_count()``)."""
    check_int("local_size", local_size, 1)
    n = torch.cuda.device_count() if count is None else count
    if n < 1:
        raise RuntimeError("no CUDA device is visible (torch.cuda.device_count() is 0)")
    return [torch.device("cuda", r % n) for r in range(local_size)]


def placement(local_size: int, device: Any, devices: Sequence[Any] | None) -> list[torch.device]:
    """The devices of a single-process group's ranks: ``devices[r]`` for rank ``r``; else every
    rank on ``device``; else rank ``r`` on ``cuda:(r % n)`` over the ``n`` visible GPUs."""
    check_int("local_size", local_size, 1)
    if devices is not None:
        if device is not None:
            raise ValueError("give device (every rank on one GPU) or devices (one per rank), not both")
        if len(devices) != local_size:
            raise ValueError(f"devices must have local_size={local_size} entries, got {len(devices)}")
        return [as_device(d) for d in devices]
    if device is not None:
        return [as_device(device)] * local_size
    return local_devices(local_size)


def device_uuid(cu: Any, cudev: Any, index: int) -> bytes:
    try:
        return bytes(check(cu.cuDeviceGetUuid(cudev), "cuDeviceGetUuid").bytes)
    except Exception:  # noqa: BLE001 - only used to tell devices apart
        return f"ordinal-{index}".encode()


def unreachable_message(problems: Sequence[str]) -> str:
    return ("GPUs of this group cannot reach each other (no peer access): " + "; ".join(problems)
            + ". Place these ranks on GPUs with peer access (NVLink, or PCIe with P2P allowed), "
            "or on one GPU.")


def rendezvous(allgather: Allgather, channel: FdChannel | None, *, rank: int, local_size: int, options: Any,
               err: str | None, uuid: bytes, device: torch.device) -> list[dict]:
    """Round 1: every rank's error, arguments, process, socket and device."""
    o = options
    args = (local_size, o.n_flags, o.segment_bytes, o.va_bytes, o.signal_mode, o.copy_mode, o.fd_passing)
    infos = allgather({
        "err": err, "rank": rank, "args": args, "pid": os.getpid(),
        "sock": channel.name if channel is not None else b"",
        "uuid": uuid, "device": str(device),
    })
    raise_if_failed(infos, "CudaTransport setup")
    for r, info in enumerate(infos):
        if info["rank"] != r:
            raise RuntimeError(f"exchange returned rank {info['rank']}'s entry at index {r}")
        if info["args"] != args:
            raise ValueError(
                f"CudaTransport arguments differ: rank {r} has (local_size, n_flags, "
                f"segment_bytes, va_bytes, signal_mode, copy_mode, fd_passing)="
                f"{info['args']}, rank {rank} has {args}"
            )
    channel.set_peers([i["sock"] for i in infos], [i["pid"] for i in infos])  # type: ignore[union-attr]
    return infos


def access_problems(cu: Any, cudev: Any, uuid: bytes, *, rank: int, device: torch.device,
                    infos: Sequence[dict]) -> list[str]:
    """Why this rank's GPU cannot reach peers' GPUs (empty when it can reach all)."""
    n = int(check(cu.cuDeviceGetCount(), "cuDeviceGetCount"))
    by_uuid = {}
    for i in range(n):
        d = check(cu.cuDeviceGet(i), f"cuDeviceGet({i})")
        by_uuid[device_uuid(cu, d, i)] = d
    problems = []
    me = f"rank {rank} ({device})"
    for r, info in enumerate(infos):
        if info["uuid"] == uuid:
            continue  # the same GPU (or this rank): nothing to grant
        peer_dev = by_uuid.get(info["uuid"])
        them = f"rank {r} ({info['device']} in its process)"
        if peer_dev is None:  # hidden by CUDA_VISIBLE_DEVICES: cannot be checked here
            log_once("peer-dev-invisible", logging.WARNING,
                     "%s does not see %s's GPU; mapping its heap relies on the driver's "
                     "peer access", me, them)
            continue
        ok = check(cu.cuDeviceCanAccessPeer(cudev, peer_dev), f"cuDeviceCanAccessPeer(rank={rank}, peer={r})")
        if not ok:
            problems.append(f"{me} cannot access {them} (cuDeviceCanAccessPeer is 0)")
    return problems


def reserve_peers(allgather: Allgather, heap: VmmHeap, tx: Transaction, problems_of: Callable[[], list[str]], *,
                  rank: int, local_size: int) -> None:
    """Round 2: peer access checked (``problems_of``: :func:`access_problems`), one address
    range per peer; every rank raises the same error when any pair of GPUs cannot reach each
    other."""
    err, problems = None, []
    try:
        problems = problems_of()
        if not problems:
            heap.reserve_peers([p for p in range(local_size) if p != rank], tx)
    except Exception as exc:  # noqa: BLE001
        err = describe(exc)
    got = allgather({"err": err, "access": problems})
    every = [p for i in got for p in i["access"]]
    if every:
        raise RuntimeError(unreachable_message(every))
    raise_if_failed(got, "CudaTransport peer address reservation")


def choose_signal_path(allgather: Allgather, flags: Flags, *, mode: str, rank: int, local_size: int,
                       local: bool) -> str:
    """Probe, collectively, whether a stream write lands in a peer's mapped flag (the
    single-process mode probes in :func:`probe_local_signals`): ``"direct"`` or ``"copy"``."""
    if mode != "auto" or local or local_size == 1:
        return "copy" if mode == "copy" else "direct"
    peers = [p for p in range(local_size) if p != rank]
    err = flags.probe_write(peers)
    allgather(None)  # every rank's probe writes are done
    ok, why = flags.probe_read(peers, err)
    return signal_path_of(allgather({"ok": ok, "why": why}))


def signal_path_of(infos: Sequence[dict]) -> str:
    """``"direct"`` where every rank's probe words arrived, else ``"copy"`` (logged once)."""
    if all(i["ok"] for i in infos):
        log_once("signal-direct", logging.INFO, "signals write peers' flags directly "
                 "(cuStreamWriteValue64 to the peer mapping works)")
        return "direct"
    whys = "; ".join(f"rank {r}: {i['why']}" for r, i in enumerate(infos) if not i["ok"])
    log_once("signal-copy", logging.WARNING, "signals use a scratch word + 8-byte copy (%s)", whys)
    return "copy"


def probe_local_signals(members: Sequence[Flags]) -> None:
    """The signal-path probe of a single-process group over several GPUs: every member
    writes its probe word into every other member's range, then every member checks what
    arrived; all take the direct path only if every write landed (set on every member)."""
    peers_of = [[p for p in range(len(members)) if p != f.rank] for f in members]
    errs = [f.probe_write(peers_of[f.rank]) for f in members]
    infos = []
    for f, err in zip(members, errs):
        ok, why = f.probe_read(peers_of[f.rank], err)
        infos.append({"ok": ok, "why": why})
    path = signal_path_of(infos)
    for f in members:
        f.signal_path = path


def local_placement(devs: Sequence[torch.device]) -> list[int]:
    """The distinct GPU ordinals of a single-process group placed on ``devs``; raises, naming
    the ranks and devices, where two of them have no peer access."""
    distinct = sorted({d.index for d in devs})
    problems = []
    if len(distinct) > 1:
        cu = driver.init()
        handles = {i: check(cu.cuDeviceGet(i), f"cuDeviceGet({i})") for i in distinct}
        for a in distinct:
            for b in distinct:
                if a != b and not check(cu.cuDeviceCanAccessPeer(handles[a], handles[b]),
                                        f"cuDeviceCanAccessPeer(cuda:{a}, cuda:{b})"):
                    ra = [r for r, d in enumerate(devs) if d.index == a]
                    rb = [r for r, d in enumerate(devs) if d.index == b]
                    problems.append(f"rank(s) {ra} (cuda:{a}) cannot access rank(s) {rb} (cuda:{b}) "
                                    "(cuDeviceCanAccessPeer is 0)")
    if problems:
        raise RuntimeError(unreachable_message(problems))
    return distinct


class LocalGroup:
    """The members of a single-process group as each of them sees the others (weak
    references: no reference cycle among the members)."""

    def __init__(self, members: Sequence[Any]) -> None:
        self._refs = [weakref.ref(m) for m in members]

    def member(self, rank: int) -> Any:
        m = self._refs[rank]()
        if m is None:
            raise RuntimeError(f"rank {rank} of this local group no longer exists")
        return m

    def open_members(self) -> list[Any]:
        """The members alive and not closed."""
        return [m for m in (ref() for ref in self._refs) if m is not None and not m._closed]
