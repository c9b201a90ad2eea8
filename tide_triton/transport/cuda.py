"""The CUDA transport: a symmetric VMM heap per rank, copy-engine copies, SM-free flags.

:class:`CudaTransport` is composed of three parts, each in its own module:

* :mod:`~tide_triton.transport.vmm` -- the heap: reserved addresses, physical segments,
  peers' mappings, access for every device that touches them, rollback, teardown.
* :mod:`~tide_triton.transport.handles` -- handle passing: segment fds over Unix sockets,
  ``pidfd_getfd`` as the fallback.
* :mod:`~tide_triton.transport.signals` -- copies (``cuMemcpyBatchAsync`` or a
  ``cuMemcpyAsync`` loop), flags (stream memory operations) and host waits with deadlines.

This module owns what ties them together: the options (:class:`CudaOptions`), the
collective creation (arguments, devices and errors agreed through ``exchange``; peer access
checked for every pair of distinct GPUs), heap growth as a collective round, the
single-process mode (:meth:`CudaTransport.create_local_group`) and closing.

Heap offsets (``address``, ``heap_tensor``, ``ensure_heap``) count from the heap's start, as
in the host transport: ``[0, 8 * n_flags)`` are the flags (int64 words, zeroed at creation,
values only grow); the caller lays out its data after them.  A small hidden region below
offset 0 holds the transport's own words (:class:`~.signals.HiddenWords`).

Devices: peers may share a GPU or sit on different GPUs of the node, in any mix.  Between
distinct GPUs the creation checks ``cuDeviceCanAccessPeer`` both ways and every rank raises
the same error, naming both ranks and devices, when two cannot reach each other.

Why this module is ~900 lines: over a third is the public surface (some 40 methods and
properties the executors call, most a documented one-line delegation to a part); the rest is
what needs every part at once -- creation in three exchange rounds with the peer-access checks
across devices (~200 lines), heap growth in two rounds, Slot-Reuse's release / restore of a
range, and the close that drains, releases its own stuck waits and unmaps (~70).  The parts
that stand alone are their own modules (vmm, handles, signals, views, driver).  Moving the
growth round into vmm.py would make the heap module call the exchange and the fd channel,
i.e. the heap would know its peers.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import time
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from .. import device_wide, envs
from .._checks import is_int
from ..errors import PeerTimeoutError
from . import driver
from ._once import describe, log_once, raise_if_failed, round_up
from .driver import CtxGuard, Transaction, check
from .handles import FD_PASSING, FdChannel, close_fds
from .signals import COPY_MODES, SIGNAL_MODES, CopyEngine, HiddenWords, PreparedCopies
from .views import wrap
from .vmm import SEGMENT_BYTES, VA_BYTES, VmmHeap, quiet

__all__ = ["CudaTransport", "CudaOptions", "PreparedCopies", "local_devices"]

log = logging.getLogger("tide_triton")

_DRAIN_TIMEOUT_S = 30.0
_RELEASE_DRAIN_S = 5.0
"""How long a close waits for streams released from their stuck flag waits (see
:meth:`CudaTransport._release_stuck_waits`)."""


def _check_int(name: str, value: Any, low: int) -> None:
    if not is_int(value):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < low:
        raise ValueError(f"{name} must be >= {low}, got {value}")


@dataclass(frozen=True, kw_only=True)
class CudaOptions:
    """How a :class:`CudaTransport` is built; every rank of a group must pass equal options."""

    n_flags: int = 1024
    """int64 flag words per rank (heap offsets ``[0, 8 * n_flags)``)."""
    segment_bytes: int = SEGMENT_BYTES
    """The heap grows by multiples of this (rounded up to the allocation granularity)."""
    va_bytes: int = VA_BYTES
    """Addresses reserved per rank: the most the heap can grow to."""
    signal_mode: str = "auto"
    """``"auto"`` (probe at creation), ``"direct"`` (stream writes into peers' flags) or
    ``"copy"`` (a scratch word + an 8-byte copy-engine copy)."""
    copy_mode: str = "auto"
    """``"auto"`` (``$TIDE_TRITON_COPY_MODE``, else probe), ``"batch"``
    (``cuMemcpyBatchAsync``) or ``"loop"`` (``cuMemcpyAsync`` per piece)."""
    fd_passing: str = "auto"
    """``"auto"`` (Unix socket, then ``pidfd_getfd`` for what did not arrive), ``"socket"``
    or ``"pidfd"``."""
    timeout_s: float = 120.0
    """Bound of every rendezvous step (seconds)."""

    def __post_init__(self) -> None:
        _check_int("n_flags", self.n_flags, 1)
        _check_int("segment_bytes", self.segment_bytes, 1)
        _check_int("va_bytes", self.va_bytes, 1)
        for name, value, allowed in (("signal_mode", self.signal_mode, SIGNAL_MODES),
                                     ("copy_mode", self.copy_mode, COPY_MODES),
                                     ("fd_passing", self.fd_passing, FD_PASSING)):
            if value not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {value!r}")
        if isinstance(self.timeout_s, bool) or not isinstance(self.timeout_s, (int, float)) \
                or not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s!r}")

    def resolved(self) -> "CudaOptions":
        """With ``copy_mode="auto"`` replaced by ``$TIDE_TRITON_COPY_MODE`` where set."""
        if self.copy_mode != "auto":
            return self
        return dataclasses.replace(self, copy_mode=envs.copy_mode())


def _options(options: CudaOptions | None, **given: Any) -> CudaOptions:
    """``options`` with the keywords that were given (not None) applied on top."""
    if options is not None and not isinstance(options, CudaOptions):
        raise TypeError(f"options must be a CudaOptions, got {type(options).__name__}")
    given = {k: v for k, v in given.items() if v is not None}
    base = options or CudaOptions()
    return dataclasses.replace(base, **given) if given else base


def _as_device(device: Any) -> torch.device:
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
    _check_int("local_size", local_size, 1)
    n = torch.cuda.device_count() if count is None else count
    if n < 1:
        raise RuntimeError("no CUDA device is visible (torch.cuda.device_count() is 0)")
    return [torch.device("cuda", r % n) for r in range(local_size)]


def _device_uuid(cu: Any, cudev: Any, index: int) -> bytes:
    try:
        return bytes(check(cu.cuDeviceGetUuid(cudev), "cuDeviceGetUuid").bytes)
    except Exception:  # noqa: BLE001 - only used to tell devices apart
        return f"ordinal-{index}".encode()


def _unreachable_message(problems: Sequence[str]) -> str:
    return ("GPUs of this group cannot reach each other (no peer access): " + "; ".join(problems)
            + ". Place these ranks on GPUs with peer access (NVLink, or PCIe with P2P allowed), "
            "or on one GPU.")


class CudaTransport:
    """The :class:`~tide_triton.transport.base.Transport` of one rank over CUDA.

    ``exchange(obj) -> list`` is an all-gather of small picklable objects among the
    node's ``local_size`` ranks (e.g. ``dist.all_gather_object`` on a gloo group); the
    constructor and :meth:`ensure_heap` are collective through it, and every rank's error
    is shared so a failure raises on every rank (and rolls back everywhere).

    ``device`` is this rank's GPU (peers may share it or use other GPUs of the node).
    ``options`` (:class:`CudaOptions`) sets the rest; the keywords ``n_flags`` ...
    ``timeout_s`` are kept for existing callers and override fields of ``options``.

    ``close()`` is local (no collective), idempotent, and also runs on ``with`` exit and
    (errors swallowed) in ``__del__``.  Tensors from :meth:`heap_tensor` dangle after it.
    """

    rank: int
    local_size: int
    n_flags: int
    device: torch.device
    options: CudaOptions
    leaked: bool = False
    """Set by a close that left the heap mapped because the streams did not drain."""

    def __init__(
        self,
        rank: int,
        local_size: int,
        exchange: Callable[[Any], Sequence[Any]] | None,
        *,
        device: torch.device | str | int,
        options: CudaOptions | None = None,
        n_flags: int | None = None,
        segment_bytes: int | None = None,
        va_bytes: int | None = None,
        signal_mode: str | None = None,
        copy_mode: str | None = None,
        fd_passing: str | None = None,
        timeout_s: float | None = None,
        _local_group: bool = False,
        _access_devices: Sequence[int] = (),
    ) -> None:
        self._closed = True  # until the heap exists: close() and __del__ do nothing
        _check_int("rank", rank, 0)
        _check_int("local_size", local_size, 1)
        if not rank < local_size:
            raise ValueError(f"rank must be in [0, {local_size}), got {rank}")
        opts = _options(options, n_flags=n_flags, segment_bytes=segment_bytes, va_bytes=va_bytes,
                        signal_mode=signal_mode, copy_mode=copy_mode, fd_passing=fd_passing,
                        timeout_s=timeout_s).resolved()
        if not _local_group and not callable(exchange):
            raise TypeError(f"exchange must be callable, got {type(exchange).__name__}")
        dev = _as_device(device)

        self.rank = rank
        self.local_size = local_size
        self.n_flags = opts.n_flags
        self.options = opts
        self.device = dev
        self._exchange = exchange
        self._local = _local_group
        self._generation = 0
        self._peers: list[Any] | None = None  # local group: weak references to every member
        self._channel: FdChannel | None = None
        self._words = HiddenWords.of(local_size, opts.n_flags)

        cu = driver.init()
        self._cu = cu
        with Transaction() as tx:
            err: str | None = None
            try:
                self._setup_local(tx, _access_devices)
            except Exception as exc:  # noqa: BLE001 - shared with the peers below
                if self._local:
                    raise
                err = describe(exc)
            if not self._local:
                infos = self._rendezvous(err)
                self._reserve_peers(tx, infos)
            self._sig.bases = self._bases = self._initial_bases()
            tx.on_rollback(self._heap.release_segments)
            self._grow(round_up(self._words.user_off + 8 * self.n_flags, self._heap.gran))
            self._sig.choose_copy_path(opts.copy_mode, self.local_size if self._local else 1)
            self._choose_signal_path()
            self._sig.choose_memop_path()
            self._closed = False
        if not self._local or self.local_size == 1:  # one rank in this process: see device_wide
            device_wide.register(self)

    # ------------------------------------------------------------------------------------
    # construction
    # ------------------------------------------------------------------------------------
    def _setup_local(self, tx: Transaction, access_devices: Sequence[int]) -> None:
        cu = self._cu
        self._cudev, self._ctx = driver.device_context(self.device)
        tx.on_rollback(cu.cuDevicePrimaryCtxRelease, self._cudev)
        self._guard = CtxGuard(self._ctx)
        self._heap = VmmHeap(cu, self._guard, rank=self.rank, device_index=self.device.index,
                             access_devices=access_devices, segment_bytes=self.options.segment_bytes,
                             va_bytes=self.options.va_bytes, tx=tx)
        self._sig = CopyEngine(cu, self._guard, rank=self.rank, local_size=self.local_size,
                               n_flags=self.n_flags, device=self.device, words=self._words, tx=tx)
        self._sig.own_va = self._heap.own_va
        self._uuid = _device_uuid(cu, self._cudev, self.device.index)
        if not self._local:
            self._channel = FdChannel(self.rank, self.local_size, fd_passing=self.options.fd_passing,
                                      timeout_s=self.options.timeout_s, tx=tx)

    def _allgather(self, obj: Any) -> list[Any]:
        out = list(self._exchange(obj))  # type: ignore[misc]
        if len(out) != self.local_size:
            raise RuntimeError(
                f"exchange must return local_size={self.local_size} items, got {len(out)}"
            )
        return out

    def _rendezvous(self, err: str | None) -> list[dict]:
        """Round 1: every rank's error, arguments, process, socket and device."""
        o = self.options
        args = (self.local_size, o.n_flags, o.segment_bytes, o.va_bytes, o.signal_mode,
                o.copy_mode, o.fd_passing)
        infos = self._allgather({
            "err": err, "rank": self.rank, "args": args, "pid": os.getpid(),
            "sock": self._channel.name if self._channel is not None else b"",
            "uuid": getattr(self, "_uuid", b""), "device": str(self.device),
        })
        raise_if_failed(infos, "CudaTransport setup")
        for r, info in enumerate(infos):
            if info["rank"] != r:
                raise RuntimeError(f"exchange returned rank {info['rank']}'s entry at index {r}")
            if info["args"] != args:
                raise ValueError(
                    f"CudaTransport arguments differ: rank {r} has (local_size, n_flags, "
                    f"segment_bytes, va_bytes, signal_mode, copy_mode, fd_passing)="
                    f"{info['args']}, rank {self.rank} has {args}"
                )
        self._channel.set_peers([i["sock"] for i in infos], [i["pid"] for i in infos])
        return infos

    def _access_problems(self, infos: Sequence[dict]) -> list[str]:
        """Why this rank's GPU cannot reach peers' GPUs (empty when it can reach all)."""
        cu = self._cu
        n = int(check(cu.cuDeviceGetCount(), "cuDeviceGetCount"))
        by_uuid = {}
        for i in range(n):
            d = check(cu.cuDeviceGet(i), f"cuDeviceGet({i})")
            by_uuid[_device_uuid(cu, d, i)] = d
        problems = []
        me = f"rank {self.rank} ({self.device})"
        for r, info in enumerate(infos):
            if info["uuid"] == self._uuid:
                continue  # the same GPU (or this rank): nothing to grant
            peer_dev = by_uuid.get(info["uuid"])
            them = f"rank {r} ({info['device']} in its process)"
            if peer_dev is None:  # hidden by CUDA_VISIBLE_DEVICES: cannot be checked here
                log_once("peer-dev-invisible", logging.WARNING,
                         "%s does not see %s's GPU; mapping its heap relies on the driver's "
                         "peer access", me, them)
                continue
            ok = check(cu.cuDeviceCanAccessPeer(self._cudev, peer_dev),
                       f"cuDeviceCanAccessPeer(rank={self.rank}, peer={r})")
            if not ok:
                problems.append(f"{me} cannot access {them} (cuDeviceCanAccessPeer is 0)")
        return problems

    def _reserve_peers(self, tx: Transaction, infos: Sequence[dict]) -> None:
        """Round 2: peer access checked, one address range per peer; every rank raises the
        same error when any pair of GPUs cannot reach each other."""
        err, problems = None, []
        try:
            problems = self._access_problems(infos)
            if not problems:
                self._heap.reserve_peers([p for p in range(self.local_size) if p != self.rank], tx)
        except Exception as exc:  # noqa: BLE001
            err = describe(exc)
        got = self._allgather({"err": err, "access": problems})
        every = [p for i in got for p in i["access"]]
        if every:
            raise RuntimeError(_unreachable_message(every))
        raise_if_failed(got, "CudaTransport peer address reservation")

    def _initial_bases(self) -> list[int]:
        bases = [self._heap.peer_va.get(p, 0) for p in range(self.local_size)]
        bases[self.rank] = self._heap.own_va
        return bases

    def _choose_signal_path(self) -> None:
        """Probe, collectively, whether a stream write lands in a peer's mapped flag (the
        single-process mode probes in :meth:`create_local_group`)."""
        mode = self.options.signal_mode
        if mode != "auto" or self._local or self.local_size == 1:
            self._sig.signal_path = "copy" if mode == "copy" else "direct"
            return
        peers = [p for p in range(self.local_size) if p != self.rank]
        err = self._sig.probe_write(peers)
        self._allgather(None)  # every rank's probe writes are done
        ok, why = self._sig.probe_read(peers, err)
        self._set_signal_path(self._allgather({"ok": ok, "why": why}))

    def _set_signal_path(self, infos: Sequence[dict]) -> None:
        if all(i["ok"] for i in infos):
            self._sig.signal_path = "direct"
            log_once("signal-direct", logging.INFO, "signals write peers' flags directly "
                     "(cuStreamWriteValue64 to the peer mapping works)")
        else:
            self._sig.signal_path = "copy"
            whys = "; ".join(f"rank {r}: {i['why']}" for r, i in enumerate(infos) if not i["ok"])
            log_once("signal-copy", logging.WARNING, "signals use a scratch word + 8-byte copy (%s)", whys)

    @classmethod
    def create_local_group(
        cls,
        local_size: int,
        *,
        device: torch.device | str | int | None = None,
        devices: Sequence[torch.device | str | int] | None = None,
        options: CudaOptions | None = None,
        n_flags: int | None = None,
        segment_bytes: int | None = None,
        va_bytes: int | None = None,
        signal_mode: str | None = None,
        copy_mode: str | None = None,
    ) -> list["CudaTransport"]:
        """``local_size`` transports driven from this one process.

        Placement: ``devices[r]`` for rank ``r``; else every rank on ``device`` (sharing it);
        else rank ``r`` on ``cuda:(r % n)`` over the ``n`` visible GPUs (:func:`local_devices`).
        Each rank has its own heap and copy stream; a peer's heap is addressed through the
        peer's own mapping (no fd exchange), which therefore grants access to every device
        of the group.  Distinct GPUs must have peer access (checked; the error names both
        ranks and devices).  ``ensure_heap`` is then called once per rank (each grows its
        own heap).  Close every member (or use :meth:`close_group`)."""
        _check_int("local_size", local_size, 1)
        if devices is not None:
            if device is not None:
                raise ValueError("give device (every rank on one GPU) or devices (one per rank), not both")
            if len(devices) != local_size:
                raise ValueError(f"devices must have local_size={local_size} entries, got {len(devices)}")
            devs = [_as_device(d) for d in devices]
        elif device is not None:
            devs = [_as_device(device)] * local_size
        else:
            devs = local_devices(local_size)
        opts = _options(options, n_flags=n_flags, segment_bytes=segment_bytes, va_bytes=va_bytes,
                        signal_mode=signal_mode, copy_mode=copy_mode)
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
            raise RuntimeError(_unreachable_message(problems))
        group: list[CudaTransport] = []
        with Transaction() as tx:
            for r in range(local_size):
                t = cls(r, local_size, None, device=devs[r], options=opts, _local_group=True,
                        _access_devices=distinct)
                tx.on_rollback(t.close)
                group.append(t)
            bases = [t._heap.own_va for t in group]
            for t in group:
                t._peers = [weakref.ref(m) for m in group]  # no reference cycle among members
                t._bases = t._sig.bases = list(bases)
            if len(distinct) > 1 and opts.signal_mode == "auto" and local_size > 1:
                _probe_local_signals(group)
        return group

    @staticmethod
    def close_group(group: Sequence["CudaTransport"]) -> None:
        """Close every transport of a local group (each drains all copy streams first)."""
        for t in group:
            t.close()

    # ------------------------------------------------------------------------------------
    # heap growth (collective)
    # ------------------------------------------------------------------------------------
    def ensure_heap(self, nbytes: int) -> None:
        """Collective: every heap holds at least ``nbytes`` bytes (flags included).

        Grows by whole segments (``segment_bytes`` multiples); addresses and contents stay.
        A no-op (no communication) when the heap is large enough already -- every rank
        calls it with the same ``nbytes``, so every rank makes the same decision."""
        self._check_open()
        if not is_int(nbytes):
            raise TypeError(f"nbytes must be an int, got {type(nbytes).__name__}")
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        heap = self._heap
        need = self._words.user_off + nbytes
        if need <= heap.mapped:
            return
        new_mapped = heap.mapped + round_up(need - heap.mapped, heap.segment_bytes)
        if new_mapped > heap.va_bytes:
            raise ValueError(
                f"nbytes={nbytes} needs {new_mapped} bytes of heap, more than the "
                f"va_bytes={heap.va_bytes} reserved per rank"
            )
        self._grow(new_mapped)

    def heap_nbytes(self) -> int:
        """Bytes in this rank's heap, flags included (offsets go up to this)."""
        return max(0, self._heap.mapped - self._words.user_off)

    def _mapped_of(self, rank: int) -> int:
        if self._peers is None:
            return self._heap.mapped
        peer = self._peers[rank]()
        if peer is None:
            raise RuntimeError(f"rank {rank} of this local group no longer exists")
        return peer._heap.mapped

    def _grow(self, new_mapped: int) -> None:
        """Map ``[mapped, new_mapped)`` on every rank (:meth:`_map_round`) and record it."""
        offset = self._heap.mapped
        size = new_mapped - offset
        handle = self._map_round(offset, size)
        self._heap.commit_segment(offset, size, handle)

    def _map_round(self, offset: int, size: int) -> Any:
        """Map ``size`` bytes at mapping offset ``offset`` on every rank: create + export, pass
        the fds, import; two exchange rounds, and everything of this round undone on every
        rank if any fails.  Returns the own allocation handle (the caller records it)."""
        heap = self._heap
        self._generation += 1
        gen = self._generation
        tx = Transaction()
        own_fd = -1
        err = None
        handle = None
        peers = [p for p in range(self.local_size) if p != self.rank] if not self._local else []
        sent: list[int] = []
        try:
            handle = heap.create_segment(offset, size, tx)
            if offset == 0:  # probe, scratch and flag words start at zero
                self._sig.zero_words(self._words.user_off + 8 * self.n_flags)
            if peers:
                own_fd = heap.export(handle)
                sent = self._channel.send(own_fd, gen, peers)
        except Exception as exc:  # noqa: BLE001 - shared with the peers
            if self._local:
                tx.rollback()
                raise
            err = describe(exc)

        if self._local:
            tx.commit()
            return handle

        try:
            infos = self._allgather({"err": err, "fd": own_fd, "size": size, "offset": offset,
                                     "gen": gen, "sent": sent})
            expected = {p for p in peers if self.rank in infos[p]["sent"]}
            bad = [r for r, i in enumerate(infos) if (i["size"], i["offset"], i["gen"])
                   != (size, offset, gen)]
            failed = bad or any(i["err"] for i in infos)
            fds: dict[int, int] = {}
            err2 = None
            try:
                fds = self._channel.recv(expected, gen)
                if failed:
                    raise_if_failed(infos, "CudaTransport heap growth")
                    raise ValueError(
                        "ensure_heap disagrees across ranks: (size, offset, generation) = "
                        + ", ".join(f"rank {r}: {(infos[r]['size'], infos[r]['offset'], infos[r]['gen'])}"
                                    for r in bad)
                    )
                self._channel.fill_missing(fds, peers, [i["fd"] for i in infos])
                for p in peers:
                    heap.import_segment(p, fds[p], offset, size, tx)
            except Exception as exc:  # noqa: BLE001
                if failed:
                    raise
                err2 = describe(exc)
            finally:
                close_fds(fds.values())
            # Second round: every rank has imported (or failed); the exporter's fd may go.
            raise_if_failed(self._allgather({"err": err2}), "CudaTransport heap import")
        except BaseException:
            tx.rollback()
            raise
        finally:
            if own_fd >= 0:
                os.close(own_fd)
        tx.commit()
        return handle

    # ------------------------------------------------------------------------------------
    # release / restore of whole segments (collective; Slot-Reuse between steps)
    # ------------------------------------------------------------------------------------
    def busy_error(self, what: str) -> BaseException:
        """The error for a device wait past its deadline: ``PeerTimeoutError`` naming a peer
        that this rank's pending stream waits wait for, else ``TimeoutError``."""
        peers = self._sig.stuck_peers()
        if peers:
            return PeerTimeoutError(min(peers), f"{what}: this rank's streams wait for ranks {sorted(peers)}",
                                    self.options.timeout_s)
        return TimeoutError(f"rank {self.rank}: {what} after {self.options.timeout_s:.1f} s")

    def settle_device_wide(self, what: str) -> None:
        """Before ``what``, a driver call that waits for every stream of this process
        (:mod:`tide_triton.device_wide`): wait, with the group's deadline, until this rank's
        streams are idle -- what that call would wait for anyway, but ending in
        ``PeerTimeoutError`` naming the peer they wait for, not in a thread stopped inside
        the driver."""
        if self._closed:
            return
        if not self._drain(self.options.timeout_s):
            raise self.busy_error(f"before {what}, which waits for every stream of this process")

    def _user_range(self, offset: int, nbytes: int) -> tuple[int, int]:
        for name, v, low in (("offset", offset, 0), ("nbytes", nbytes, 1)):
            _check_int(name, v, low)
        start = self._words.user_off + offset
        return start, start + nbytes

    def release_range(self, offset: int, nbytes: int) -> None:
        """Collective over the node: unmap heap bytes ``[offset, offset + nbytes)`` (whole
        segments, else ValueError on every rank) on every rank -- its own mapping and its
        mappings of every peer's -- and release their physical memory.  Blocks until every
        stream that may touch the heaps is idle (the device too) first.  The addresses stay
        reserved: :meth:`restore_range` maps new memory there (contents are not kept).  In
        the single-process mode each rank's call releases its own range; the caller orders
        the ranks (no rank may still address a peer's range)."""
        self._check_open()
        start, end = self._user_range(offset, nbytes)
        err = None
        try:
            self._heap.spans_in(start, end)
            devs = {self.device}
            if self._peers is not None:
                devs |= {t.device for t in (ref() for ref in self._peers) if t is not None and not t._closed}
            for d in devs:  # with a deadline: a stream stuck on a dead peer's flag never ends
                driver.wait_with_deadline(lambda d=d: torch.cuda.synchronize(d), self.options.timeout_s,
                                          lambda d=d: self.busy_error(f"release_range: {d} still busy"))
            if not self._drain(self.options.timeout_s):
                raise self.busy_error("release_range: streams still busy")
        except Exception as exc:  # noqa: BLE001 - shared with the peers
            if self._local:
                raise
            err = describe(exc)
        if not self._local:  # every rank is idle before anyone unmaps
            raise_if_failed(self._allgather({"err": err}), "CudaTransport release_range")
        self._heap.unmap_range(start, end)

    def restore_range(self, offset: int, nbytes: int) -> None:
        """Collective over the node: map new memory at the released segments of ``[offset,
        offset + nbytes)`` on every rank and every peer's mapping of them (the same addresses,
        so existing views stay valid; the contents are undefined).  A no-op for segments that
        are mapped; every rank must have released the same ones."""
        self._check_open()
        start, end = self._user_range(offset, nbytes)
        spans = self._heap.released_in(start, end)
        if not self._local:
            infos = self._allgather({"spans": spans})
            bad = [r for r, i in enumerate(infos) if i["spans"] != spans]
            if bad:
                raise RuntimeError(f"restore_range({offset}, {nbytes}): ranks {bad} released other segments "
                                   f"than rank {self.rank} ({spans}); release and restore on every rank alike")
        for off, size in spans:
            self._heap.restore_segment(off, size, self._map_round(off, size))

    # ------------------------------------------------------------------------------------
    # addresses and views
    # ------------------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"CudaTransport(rank={self.rank}) is closed")

    @property
    def rank_offset(self) -> int:
        """Added to rank numbers in errors and timeouts: a node-local transport of a
        several-node group names global ranks (set by the owner after creation)."""
        return self._sig.rank_offset if hasattr(self, "_sig") else 0

    @rank_offset.setter
    def rank_offset(self, value: int) -> None:
        self._sig.rank_offset = value

    @property
    def copy_path(self) -> str:
        """``"batch"`` or ``"loop"``: how :meth:`copy` enqueues (decided at creation)."""
        return self._sig.copy_path

    @property
    def signal_path(self) -> str:
        """``"direct"`` or ``"copy"``: how :meth:`signal` reaches a peer's flag."""
        return self._sig.signal_path

    @property
    def _pending(self) -> dict:
        return self._sig._pending

    def address(self, rank: int, offset: int) -> int:
        """Address, in this process, of byte ``offset`` of ``rank``'s heap (0 = flag 0)."""
        self._sig.check_rank("rank", rank)
        return self._bases[rank] + self._words.user_off + offset

    def heap_ptr(self, rank: int, offset: int = 0) -> int:
        """Same as :meth:`address`."""
        return self.address(rank, offset)

    def flag_ptr(self, rank: int, slot: int) -> int:
        """Address, in this process, of flag word ``slot`` of ``rank``."""
        self._sig.check_rank("rank", rank)
        self._sig.check_slot(slot)
        return self._sig.flag_addr(rank, slot)

    def heap_tensor(self, rank: int, offset: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A 1-D ``dtype`` tensor viewing ``numel`` elements of ``rank``'s heap at byte
        ``offset`` (no copy; valid until :meth:`close`).  The tensor is on this rank's
        device, also when ``rank``'s memory sits on another GPU (read over peer access)."""
        self._check_open()
        self._sig.check_rank("rank", rank)
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"dtype must be a torch.dtype, got {type(dtype).__name__}")
        item = dtype.itemsize
        if not is_int(offset) or offset < 0 or offset % item:
            raise ValueError(f"offset must be a non-negative multiple of {item} (the size of "
                             f"{dtype}), got {offset!r}")
        if not is_int(numel) or numel < 0:
            raise ValueError(f"numel must be a non-negative int, got {numel!r}")
        nbytes = numel * item
        size = self._mapped_of(rank) - self._words.user_off
        if offset + nbytes > size:
            raise ValueError(f"offset + numel * {item} = {offset + nbytes} exceeds rank {rank}'s "
                             f"heap of {size} bytes (call ensure_heap first)")
        if numel == 0:
            return torch.empty(0, dtype=dtype, device=self.device)
        return wrap(self.heap_ptr(rank, offset), nbytes, self.device).view(dtype)

    # ------------------------------------------------------------------------------------
    # streams, copies, flags (see signals.py)
    # ------------------------------------------------------------------------------------
    @property
    def copy_stream(self) -> torch.cuda.Stream:
        """The stream every copy (and, by default, every signal and wait) goes on."""
        return self._sig.copy_stream

    def on_copy_queue(self, fn: Callable[[Any], None]) -> None:
        """Call ``fn(copy stream)`` (a kernel launch on that stream): its work runs in the copy
        queue's order, after the flag waits and copies enqueued there before.  The caller holds
        the device current (a collective's run, under its compute stream)."""
        fn(self._sig.copy_stream)

    strided_copies = True
    """:meth:`prepare_copies` takes strided runs (``cuMemcpy2DAsync``; on one GPU with wide rows
    ``cuMemcpy3DAsync`` of sub-rows, :func:`~tide_triton.transport.signals.sub_row_bytes`)."""

    def prepare_copies(self, dsts: Sequence[int], srcs: Sequence[int], nbytes: Sequence[int], *,
                       strided: Sequence[Any] = ()) -> PreparedCopies:
        """Check and convert a list of copies once, for :meth:`copy_prepared` to enqueue many
        times (converting addresses to driver objects costs ~10x the enqueue itself).
        ``strided``: runs ``(dst, src, nbytes, rows, dst_pitch, src_pitch)`` of equal rows
        (:class:`tide_triton.executor.Strided`), one ``cuMemcpy2DAsync`` / ``cuMemcpy3DAsync`` each."""
        return self._sig.prepare_copies(dsts, srcs, nbytes, strided=strided)

    def copy_prepared(self, prepared: PreparedCopies, *, stream: torch.cuda.Stream | None = None,
                      capturable: bool = False) -> None:
        """:meth:`copy` of a :meth:`prepare_copies` result (``capturable``: the copy stream is
        being captured into a CUDA graph -- one ``cuMemcpy2DAsync`` / ``3DAsync`` / ``cuMemcpyAsync`` per
        descriptor, which capture records, instead of the batch call or a graph launch)."""
        self._check_open()
        self._sig.copy_prepared(prepared, stream=stream, capturable=capturable)

    def warm_replays(self, lists: Sequence[Any]) -> None:
        """Capture, before the collective enqueues flag waits, the prepared lists that will
        be replayed as graphs this time (see :meth:`CopyEngine.warm_replays`)."""
        self._check_open()
        self._sig.warm_replays(lists)

    def replays(self, prepared: PreparedCopies) -> bool:
        """Whether ``prepared`` is launched as one captured graph (from its second or third
        use on, ``$TIDE_TRITON_COPY_GRAPHS``): one queue entry, nothing to pace."""
        return prepared.replay.get("graph") is not None

    def copy(self, dsts: Sequence[int], srcs: Sequence[int], nbytes: Sequence[int], *,
             stream: torch.cuda.Stream | None = None) -> None:
        """Enqueue byte copies ``srcs[i] -> dsts[i]`` (addresses) on the copy stream (or
        ``stream``), after everything already on it.  Pieces of one call may run in any
        order relative to each other.  Producers of the sources must be ordered before
        (:meth:`fence_from`); consumers wait with :meth:`fence_to` or a flag.  Each piece must
        lie inside one allocation on either side (a tensor's bytes: the driver refuses a copy
        across two); :meth:`prepare_copies` cuts lists that may not.
        """
        self._check_open()
        # raw pieces, each inside one tensor: no allocation cut (nor its driver queries) per call
        self._sig.copy_prepared(self._sig.prepare_copies(dsts, srcs, nbytes, cut=False), stream=stream)

    def signal(self, rank: int, slot: int, value: int, *,
               stream: torch.cuda.Stream | None = None) -> None:
        """After everything enqueued before it on the copy stream (or ``stream``), write
        ``value`` into flag ``slot`` of ``rank``.  Values of one flag must only grow."""
        self._check_open()
        self._sig.signal(rank, slot, value, stream=stream)

    def signal_all(self, ranks: Sequence[int], slots: Sequence[int], values: Sequence[int], *,
                   stream: torch.cuda.Stream | None = None) -> None:
        """:meth:`signal` to several flags (of several ranks) in one driver call."""
        self._check_open()
        self._sig.signal_all(ranks, slots, values, stream=stream)

    def wait(self, slot: int, value: int, *, peer: int, timeout_s: float,
             stream: torch.cuda.Stream | None = None, what: str = "") -> None:
        """Work enqueued later on the copy stream (or ``stream``) waits until local flag
        ``slot`` is >= ``value`` (set by ``peer``).  The stream cannot time out by itself:
        :meth:`synchronize` (or :meth:`host_wait_flag`) raises ``PeerTimeoutError(peer)``
        once ``timeout_s`` has passed."""
        self._check_open()
        self._sig.wait(slot, value, peer=peer, timeout_s=timeout_s, stream=stream, what=what)

    def wait_all(self, slots: Sequence[int], values: Sequence[int], *, peers: Sequence[int],
                 timeout_s: float, stream: torch.cuda.Stream | None = None, what: str = "") -> None:
        """:meth:`wait` on several local flags in one driver call (``cuStreamBatchMemOp``;
        one ``cuStreamWaitValue64`` each where batches are refused).  ``what`` may hold
        ``{peer}``."""
        self._check_open()
        self._sig.wait_all(slots, values, peers=peers, timeout_s=timeout_s, stream=stream, what=what)

    def wait_all_equal(self, slots: Sequence[int], values: Sequence[int], *, peers: Sequence[int],
                       timeout_s: float, stream: torch.cuda.Stream | None = None, what: str = "") -> None:
        """:meth:`wait_all` for exactly each value (``CU_STREAM_WAIT_VALUE_EQ``): the call
        identities of :meth:`tide_triton.group.Group.check_in`, which a peer's later call
        must not satisfy."""
        self._check_open()
        self._sig.wait_all(slots, values, peers=peers, timeout_s=timeout_s, stream=stream, what=what, equal=True)

    def recording_waits(self):
        """``with t.recording_waits() as waits:`` the flag waits enqueued meanwhile -- a run
        being recorded into a graph -- go into ``waits``, not into this rank's pending waits
        (nothing waits until a replay: :meth:`note_waits`); their progress words are the
        recording's own (entered before the capture begins: it sets them aside)."""
        return self._sig.recording_waits()

    def recording_started(self, stream: torch.cuda.Stream) -> None:
        """Right after a recording's capture began on ``stream``, before anything else is
        recorded: the graph's first node writes the recording's progress words to 0, so each
        replay's waits count as not passed until they do (see
        :meth:`CopyEngine.recording_started <tide_triton.transport.signals.CopyEngine.recording_started>`)."""
        self._check_open()
        self._sig.recording_started(stream)

    def recording_stream(self) -> torch.cuda.Stream:
        """This rank's own stream for recording prepared runs (not a pooled one)."""
        return self._sig.recording_stream()

    def launch_graph_exec(self, handle: int, stream: torch.cuda.Stream) -> None:
        """Launch an instantiated CUDA graph (its ``cudaGraphExec_t``) on ``stream``."""
        self._check_open()
        self._sig.launch_graph_exec(handle, stream)

    def stream_capturing(self, stream: torch.cuda.Stream | None) -> bool:
        """Whether ``stream`` (default: the current stream of this rank's device) is being
        captured into a CUDA graph -- one driver call, where torch's query costs several.  The
        answer holds for this thread's wait batches until its next query: under a capture they
        write no progress word (a prepared run asks before each run)."""
        return self._sig.stream_capturing(stream if stream is not None else torch.cuda.current_stream(self.device))

    def user_capture_ended(self) -> None:
        """A prepared run inside a user's capture is enqueued whole: this thread's waits get
        progress words again (see :meth:`stream_capturing`)."""
        self._sig.user_capture_ended()

    def note_waits(self, waits: dict, stream: torch.cuda.Stream) -> None:
        """A replay of a graph holding ``waits`` (:meth:`recording_waits`) was launched on
        ``stream``: its waits are pending there (what :meth:`synchronize` names when stuck)."""
        self._sig.note_waits(waits, stream)

    def fence_from(self, stream: torch.cuda.Stream | None = None) -> None:
        """The copy stream waits for work already enqueued on ``stream`` (default: the
        current stream of this device)."""
        self._check_open()
        src = torch.cuda.current_stream(self.device) if stream is None else stream
        sig = self._sig
        sig.stream_waits_for(sig.copy_stream_int, sig.stream_int(src))

    def fence_to(self, stream: torch.cuda.Stream | None = None) -> None:
        """``stream`` (default: the current stream of this device) waits for work already
        enqueued on the copy stream."""
        self._check_open()
        dst = torch.cuda.current_stream(self.device) if stream is None else stream
        sig = self._sig
        sig.stream_waits_for(sig.stream_int(dst), sig.copy_stream_int)

    def mark(self) -> torch.cuda.Event:
        """An event recorded on the copy stream now (see :meth:`wait_mark`)."""
        self._check_open()
        return self._sig.copy_stream.record_event()

    def wait_mark(self, mark: torch.cuda.Event | None, stream: torch.cuda.Stream | None = None) -> None:
        """``stream`` (default: the current stream) waits for ``mark`` (a :meth:`mark` event)."""
        if mark is not None:
            (torch.cuda.current_stream(self.device) if stream is None else stream).wait_event(mark)

    def session(self) -> CtxGuard:
        """``with t.session():`` -- hold this transport's context current across many
        enqueues (each one then skips its own push/pop)."""
        return self._guard

    # ------------------------------------------------------------------------------------
    # host-side waits
    # ------------------------------------------------------------------------------------
    def host_wait_event(self, event: Any, *, timeout_s: float) -> None:
        """Block the host until ``event`` (a ``torch.cuda.Event``) has completed -- the
        pacing of a long collective, so the host never runs more than a few chunks ahead
        of the GPU.  After ``timeout_s``, raises ``PeerTimeoutError`` naming the peer of a
        pending flag wait that is still short."""
        self._sig.host_wait_event(event, timeout_s=timeout_s)

    def read_flag(self, slot: int, rank: int | None = None) -> int:
        """Current value of flag ``slot`` of ``rank`` (default: this rank), read from the
        host on a private stream (never waits for the copy stream)."""
        self._check_open()
        return self._sig.read_flag(slot, rank)

    def host_wait_flag(self, slot: int, value: int, peer: int, timeout_s: float,
                       what: str = "") -> int:
        """Block the host until local flag ``slot`` >= ``value``; returns the value read.
        Raises ``PeerTimeoutError(peer)`` after ``timeout_s`` (``what`` says what for)."""
        return self._sig.host_wait_flag(slot, value, peer, timeout_s, what)

    def synchronize(self, *, timeout_s: float, stream: torch.cuda.Stream | None = None,
                    poll: Callable[[], None] | None = None) -> None:
        """Block the host until the copy stream (or ``stream``) is idle.  After
        ``timeout_s``, raises ``PeerTimeoutError`` naming the peer of a pending
        :meth:`wait` whose flag is still short, else ``TimeoutError``.  ``poll`` runs every
        50 ms of the wait and may raise (the group's look for a peer's published abort)."""
        self._check_open()
        self._sig.synchronize(timeout_s=timeout_s, stream=stream, poll=poll)

    # ------------------------------------------------------------------------------------
    # teardown
    # ------------------------------------------------------------------------------------
    def _drain(self, timeout_s: float) -> bool:
        """Wait (polling, bounded) until every stream that may touch the heaps is idle --
        in the single-process mode also every open member's (queried in its own context,
        which may be another GPU's)."""
        deadline = time.monotonic() + timeout_s
        members = [self]
        if self._peers is not None:
            members += [t for t in (ref() for ref in self._peers)
                        if t is not None and t is not self and not t._closed]
        return all(t._sig.drain(t._sig.busy_streams(), deadline) for t in members)

    def close(self, *, drain_timeout_s: float = _DRAIN_TIMEOUT_S,
              may_release: Callable[[set[int]], bool] | None = None) -> None:
        """Unmap and free everything this rank holds (local; idempotent).  Waits up to
        ``drain_timeout_s`` (30 s) for the copy streams.  If they do not drain,
        ``may_release`` is given (a broken group's close) and it returns True for the peers
        the stuck waits wait for (global ranks) -- they abandoned their calls and will
        neither signal nor consume any more -- this rank's own pending waits are released
        (:meth:`_release_stuck_waits`: else the streams, and every later device-wide
        synchronize of the process, wait forever).  Never for a peer that may only be slow:
        the released work would push into its slots before it has read them.  If the
        streams still do not drain, the memory is leaked instead of unmapped under running
        copies."""
        if self._closed:
            return
        self._closed = True
        device_wide.unregister(self)
        if not self._drain(drain_timeout_s) and not (may_release is not None
                                                     and self._release_stuck_waits(may_release)):
            log.error("rank %d: streams still busy after %.0f s at close; "
                      "leaking the heap rather than unmapping it under running work",
                      self.rank, drain_timeout_s)
            self.leaked = True
            return
        self._heap.release_segments()
        self._heap.free_ranges()
        self._sig.close(quiet)
        quiet(self._release_ctx)
        if self._channel is not None:
            self._channel.close()

    def _release_stuck_waits(self, may_release: Callable[[set[int]], bool]) -> bool:
        """Streams still busy at close: if ``may_release`` allows it for the peers of the
        short waits, release this rank's own pending flag waits
        (:meth:`SignalPaths.release_own_waits`) and drain again, briefly.  True when the
        streams are idle then (the heap can be unmapped)."""
        deadline = time.monotonic() + _RELEASE_DRAIN_S
        try:
            peers = self._sig.stuck_peers()
            if not peers or not may_release(peers):
                log.error("rank %d: streams stuck on flag waits for ranks %s, which have not all abandoned "
                          "their calls: not released", self.rank, sorted(peers))
                return False
            n = self._sig.release_own_waits(deadline)
        except Exception as e:  # noqa: BLE001 - close never raises for this; it leaks instead
            log.error("rank %d: could not release its stuck flag waits at close: %s", self.rank, e)
            return False
        if n == 0:
            return False
        idle = self._drain(max(0.0, deadline - time.monotonic()))
        log.warning("rank %d: released %d stuck flag wait(s) at close; streams %s", self.rank, n,
                    "idle" if idle else "still busy")
        return idle

    def _release_ctx(self) -> None:
        check(self._cu.cuDevicePrimaryCtxRelease(self._cudev), "cuDevicePrimaryCtxRelease")

    def __enter__(self) -> "CudaTransport":
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            if not getattr(self, "_closed", True):
                self.close()
        except Exception:  # noqa: BLE001 - never raise from a finaliser
            pass

    def __repr__(self) -> str:
        if not hasattr(self, "_sig"):
            return f"CudaTransport(rank={self.rank}, local_size={self.local_size}, not created)"
        state = "closed" if self._closed else f"heap={self.heap_nbytes()}"
        return (f"CudaTransport(rank={self.rank}, local_size={self.local_size}, "
                f"device={self.device}, {state}, copy={self.copy_path}, "
                f"signal={self.signal_path})")


def _probe_local_signals(group: Sequence[CudaTransport]) -> None:
    """The signal-path probe of a single-process group over several GPUs: every member
    writes its probe word into every other member's range, then every member checks what
    arrived; all take the direct path only if every write landed."""
    peers_of = [[p for p in range(len(group)) if p != t.rank] for t in group]
    errs = [t._sig.probe_write(peers_of[t.rank]) for t in group]
    infos = []
    for t, err in zip(group, errs):
        ok, why = t._sig.probe_read(peers_of[t.rank], err)
        infos.append({"ok": ok, "why": why})
    for t in group:
        t._set_signal_path(infos)
