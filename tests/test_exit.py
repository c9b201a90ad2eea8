"""A process that used tide_triton exits cleanly: no thread of the library is left for the
interpreter to end while it finalizes (tide_triton/runtime/stall_watch.py).

Python ends a daemon thread still alive at finalization with ``pthread_exit`` from wherever it
stands; a thread standing inside a torch call then unwinds through a C++ ``noexcept`` frame and
the process aborts with "terminate called without an active exception" -- after a correct
run, so a launcher such as torchrun reports the job as failed.  Each test runs a fresh
interpreter (a few seconds).
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

_ONE_CALL = """
    import torch
    import tide_triton as tt

    (g,) = tt.local_groups(1)
    grads = [torch.ones(4, 3)]
    shards = [torch.empty(s) for s in tt.ShardLayout([(4, 3)], 1).shard_shapes(0)]
    tt.reduce_scatter(grads, shards, group=g, op="sum")  # a collective: the stall watcher runs
    assert any(t.name == "tide_triton-stall-watch" for t in threading.enumerate())
"""


def _run(*parts: str) -> subprocess.CompletedProcess:
    """``python -c`` of ``parts`` (each dedented on its own) in a fresh interpreter."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    env.setdefault("TRITON_INTERPRET", "1")
    env["OMP_NUM_THREADS"] = "1"
    return subprocess.run([sys.executable, "-c", "\n".join(textwrap.dedent(p) for p in parts)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)


def test_no_library_thread_is_alive_when_the_interpreter_finalizes() -> None:
    """The last ``atexit`` handler (registered before tide_triton is imported, so it runs after
    every handler the library registers) sees only the main thread."""
    out = _run("""
        import atexit, threading

        def last() -> None:
            alive = [t.name for t in threading.enumerate() if t is not threading.main_thread()]
            print(f"alive at finalization: {alive}", flush=True)

        atexit.register(last)
    """, _ONE_CALL)
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-3000:]
    assert "alive at finalization: []" in out.stdout, text[-3000:]


def test_exit_is_clean_while_the_stall_watcher_runs_torch_code() -> None:
    """The watcher made to run a torch call (it releases the GIL inside) at every look --
    standing in for a garbage collection or a destructor that enters torch on its thread --
    and an object whose finalizer keeps the interpreter finalizing for 1.5 s: the process
    exits 0 without a word of ``std::terminate``.  With the watcher alive into finalization,
    its torch call returned there and the process aborted (SIGABRT) in most runs."""
    for _ in range(2):
        out = _run("""
            import threading
            import time
            import torch
            from tide_triton.runtime import stall_watch

            stall_watch.POLL_S = 1e-4
            a = torch.randn(1024, 1024)
            wait = stall_watch._wake.wait

            def wait_then_torch(timeout=None):
                got = wait(timeout)
                if threading.current_thread().name == "tide_triton-stall-watch":
                    torch.mm(a, a)  # the GIL is released inside
                return got

            stall_watch._wake.wait = wait_then_torch

            class SlowToFree:
                def __del__(self) -> None:  # runs while the interpreter finalizes
                    time.sleep(1.5)

            slow = SlowToFree()
        """, _ONE_CALL)
        text = out.stdout + out.stderr
        assert out.returncode == 0 and "terminate called" not in text, \
            f"exit code {out.returncode}:\n{text[-3000:]}"
