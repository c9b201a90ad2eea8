"""Handle passing: a VMM segment's POSIX file descriptor from its exporter to every peer.

Each rank of a multi-process CUDA transport listens on an abstract Unix socket (its name
travels in the transport's setup exchange).  A new heap segment's fd goes to every peer over
the socket (``SCM_RIGHTS``); whatever did not arrive within the timeout is fetched with
``pidfd_getfd`` from the exporter's process (Linux >= 5.6, needs ptrace rights), unless
``fd_passing`` forbids it.  Messages carry the sender's rank and a generation number, so a
stale fd from a failed earlier round is closed, never mapped.  Nothing here touches CUDA.
"""
from __future__ import annotations

import ctypes
import logging
import os
import socket
import struct
import time
import uuid
from typing import Any, Sequence

from ._once import log_once
from .driver import Transaction

FD_PASSING = ("auto", "socket", "pidfd")
"""``auto``: the socket, then ``pidfd_getfd`` for what did not arrive; or only one of them."""

_HEADER = struct.Struct("<qqq")  # magic, sender rank, generation
_FD_MAGIC = 0x7469_6465_6664  # "tidefd"
_SYS_PIDFD_GETFD = 438  # same number on every Linux architecture (generic syscall table)


def close_fds(fds: Any) -> None:
    """Close every fd of ``fds``, ignoring ones already closed."""
    for fd in list(fds):
        try:
            os.close(fd)
        except OSError:
            pass


def pidfd_getfd(pid: int, remote_fd: int) -> int:
    """A duplicate of ``remote_fd`` of process ``pid`` (Linux >= 5.6, needs ptrace rights)."""
    if not hasattr(os, "pidfd_open"):
        raise RuntimeError("pidfd_getfd fallback needs os.pidfd_open (Linux, Python >= 3.9)")
    pidfd = os.pidfd_open(pid)
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.syscall.restype = ctypes.c_long
        fd = libc.syscall(
            ctypes.c_long(_SYS_PIDFD_GETFD), ctypes.c_int(pidfd), ctypes.c_int(remote_fd),
            ctypes.c_uint(0),
        )
        if fd < 0:
            err = ctypes.get_errno()
            raise OSError(err, f"pidfd_getfd(pid={pid}, fd={remote_fd}): {os.strerror(err)}")
        return int(fd)
    finally:
        os.close(pidfd)


class FdChannel:
    """This rank's end of the fd passing: a listening socket (closed on rollback of ``tx``
    or by :meth:`close`), and the peers' socket names and process ids once known."""

    def __init__(self, rank: int, local_size: int, *, fd_passing: str, timeout_s: float,
                 tx: Transaction) -> None:
        if fd_passing not in FD_PASSING:
            raise ValueError(f"fd_passing must be one of {FD_PASSING}, got {fd_passing!r}")
        self.rank = rank
        self.fd_passing = fd_passing
        self.timeout_s = timeout_s
        self.names: list[bytes] = []
        self.pids: list[int] = []
        lst = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        tx.on_rollback(lst.close)
        self.name = f"\0tide_triton.{os.getpid()}.{rank}.{uuid.uuid4().hex}".encode()
        lst.bind(self.name)
        lst.listen(max(64, 2 * local_size))
        self._listener: socket.socket | None = lst

    def set_peers(self, names: Sequence[bytes], pids: Sequence[int]) -> None:
        """Every rank's socket name and process id (from the setup exchange), by rank."""
        self.names = list(names)
        self.pids = list(pids)

    def send(self, fd: int, gen: int, peers: Sequence[int]) -> list[int]:
        """Send ``fd`` to every peer's socket; returns the peers it reached (failures are
        logged once and left to :meth:`fetch`)."""
        if self.fd_passing == "pidfd":
            return []
        header = _HEADER.pack(_FD_MAGIC, self.rank, gen)
        sent = []
        for p in peers:
            try:
                with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                    s.settimeout(self.timeout_s)
                    s.connect(self.names[p])
                    socket.send_fds(s, [header], [fd])
                sent.append(p)
            except OSError as exc:
                log_once(f"send-{type(exc).__name__}", logging.WARNING,
                         "sending a heap fd from rank %d to rank %d over a Unix "
                         "socket failed (%s)", self.rank, p, exc)
        return sent

    def recv(self, expected: set[int], gen: int) -> dict[int, int]:
        """Accept fds from ``expected`` senders of generation ``gen`` until all came or the
        timeout passed; stale ones are closed."""
        got: dict[int, int] = {}
        if not expected:
            return got
        deadline = time.monotonic() + self.timeout_s
        lst = self._listener
        if lst is None:
            raise RuntimeError(f"rank {self.rank}: the fd channel is closed")
        try:
            while expected - got.keys():
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                lst.settimeout(remaining)
                try:
                    conn, _ = lst.accept()
                except (socket.timeout, TimeoutError):
                    break
                with conn:
                    conn.settimeout(max(1.0, remaining))
                    msg, fds, _, _ = socket.recv_fds(conn, _HEADER.size, 4)
                ok = len(msg) == _HEADER.size and len(fds) == 1
                if ok:
                    magic, sender, g = _HEADER.unpack(msg)
                    ok = magic == _FD_MAGIC and g == gen and sender in expected and sender not in got
                if ok:
                    got[sender] = fds[0]
                else:
                    close_fds(fds)  # a stale message from a failed earlier round
        except BaseException:
            close_fds(got.values())
            raise
        return got

    def fill_missing(self, got: dict[int, int], peers: Sequence[int], remote_fds: Sequence[int]) -> None:
        """Fetch, with ``pidfd_getfd``, the fd of every peer whose message did not come
        (``remote_fds[p]`` is the number peer ``p`` exported); raise where ``fd_passing``
        is ``"socket"``."""
        missing = [p for p in peers if p not in got]
        if missing and self.fd_passing == "socket":
            raise RuntimeError(f"no heap fd from rank(s) {missing} over the Unix socket "
                               f"within {self.timeout_s} s")
        for p in missing:
            if self.fd_passing == "auto":
                log_once("pidfd", logging.WARNING,
                         "heap fd of rank %d did not come over the Unix socket; using pidfd_getfd", p)
            got[p] = pidfd_getfd(self.pids[p], remote_fds[p])

    def close(self) -> None:
        """Close the listening socket (idempotent)."""
        if self._listener is not None:
            self._listener.close()
            self._listener = None
