"""The reports for bounded test runs (bench/gpu_tests.sh, tests/conftest.py): a failure is
written the moment it happens, and a test still running after the given seconds leaves its
threads' stacks -- so a run stopped at its time limit still says what failed and where a stuck
test waits.  Runs pytest on two small tests with this conftest, in a child process.  Also the
helpers of tests/_dist.py: rendezvous without port races, late rank threads shown with stacks."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

_DEMO = '''
import time

def test_that_fails():
    assert 6 * 7 == 43, "the answer"

def test_that_is_stuck():
    time.sleep(3)

def test_out_of_memory():
    raise RuntimeError("CUDA error: out of memory")
'''


def test_failures_and_stuck_stacks_are_written_as_they_happen(tmp_path: Path) -> None:
    here = Path(__file__).parent
    shutil.copy(here / "conftest.py", tmp_path / "conftest.py")
    shutil.copy(here / "_dist.py", tmp_path / "_dist.py")
    (tmp_path / "test_demo.py").write_text(_DEMO)
    env = dict(os.environ, TIDE_TRITON_TEST_FAILURES=str(tmp_path / "failures.txt"),
               TIDE_TRITON_TEST_STACKS=f"{tmp_path / 'stacks'}:1")
    env.pop("PYTEST_XDIST_WORKER", None)
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_demo.py"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert "2 failed, 1 passed" in run.stdout, run.stdout + run.stderr
    failures = (tmp_path / "failures.txt").read_text()
    assert failures.count("==== FAILED test_demo.py::test_that_fails (call,") == 1
    assert "AssertionError: the answer" in failures
    assert "test_that_is_stuck" not in failures
    # running out of GPU memory also says who held it (or why that could not be read)
    oom = failures.split("==== FAILED test_demo.py::test_out_of_memory", 1)[1]
    assert "---- GPU memory at the failure" in oom
    stacks = (tmp_path / "stacks.main").read_text()
    assert "test_demo.py::test_that_is_stuck" in stacks
    assert "most recent call first" in stacks and 'test_demo.py", line 8 in test_that_is_stuck' in stacks
    assert stacks.count("most recent call first") == 1  # the quick tests armed and disarmed it


def test_failures_are_written_once_under_xdist(tmp_path: Path) -> None:
    """xdist forwards a worker's reports to its controller: the report is written once."""
    import pytest

    pytest.importorskip("xdist")
    here = Path(__file__).parent
    shutil.copy(here / "conftest.py", tmp_path / "conftest.py")
    shutil.copy(here / "_dist.py", tmp_path / "_dist.py")
    (tmp_path / "test_demo.py").write_text(_DEMO.replace("time.sleep(3)", "pass"))
    env = dict(os.environ, TIDE_TRITON_TEST_FAILURES=str(tmp_path / "failures.txt"))
    env.pop("PYTEST_XDIST_WORKER", None)
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2", "test_demo.py"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert "2 failed, 1 passed" in run.stdout, run.stdout + run.stderr
    assert (tmp_path / "failures.txt").read_text().count("==== FAILED test_demo.py::test_that_fails (call,") == 1


def _store_port_owner(rank: int, world_size: int) -> int:
    import torch.distributed as dist
    dist.barrier()
    return rank


def test_run_multiprocess_holds_its_rendezvous_port() -> None:
    """Two groups rendezvous at once (as xdist workers do): each parent serves its own store,
    so neither child can find its port taken (``EADDRINUSE`` where a port is chosen by one
    test and bound by another's child)."""
    import threading

    from _dist import run_multiprocess

    out: dict[int, object] = {}

    def one(i: int) -> None:
        try:
            out[i] = run_multiprocess(_store_port_owner, 2, timeout=60)
        except BaseException as e:  # noqa: BLE001 - checked below
            out[i] = e

    threads = [threading.Thread(target=one, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(90)
    assert out == {0: [0, 1], 1: [0, 1]}


def test_run_threads_names_the_late_rank_and_shows_where_it_waits() -> None:
    import threading

    from _dist import run_threads

    release = threading.Event()

    def body(r: int) -> int:
        if r == 1:
            _waits_for_the_release(release)
        return r

    try:
        with pytest.raises(RuntimeError) as e:
            run_threads(body, 2, timeout=0.5)
    finally:
        release.set()
    msg = str(e.value)
    assert "rank(s) [1] did not finish within 0.5 s" in msg
    assert "--- rank 1 " in msg and "_waits_for_the_release" in msg, msg


def _waits_for_the_release(release) -> None:
    release.wait(30)


def _sleeps_forever(rank: int, world_size: int) -> None:
    if rank == 1:
        _stuck_here()
    return None


def _stuck_here() -> None:
    time.sleep(600)


def test_run_multiprocess_shows_where_a_late_rank_waits(capfd) -> None:
    """A rank that does not report in time is named, and its threads' stacks reach the
    test's stderr before it is killed (faulthandler on SIGUSR1 in every child)."""
    from _dist import run_multiprocess

    with pytest.raises(RuntimeError, match=r"ranks \[1\] did not report within 20 s"):
        run_multiprocess(_sleeps_forever, 2, timeout=20)
    err = capfd.readouterr().err
    assert "_stuck_here" in err and "_sleeps_forever" in err, err[-2000:]
