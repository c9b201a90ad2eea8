"""A call stuck where no deadline reaches (a thread inside a driver call) is reported, naming
the rank, the call and where its thread stands (tide_triton/runtime/stall_watch.py)."""
from __future__ import annotations

import logging
import os
import threading
import time

import pytest

import tide_triton as tt
from tide_triton.runtime import stall_watch


def _wait_for(caplog, text: str, limit_s: float) -> list[str]:
    end = time.monotonic() + limit_s
    while time.monotonic() < end:
        found = [r.getMessage() for r in caplog.records if text in r.getMessage()]
        if found:
            return found
        time.sleep(0.02)
    return []


def test_a_call_stuck_past_its_deadline_is_reported_once_naming_rank_call_and_frame(monkeypatch, caplog) -> None:
    """A thread held inside a call (standing in for a driver call that waits on the GPU) is
    reported once ``FACTOR x deadline + SLACK_S`` after the call began -- rank, collective,
    call number, and the blocking function among its frames -- and again when it ends; the
    call itself is untouched (it returns normally)."""
    monkeypatch.setattr(stall_watch, "FACTOR", 1.0)
    monkeypatch.setattr(stall_watch, "SLACK_S", 0.2)
    (g,) = tt.local_groups(1, timeout_s=0.1)
    release = threading.Event()

    def held_inside_the_driver() -> None:
        release.wait(10)

    def call() -> None:
        with g.call("reduce_scatter"):
            held_inside_the_driver()

    try:
        with caplog.at_level(logging.WARNING, logger="tide_triton"):
            th = threading.Thread(target=call)
            t0 = time.monotonic()
            th.start()
            found = _wait_for(caplog, "past its", 5.0)
            took = time.monotonic() - t0
            time.sleep(0.5)  # a second report would come within this
            release.set()
            th.join(5)
            assert not th.is_alive()
            ended = _wait_for(caplog, "ended after", 2.0)
    finally:
        release.set()
        g.close()
    assert len(found) == 1, caplog.messages
    assert 0.25 <= took < 3.0, took
    msg = found[0]
    assert "rank 0's reduce_scatter (call #1)" in msg and "0.1 s deadline" in msg, msg
    assert "held_inside_the_driver" in msg and "test_stall_watch.py" in msg, msg
    assert len([m for m in caplog.messages if "past its" in m]) == 1, caplog.messages
    assert len(ended) == 1 and "rank 0's reduce_scatter (call #1) ended after" in ended[0], ended


def test_calls_within_their_deadline_are_never_reported(monkeypatch, caplog) -> None:
    """Calls that end before their due time leave no report (the watcher looks at open ones only)."""
    monkeypatch.setattr(stall_watch, "FACTOR", 1.0)
    monkeypatch.setattr(stall_watch, "SLACK_S", 0.3)
    (g,) = tt.local_groups(1, timeout_s=0.1)
    try:
        with caplog.at_level(logging.WARNING, logger="tide_triton"):
            for _ in range(20):
                with g.call("all_gather"):
                    time.sleep(0.01)
            time.sleep(0.8)  # past every call's due time
    finally:
        g.close()
    assert not [m for m in caplog.messages if "past its" in m or "ended after" in m], caplog.messages
    assert not stall_watch._open


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_starts_afresh_even_with_the_lock_held_at_the_fork() -> None:
    """A DataLoader-style fork while another thread holds the watcher's lock: the child's
    first section neither deadlocks nor inherits the parent's open sections."""
    with stall_watch.section(0, "parent's call", 60.0):
        stall_watch._lock.acquire()
        try:
            pid = os.fork()
            if pid == 0:  # the child: one section, then out
                code = 1
                try:
                    with stall_watch.section(0, "child's call", 60.0):
                        code = 0 if len(stall_watch._open) == 1 else 2
                finally:
                    os._exit(code)
        finally:
            stall_watch._lock.release()
    end = time.monotonic() + 20
    while time.monotonic() < end:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            assert os.waitstatus_to_exitcode(status) == 0, status
            return
        time.sleep(0.05)
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    pytest.fail("the forked child deadlocked entering a section")
