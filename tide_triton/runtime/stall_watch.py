"""The last word on a host wait no deadline can end: a report naming the rank, the call and
where its thread stands.

Every wait tide_triton makes on a peer has the group's deadline -- but a deadline is checked
by Python, between driver calls.  A thread stopped *inside* a driver call never gets back to
its check: on the H200 (driver 580) rank threads of one process stopped in
``cuGraphInstantiate``, ``cuGraphLaunch``, ``cuEventRecord`` and a flag read while other
ranks' streams waited for them (docs/constraints.md#graphs-made-while-peers-wait), and the process hung
without a word -- as every driver call of a process does while one of its threads is inside
a module load that waits for a stream (docs/constraints.md, the same page; the library settles
before its own loads: :mod:`tide_triton.runtime.device_wide`).  Nothing can interrupt such a call
from Python.  What this module adds: each collective call and each ``synchronize`` is a
*section* (rank, what, deadline); one daemon thread of the process looks at the open
sections and, for each still open
``FACTOR x deadline + SLACK_S`` after it began -- long past the point where every wait inside
it would have raised -- logs once (``WARNING``, logger ``tide_triton``) which rank, which call,
how long, and the innermost frames of its thread.  It changes nothing: the call may still
finish (a slow driver call), and the report says so if it does.

The watcher ends at interpreter exit (an ``atexit`` handler stops and joins it): a daemon
thread still alive when the interpreter finalizes is ended by Python with ``pthread_exit``
wherever it stands, and one that stands inside a C++ call then (torch's, reached through
a garbage collection or a destructor it runs) unwinds through a ``noexcept`` frame: the
process aborts with "terminate called without an active exception" after a correct run.
"""
from __future__ import annotations

import atexit
import itertools
import logging
import os
import sys
import threading
import time
import traceback
from typing import Any

log = logging.getLogger("tide_triton")

FACTOR = 2.0
SLACK_S = 30.0
"""A section is reported once it has been open ``FACTOR * deadline + SLACK_S`` seconds."""
_FRAMES = 6


class _Open:
    __slots__ = ("rank", "what", "deadline_s", "start", "thread", "reported")

    def __init__(self, rank: int, what: str, deadline_s: float) -> None:
        self.rank, self.what, self.deadline_s = rank, what, deadline_s
        self.start = time.monotonic()
        self.thread = threading.get_ident()
        self.reported = False


_open: dict[int, _Open] = {}
_ids = itertools.count()
_lock = threading.Lock()
_wake = threading.Condition(_lock)
_watcher: list[threading.Thread] = []
_stopped = False  # set at interpreter exit: no watcher runs, none starts
POLL_S = 1.0
"""How often the watcher looks (a section due sooner wakes it: short deadlines, tests)."""


class section:
    """``with section(rank, what, deadline_s):`` -- the block is watched (see the module);
    ``what`` names it in the report (e.g. ``"reduce_scatter (call #17)"``).  Costs a dict
    insert and delete under a lock; the watcher is not woken for it."""

    __slots__ = ("_entry", "_key")

    def __init__(self, rank: int, what: str, deadline_s: float) -> None:
        self._entry = _Open(rank, what, deadline_s)
        self._key = -1

    def __enter__(self) -> "section":
        self._key = next(_ids)
        e = self._entry
        with _lock:
            _open[self._key] = e
            if not _watcher and not _stopped:
                th = threading.Thread(target=_watch, name="tide_triton-stall-watch", daemon=True)
                _watcher.append(th)
                th.start()
            elif _due(e) < e.start + POLL_S:
                _wake.notify()
        return self

    def __exit__(self, *exc: Any) -> None:
        with _lock:
            e = _open.pop(self._key, None)
            if e is not None and e.reported:
                log.warning("tide_triton: rank %d's %s ended after %.1f s (reported as stalled above)",
                            e.rank, e.what, time.monotonic() - e.start)


def _after_fork_in_child() -> None:
    """A forked child (a DataLoader worker) has no watcher thread and may have copied the lock
    held: it starts afresh, with none of the parent's sections."""
    global _lock, _wake
    _lock = threading.Lock()
    _wake = threading.Condition(_lock)
    _watcher.clear()
    _open.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)

JOIN_AT_EXIT_S = 5.0
"""How long interpreter exit waits for the watcher to end (it is between two looks, or
writing a report)."""


def _stop_at_exit() -> None:
    """At interpreter exit, before it finalizes: the watcher ends and is joined, so no thread
    of this module is left for Python to end inside whatever call it stands in (see the
    module).  Sections still open (a thread of the caller's in a call) are no longer watched."""
    global _stopped
    _stopped = True
    if not _lock.acquire(timeout=JOIN_AT_EXIT_S):  # the watcher stuck in a report: exit all the same
        return
    try:
        threads = list(_watcher)
        _wake.notify_all()
    finally:
        _lock.release()
    for th in threads:
        th.join(JOIN_AT_EXIT_S)


atexit.register(_stop_at_exit)


def _due(e: _Open) -> float:
    return e.start + FACTOR * e.deadline_s + SLACK_S


def _watch() -> None:
    """The watcher's loop.  Reports are written holding the lock, so a section's "ended"
    line (written after it leaves, under the lock) never comes before its report."""
    while True:
        with _lock:
            if _stopped:
                return
            now = time.monotonic()
            late = [e for e in _open.values() if not e.reported and _due(e) <= now]
            if late:
                frames = sys._current_frames()
                for e in late:
                    e.reported = True
                    _report(e, frames.get(e.thread), now)
                continue
            due = min((_due(e) for e in _open.values() if not e.reported), default=now + POLL_S)
            _wake.wait(timeout=min(POLL_S, max(0.0, due - now)))


def _report(e: _Open, frame: Any, now: float) -> None:
    where = "its thread is gone"
    if frame is not None:
        stack = traceback.extract_stack(frame)[-_FRAMES:]
        where = " <- ".join(f"{s.filename.rsplit('/', 1)[-1]}:{s.lineno} "
                            f"{s.name}" for s in reversed(stack))
    log.warning("tide_triton: rank %d's %s has been on the host for %.1f s, past its %.1f s deadline with no "
                "error: a wait no deadline reaches (a CUDA driver call waiting for GPU work that a peer holds "
                "up, or a caller's own block) -- its thread is at %s", e.rank, e.what, now - e.start,
                e.deadline_s, where)
