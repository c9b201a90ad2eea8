"""Faults that would give wrong results without an error, or no deadline, unless the library
checks for them.  Each case below fails without its check:

1. all_gather with another dim 0 on one rank: its last row silently became 0;
2. agree="first": a call that failed locally on one rank paired with that rank's next call
   (the peer returned its own contribution plus the next call's: 103 instead of 16);
3. agree="first": ranks in different collectives, or the same collective on another agreed
   layout of the same size: errors on some ranks, wrong results on others;
4. after an interrupted collective, the next one returned stale data;
5. under agree="always" a late, absent or dead rank was caught only by the process group's
   own timeout (or a socket error), naming no rank;
6. the process aborted at exit without ``group.close()``;
7. a heap file of a killed process stayed in /dev/shm;
8. two threads on one group aborted the process inside gloo;
9. NaN ``op`` and a non-stream ``stream`` were accepted; the errors were not exported;
10. a kernel variant loaded while a peer was late stopped the host inside the driver (GPU);
11. a KeyboardInterrupt inside a call left the group usable: its next call summed stale data.

Every case runs on the host transport (CPU, gloo); the data-path cases run with CUDA tensors
too where a GPU exists (processes sharing it).
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
import time

import pytest
import torch

try:
    from _dist import run_multiprocess
except ImportError:  # pragma: no cover
    from tests._dist import run_multiprocess

pytestmark = pytest.mark.multiproc

_DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]  # gpu: skipped without CUDA
_ERRORS = ("broken:", "aborted by", "peer argument", "mismatch:", "timeout", "own error", "error:")
"""What an outcome that is not a result starts with.  On CUDA a peer's abort cannot release
a stream already waiting for it: the waiting rank's group breaks (named at the timeout by
synchronize), so later calls raise instead of recovering -- still never a wrong value."""


def _exact_or_error(outcome: str, want: str) -> bool:
    return outcome == want or outcome.startswith(_ERRORS)


def _dev(kind: str, rank: int) -> torch.device:
    if kind == "cuda":
        return torch.device("cuda", rank % torch.cuda.device_count())
    return torch.device("cpu")


def _sync(kind: str) -> None:
    if kind == "cuda":
        import tide_triton as tt

        tt.synchronize()
        torch.cuda.synchronize()


def _on_local_groups(W: int, body, *, timeout_s: float = 10) -> list:
    """``body(r, groups)`` on every rank of a fresh single-process group of ``W`` ranks (one
    thread each); the groups are closed after."""
    import tide_triton as tt

    try:
        from _dist import run_threads
    except ImportError:  # pragma: no cover
        from tests._dist import run_threads
    groups = tt.local_groups(W, timeout_s=timeout_s)
    try:
        return run_threads(lambda r: body(r, groups), W, timeout=60)
    finally:
        for g in groups:
            g.close()


def _outcome(fn, kind: str) -> str:
    """Run ``fn`` (a collective and its check); name what happened."""
    import tide_triton as tt

    try:
        r = fn()
        _sync(kind)
        return f"ok {r}" if r is not None else "ok"
    except tt.GroupBrokenError as e:
        return f"broken: {e}"
    except tt.PeerAbortedError as e:
        return f"aborted by {e.rank}: {e}"
    except tt.PeerArgumentError as e:
        return f"peer argument {e.rank}: {e}"
    except tt.ArgumentMismatchError as e:
        return f"mismatch: {e}"
    except tt.PeerTimeoutError as e:
        return f"timeout {e.peer}: {e}"
    except (TypeError, ValueError) as e:
        return f"own error: {e}"
    except RuntimeError as e:
        return f"error: {e}"


# ---- 1. all_gather with another dim 0 on one rank -------------------------------------
def _ag_dim0(rank: int, W: int, kind: str) -> str:
    import tide_triton as tt

    dev = _dev(kind, rank)
    tt.init(timeout_s=20)
    d0 = 8 if rank == 1 else 7
    layout = tt.ShardLayout([(d0, 5)], W)
    shards = [torch.full(s, float(rank + 1), device=dev) for s in layout.shard_shapes(rank)]
    params = [torch.zeros((d0, 5), device=dev)]
    return _outcome(lambda: tt.all_gather(shards, params), kind)


@pytest.mark.parametrize("kind", _DEVICES)
def test_all_gather_with_another_dim0_on_one_rank_raises_on_every_rank(kind: str) -> None:
    out = run_multiprocess(_ag_dim0, 3, kind, timeout=120)
    for r, o in enumerate(out):
        assert o.startswith("mismatch: ranks disagree on all_gather's params shapes"), (r, o)
        assert "rank 1: ((8, 5),)" in o and "ranks 0, 2: ((7, 5),)" in o, (r, o)


# ---- 2. agree="first": a failed call must not pair with the next one -------------------
def _first_fail_then_next(rank: int, W: int, kind: str, other_layout: bool) -> dict:
    import tide_triton as tt

    dev = _dev(kind, rank)
    tt.init(timeout_s=20, agree="first")
    shapes_a, shapes_b = [(6, 4)], [(4, 6)]  # two layouts of the same byte count
    out = {}

    def rs(shapes, value, drop=False):
        layout = tt.ShardLayout(shapes, W)
        grads = [torch.full(s, float(value), dtype=torch.bfloat16, device=dev) for s in shapes]
        shards = [torch.zeros(s, device=dev) for s in layout.shard_shapes(rank)]
        tt.reduce_scatter(grads[:0] if drop else grads, shards[:0] if drop else shards, op="sum")
        _sync(kind)
        return sorted({float(v) for x in shards for v in x.flatten().tolist()})

    # agree both signatures first (each call exchanges once)
    out["agree a"] = _outcome(lambda: rs(shapes_a, rank + 1), kind)
    out["agree b"] = _outcome(lambda: rs(shapes_b, rank + 1), kind)
    # rank 0: grads 3 (expected sum with rank 1's 13: 16); rank 1: a bad call, then its next
    if rank == 0:
        out["pending"] = _outcome(lambda: rs(shapes_a, 3), kind)
    else:
        out["pending"] = _outcome(lambda: rs(shapes_a, 13, drop=True), kind)
        out["next"] = _outcome(lambda: rs(shapes_b if other_layout else shapes_a, 100), kind)
    if rank == 0:  # rank 0's own next call pairs with rank 1's "next"
        out["next"] = _outcome(lambda: rs(shapes_b if other_layout else shapes_a, 100), kind)
    out["after"] = _outcome(lambda: rs(shapes_a, 7), kind)
    return out


@pytest.mark.parametrize("kind", _DEVICES)
@pytest.mark.parametrize("other_layout", [False, True], ids=["same-layout", "other-layout"])
def test_agree_first_failed_call_never_pairs_with_the_next(kind: str, other_layout: bool) -> None:
    out = run_multiprocess(_first_fail_then_next, 2, kind, other_layout, timeout=180)
    r0, r1 = out
    assert r0["agree a"] == r1["agree a"] == "ok [3.0]", out
    assert r1["pending"].startswith("own error: grads must hold at least one tensor"), r1
    # never 103 (3 + the next call's 100): the peer's abort is named
    assert r0["pending"].startswith("peer argument 1: rank 1 rejected its arguments"), r0
    if kind == "cpu":  # the failure moved no data: both next calls pair and are exact
        assert r0["next"] == r1["next"] == "ok [200.0]", out
        assert r0["after"] == r1["after"] == "ok [14.0]", out
    else:  # never 103 or any other wrong value: exact, or an error
        for o in out:
            assert _exact_or_error(o["next"], "ok [200.0]") and _exact_or_error(o["after"], "ok [14.0]"), o


# ---- 3. agree="first": different collectives, or other layouts, at the same call -------
def _first_different_calls(rank: int, W: int, kind: str, how: str) -> dict:
    import tide_triton as tt

    dev = _dev(kind, rank)
    tt.init(timeout_s=20, agree="first")
    shapes_a, shapes_b = [(6, 4)], [(4, 6)]
    out = {}

    def rs(shapes, value):
        layout = tt.ShardLayout(shapes, W)
        grads = [torch.full(s, float(value), dtype=torch.bfloat16, device=dev) for s in shapes]
        shards = [torch.zeros(s, device=dev) for s in layout.shard_shapes(rank)]
        tt.reduce_scatter(grads, shards, op="sum")
        _sync(kind)
        return sorted({float(v) for x in shards for v in x.flatten().tolist()})

    def ag(shapes, value):
        layout = tt.ShardLayout(shapes, W)
        shards = [torch.full(s, float(value), dtype=torch.bfloat16, device=dev) for s in layout.shard_shapes(rank)]
        params = [torch.zeros(s, dtype=torch.bfloat16, device=dev) for s in shapes]
        tt.all_gather(shards, params)
        _sync(kind)
        return sorted({float(v) for x in params for v in x.flatten().tolist()})

    out["agree"] = [_outcome(lambda: rs(shapes_a, 1), kind), _outcome(lambda: rs(shapes_b, 1), kind),
                    _outcome(lambda: ag(shapes_a, 1), kind)]
    if how == "ag-vs-rs":
        out["diverge"] = _outcome(lambda: ag(shapes_a, 5) if rank == 0 else rs(shapes_a, 5), kind)
    else:  # the same collective on another agreed layout of the same byte count
        out["diverge"] = _outcome(lambda: rs(shapes_a if rank == 0 else shapes_b, 5), kind)
    out["after"] = _outcome(lambda: rs(shapes_a, rank + 1), kind)
    return out


@pytest.mark.parametrize("kind", _DEVICES)
@pytest.mark.parametrize("how", ["ag-vs-rs", "other-layout"])
def test_agree_first_different_calls_raise_on_every_rank(kind: str, how: str) -> None:
    out = run_multiprocess(_first_different_calls, 2, kind, how, timeout=180)
    for r, o in enumerate(out):
        assert o["agree"] == ["ok [2.0]", "ok [2.0]", "ok [1.0]"], (r, o)
        d = o["diverge"]
        if kind == "cpu":
            assert d.startswith(("mismatch: ranks 0 and 1 made different collectives as call #",
                                 "mismatch: ranks 1 and 0 made different collectives as call #",
                                 "peer argument")), (r, d)
        else:
            assert d.startswith(_ERRORS), (r, d)
        # never a wrong result afterwards
        assert _exact_or_error(o["after"], "ok [3.0]"), (r, o)
    names = " ".join(o["diverge"] for o in out)
    assert "mismatch" in names, out  # at least one rank names both calls
    if how == "ag-vs-rs":
        assert "all_gather(" in names and "reduce_scatter(" in names, out
    else:
        assert "(6, 4)" in names and "(4, 6)" in names, out


# ---- 4. an interrupted collective: never stale data afterwards -------------------------
def _interrupted(rank: int, W: int, kind: str, agree: str) -> dict:
    import tide_triton as tt

    dev = _dev(kind, rank)
    g = tt.init(timeout_s=20, agree=agree, ring_bytes=256)  # small ring: many chunks
    shapes = [(64, 8)]
    layout = tt.ShardLayout(shapes, W)
    out = {}

    def rs(value):
        grads = [torch.full(s, float(value), dtype=torch.bfloat16, device=dev) for s in shapes]
        shards = [torch.zeros(s, device=dev) for s in layout.shard_shapes(rank)]
        tt.reduce_scatter(grads, shards, op="sum", group=g)
        _sync(kind)
        return sorted({float(v) for x in shards for v in x.flatten().tolist()})

    out["first"] = _outcome(lambda: rs(rank + 1), kind)
    t = g.transport(dev)
    if rank == 1:  # an error inside the transport after the first chunk's copies
        real, n = t.copy_prepared, [0]

        def failing(*a, **k):
            n[0] += 1
            if n[0] == 2:
                raise RuntimeError("injected transport failure")
            return real(*a, **k)
        t.copy_prepared = failing
    t0 = time.monotonic()
    out["interrupted"] = _outcome(lambda: rs(10 + rank), kind)
    out["seconds"] = time.monotonic() - t0
    if rank == 1:
        del t.copy_prepared
    out["next"] = _outcome(lambda: rs(15), kind)  # 30 on every element, or an error
    g.close()
    g2 = tt.init(timeout_s=90, agree=agree, ring_bytes=256)  # a peer's close may drain stuck GPU work
    out["new group"] = _outcome(lambda: (lambda v: v)(_rs_on(g2, layout, shapes, rank, dev, kind)), kind)
    g2.close()
    return out


def _rs_on(g, layout, shapes, rank, dev, kind):
    import tide_triton as tt

    grads = [torch.full(s, 15.0, dtype=torch.bfloat16, device=dev) for s in shapes]
    shards = [torch.zeros(s, device=dev) for s in layout.shard_shapes(rank)]
    tt.reduce_scatter(grads, shards, op="sum", group=g)
    _sync(kind)
    return sorted({float(v) for x in shards for v in x.flatten().tolist()})


@pytest.mark.parametrize("kind", _DEVICES)
@pytest.mark.parametrize("agree", ["always", "first"])
def test_interrupted_collective_leaves_no_stale_data(kind: str, agree: str) -> None:
    out = run_multiprocess(_interrupted, 2, kind, agree, timeout=300)
    r0, r1 = out
    assert r0["first"] == r1["first"] == "ok [3.0]", out
    assert "injected transport failure" in r1["interrupted"], r1
    assert r0["interrupted"].startswith("aborted by 1: rank 1 abandoned collective call #"), r0
    if kind == "cpu":
        assert r0["seconds"] < 5, r0  # seen through the abort flag, not the 20 s timeout
    for o in out:  # the next call never returns [21.0, 30.0]
        assert o["next"].startswith("broken: this tide_triton group"), o
        assert "create a new one" in o["next"], o
        assert o["new group"] == "ok [30.0]", o


# ---- 5. deadlines under agree="always" --------------------------------------------------
def _late(rank: int, W: int, how: str) -> dict:
    import tide_triton as tt

    tt.init(timeout_s=3)
    layout = tt.ShardLayout([(4, 2)], W)
    grads = [torch.ones((4, 2), dtype=torch.bfloat16)]
    shards = [torch.zeros(s) for s in layout.shard_shapes(rank)]
    if rank == 1:
        if how == "exits":
            os._exit(0)
        if how == "late":
            time.sleep(8)
        if how == "never":
            time.sleep(8)
            return {}
    t0 = time.monotonic()
    o = _outcome(lambda: tt.reduce_scatter(grads, shards, op="sum") and None, "cpu")
    return {"outcome": o, "seconds": time.monotonic() - t0}


@pytest.mark.parametrize("how", ["late", "never", "exits"])
def test_always_mode_honours_the_deadline_and_names_the_rank(how: str) -> None:
    out = run_multiprocess(_late, 2, how, timeout=60, may_die=(1,))
    r0 = out[0]
    assert r0["outcome"].startswith("timeout 1: timed out after 3.0 s waiting for rank 1"), r0
    assert r0["seconds"] < 6, r0


# ---- 6. clean exits without close() ----------------------------------------------------
_EXIT_SCRIPT = textwrap.dedent("""
    import os, sys, torch, torch.distributed as dist
    import tide_triton as tt
    rank, W, port = int(sys.argv[1]), 2, int(sys.argv[2])
    store = dist.TCPStore("127.0.0.1", port, None, False)  # the test serves it
    dist.init_process_group("gloo", store=store, rank=rank, world_size=W)
    layout = tt.ShardLayout([(6, 3)], W)
    grads = [torch.full((6, 3), 1.0, dtype=torch.bfloat16)]
    shards = [torch.zeros(s) for s in layout.shard_shapes(rank)]
    tt.init(timeout_s=30)
    tt.reduce_scatter(grads, shards, op="sum")
    tt.all_gather(shards, [torch.zeros(6, 3)])
    if sys.argv[3] == "destroy":
        dist.destroy_process_group()   # no group.close(): the group closes itself
""")


def test_fifty_exits_without_close_never_abort(tmp_path) -> None:
    import datetime

    import torch.distributed as dist

    script = tmp_path / "exit.py"
    script.write_text(_EXIT_SCRIPT)
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    codes = []
    for i in range(25):  # 25 runs x 2 ranks = 50 exits; half destroy the process group first
        # the test serves each run's store on a port it keeps bound (no race for a free port)
        store = dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=120))
        port = store.port
        how = "destroy" if i % 2 else "exit"
        procs = [subprocess.Popen([sys.executable, str(script), str(r), str(port), how], env=env,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE) for r in range(2)]
        for p in procs:
            try:
                _, err = p.communicate(timeout=120)
            except subprocess.TimeoutExpired:
                p.kill()
                _, err = p.communicate()
            codes.append((p.returncode, how, err.decode(errors="replace")[-400:]))
        del store
    bad = [c for c in codes if c[0] != 0]
    assert not bad, bad[:3]


# ---- 7. stale heap files ---------------------------------------------------------------
def test_stale_heap_file_of_a_dead_process_is_removed_at_the_next_init(tmp_path) -> None:
    from tide_triton.transport.host import remove_stale_files

    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    dead = tmp_path / f"tide_triton.{p.pid}.0123456789ab.0"
    dead.write_bytes(b"")
    alive = tmp_path / f"tide_triton.{os.getppid()}.0123456789ab.1"  # a live process's: kept
    alive.write_bytes(b"")
    other = tmp_path / "tide_triton.notapid.x.0"
    other.write_bytes(b"")
    removed = remove_stale_files(str(tmp_path))
    assert removed == [str(dead)]
    assert not dead.exists() and alive.exists() and other.exists()


def _killed_in_exchange(rank: int, W: int) -> dict:
    import signal

    import tide_triton as tt
    from tide_triton.transport import host

    tt.init(timeout_s=5)
    if rank == 1:  # killed right after creating its heap file, inside the name exchange
        real = host.HostTransport.__init__.__globals__["os"].open

        def open_then_die(path, *a, **k):
            fd = real(path, *a, **k)
            if str(path).startswith("/dev/shm/tide_triton."):
                os.kill(os.getpid(), signal.SIGKILL)
            return fd
        host.os.open = open_then_die
    layout = tt.ShardLayout([(4, 2)], W)
    shards = [torch.zeros(s) for s in layout.shard_shapes(rank)]
    grads = [torch.ones((4, 2), dtype=torch.bfloat16)]
    o = _outcome(lambda: tt.reduce_scatter(grads, shards, op="sum"), "cpu")
    return {"outcome": o}


def test_rank_killed_inside_the_name_exchange_leaves_no_file_after_the_next_init() -> None:
    out = run_multiprocess(_killed_in_exchange, 2, timeout=60, may_die=(1,))
    assert out[0]["outcome"].startswith("timeout 1"), out
    from tide_triton.transport.host import remove_stale_files

    remove_stale_files()  # what the next init on this host does first
    left = [n for n in os.listdir("/dev/shm") if n.startswith("tide_triton.")
            and not os.path.exists(f"/proc/{n.split('.')[1]}")]
    assert not left, left


# ---- 8. two threads on one group -------------------------------------------------------
def _two_threads(rank: int, W: int) -> dict:
    import threading

    import tide_triton as tt

    g = tt.init(timeout_s=20)
    layout = tt.ShardLayout([(4, 2)], W)
    out = {}

    def call(tag):
        grads = [torch.ones((4, 2), dtype=torch.bfloat16)]
        shards = [torch.zeros(s) for s in layout.shard_shapes(rank)]
        try:
            tt.reduce_scatter(grads, shards, op="sum", group=g)
            out[tag] = "ok " + str(sorted({float(v) for v in shards[0].flatten().tolist()}))
        except RuntimeError as e:
            out[tag] = f"error: {e}"

    if rank == 0:
        a = threading.Thread(target=call, args=("a",))
        a.start()
        time.sleep(1.0)  # thread a waits for rank 1 in its call
        call("b")        # a second thread on the same group: a clear error, no abort
        a.join()
    else:
        time.sleep(2.0)
        call("a")
    return out


def test_two_threads_on_one_group_get_a_clear_error() -> None:
    r0, r1 = run_multiprocess(_two_threads, 2, timeout=60)
    assert r0["a"] == r1["a"] == "ok [2.0]", (r0, r1)
    assert r0["b"].startswith("error: this tide_triton group (rank 0) is already in a collective call from "
                              "another thread"), r0


# ---- 9. validation and exports ---------------------------------------------------------
def _validation(rank: int, W: int) -> dict:
    import tide_triton as tt

    tt.init(timeout_s=10)
    layout = tt.ShardLayout([(4, 2)], W)
    grads = [torch.ones((4, 2), dtype=torch.bfloat16)]
    shards = [torch.zeros(s) for s in layout.shard_shapes(rank)]
    out = {}
    for name, kw in {"nan": {"op": float("nan")}, "inf": {"op": float("inf")},
                     "stream": {"stream": "not-a-stream"}}.items():
        out[name] = _outcome(lambda kw=kw: tt.reduce_scatter(grads, shards, **kw), "cpu")
    out["ag stream"] = _outcome(lambda: tt.all_gather(shards, [torch.zeros(4, 2)], stream=3), "cpu")
    out["ok after"] = _outcome(lambda: tt.reduce_scatter(grads, shards, op="sum") and None, "cpu")
    return out


def test_nan_op_and_bad_stream_raise_on_every_rank() -> None:
    for o in run_multiprocess(_validation, 2, timeout=60):
        assert o["nan"].startswith("own error: op as a scale must be a finite float, got nan"), o
        assert o["inf"].startswith("own error: op as a scale must be a finite float, got inf"), o
        assert o["stream"] == "own error: stream must be None or a torch.cuda.Stream, got str", o
        assert o["ag stream"] == "own error: stream must be None or a torch.cuda.Stream, got int", o
        assert o["ok after"] == "ok", o


def test_errors_are_exported_with_one_base() -> None:
    import tide_triton as tt

    for name in ("PeerTimeoutError", "PeerArgumentError", "ArgumentMismatchError", "PeerAbortedError",
                 "GroupBrokenError"):
        cls = getattr(tt, name)
        assert issubclass(cls, tt.TideTritonError), name
        assert name in tt.__all__, name
    assert issubclass(tt.PeerTimeoutError, TimeoutError)
    assert issubclass(tt.ArgumentMismatchError, ValueError)


# ---- the multicast path's identity check (through the store; no flag words there) -------
def test_identity_exchange_names_both_calls_and_lets_equal_calls_pass() -> None:
    import tide_triton as tt
    try:
        from _dist import run_threads
    except ImportError:  # pragma: no cover
        from tests._dist import run_threads

    groups = tt.local_groups(2, timeout_s=20)
    sigs = [("reduce_scatter", ("grads shapes", ((6, 4),))), ("reduce_scatter", ("grads shapes", ((4, 6),)))]

    def rank(r: int) -> str:
        g = groups[r]
        with g.call("reduce_scatter") as c:
            c.set_signature(sigs[0])
            g.check_in_exchange()  # the same call on both ranks: passes
        try:
            with g.call("reduce_scatter") as c:
                c.set_signature(sigs[r])
                g.check_in_exchange()
            return "no error"
        except tt.ArgumentMismatchError as e:
            return str(e)

    try:
        out = run_threads(rank, 2, timeout=60)
    finally:
        for g in groups:
            g.close()
    for r, msg in enumerate(out):
        assert "made different collectives as call #2" in msg, (r, msg)
        # its own call in words; the peer's too where this rank agreed it before (here it did not)
        assert ("(6, 4)" if r == 0 else "(4, 6)") in msg, (r, msg)


# ---- 9. a broken group's close releases its stuck waits only when their peers gave up --
def test_stuck_waits_are_released_only_for_peers_that_abandoned_their_calls() -> None:
    """A broken group's close may write the values its stuck stream waits expect (so the
    process's device-wide synchronize does not hang), but only when every peer those waits
    wait for published an abort: a peer that is only slow would otherwise receive pushes into
    slots it has not read yet (a wrong result without an error)."""
    from tide_triton.group.bootstrap import Abort
    from tide_triton.group.calls import CallIdentity

    class Aborts:
        def __init__(self, by: dict) -> None:
            self.by = by

        def abort_of(self, r: int, since: int = 0):
            a = self.by.get(r)
            return a if a is not None and a.call >= since else None

    aborts = Aborts({1: Abort((7, "failed", "RuntimeError: injected")), 3: Abort((2, "broken", "x"))})
    g = CallIdentity(0, 4, aborts, flags=None, timeout_s=1.0)  # type: ignore[arg-type]
    assert g.all_aborted({1}) and g.all_aborted({1, 3})
    assert not g.all_aborted({1, 2})  # rank 2 published nothing: maybe only slow
    assert not g.all_aborted({0})     # never "released" on this rank's own account


# ---- 9b. a peer's abort names the call it abandoned, and ends a wait on that call at once -
def test_a_peer_abort_is_read_for_the_call_it_abandoned_not_its_later_refusals() -> None:
    """A rank that refused call #3 (bad arguments) and then, its group broken by its next call,
    refused #5 ("broken"): a peer explaining its wait on #3 reads the refusal of #3 -- a store
    holding only the latest abort would report "abandoned call #5: its group is broken"
    instead of the argument error that caused it."""
    from tide_triton.group.bootstrap import Exchange, LocalKeyValue
    from tide_triton.group.calls import CallIdentity
    from tide_triton.errors import PeerAbortedError

    kv = LocalKeyValue()
    ex1, ex0 = Exchange(kv, "g/", 1, 2), Exchange(kv, "g/", 0, 2)
    assert ex0.abort_of(1) is None
    ex1.publish_abort(3, "argument", "ValueError: grads must hold at least one tensor")
    ex1.publish_abort(5, "broken", "its group is broken: ...")
    assert ex0.abort_of(1, 3) == (3, "argument", "ValueError: grads must hold at least one tensor")
    assert ex0.abort_of(1, 4).call == 5 and ex0.abort_of(1, 6) is None
    for seq in range(100):  # the history is bounded
        ex1.publish_abort(10 + seq, "broken", "x")
    assert ex0.abort_of(1, 0).call == 109 - 15

    # synchronize()'s poll: raises for a peer's abort of a call this rank did not fail (its
    # GPU work waits for that peer), never for one this rank refused too (nothing enqueued) --
    # and an earlier such refusal does not hide a later abort
    g = CallIdentity(0, 2, Exchange(kv, "h/", 0, 2), flags=None, timeout_s=1.0)
    g.seq = 300
    peer = Exchange(kv, "h/", 1, 2)
    g._note_failed(6)
    peer.publish_abort(6, "argument", "ValueError: refused on both ranks")
    g.raise_if_abandoned(6)  # call 6 failed here too: nothing to wait for
    peer.publish_abort(7, "failed", "RuntimeError: only rank 1")
    with pytest.raises(PeerAbortedError, match="rank 1 abandoned collective call #7: RuntimeError: only rank 1"):
        g.raise_if_abandoned(6)
    err = g.explain_timeout(TimeoutError("x"), 6)  # the timeout's cause: call 7, not the refusal of 6
    assert isinstance(err, PeerAbortedError) and err.call == 7, err
    g.raise_if_abandoned(8)  # calls before the last synchronize are not looked at
    # any number of calls since the last synchronize (the drop-in never calls it): call 250
    g._failed_calls = ()
    peer.publish_abort(250, "failed", "RuntimeError: late")
    with pytest.raises(PeerAbortedError, match="call #250"):
        g.raise_if_abandoned(8)


# ---- 10. a kernel variant's first load while a peer is late -----------------------------
def _load_while_a_peer_is_late(rank: int, W: int) -> dict:
    import tide_triton as tt

    dev = _dev("cuda", rank)
    torch.cuda.set_device(dev)
    tt.init(timeout_s=4)
    layout = tt.ShardLayout([(64, 32)], W)
    grads = [torch.full((64, 32), float(rank + 1), dtype=torch.bfloat16, device=dev)]
    shards = [torch.zeros(s, device=dev) for s in layout.shard_shapes(rank)]
    tt.reduce_scatter(grads, shards, op="sum")
    tt.synchronize()
    first = bool((shards[0] == 3).all())
    if rank == 1:  # this rank's stream is busy for ~10 s: its next flags come late
        torch.cuda._sleep(int(2e10))
    tt.reduce_scatter(grads, shards, op="sum")  # rank 0's copy stream now waits for rank 1
    t0 = time.monotonic()
    # "avg": a kernel variant not loaded yet (it scales), loaded at this call's preparation
    o = _outcome(lambda: tt.reduce_scatter(grads, shards, op="avg") and None, "cuda")
    return {"first": first, "outcome": o, "seconds": time.monotonic() - t0}


@pytest.mark.gpu
def test_a_kernel_load_while_a_peer_is_late_ends_in_an_error_naming_it() -> None:
    """A module load waits for every stream of the process and stops the process's other
    driver calls (tide_triton/runtime/device_wide.py): rank 0 loads the ``avg`` variant while its
    stream waits for rank 1 (late on its GPU), and must not stop inside the driver until
    rank 1 catches up (had rank 1 died: forever, no deadline firing).  The promise: every rank
    ends in an error naming its peer, rank 0 within its deadline, never a value.  Which rank
    gives up first is a race -- rank 0 timing out waiting for rank 1 ("timeout 1: ..."), or
    rank 1 timing out in its own settle before the load and publishing its abort ("aborted by
    1: ... waiting for rank 0"): both keep the promise."""
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    out = run_multiprocess(_load_while_a_peer_is_late, 2, timeout=120)
    assert out[0]["first"] and out[1]["first"], out
    r0, r1 = out
    assert _error_naming(r0["outcome"], 1), r0
    assert r0["seconds"] < 9, r0  # the 4 s deadline plus a compile, not rank 1's ~10 s
    assert _error_naming(r1["outcome"], 0), r1
    assert r1["seconds"] < 30, r1  # its own stream's ~10 s plus the deadline: never a hang


def _error_naming(outcome: str, peer: int) -> bool:
    """``outcome`` (of :func:`_outcome`) is an error -- never a value -- that names rank ``peer``:
    a timeout waiting for it, its abort or refusal, or a broken group's reason naming it."""
    return outcome.startswith(_ERRORS) and (
        outcome.startswith((f"timeout {peer}:", f"aborted by {peer}:", f"peer argument {peer}:"))
        or re.search(rf"\brank {peer}\b", outcome) is not None)


def test_the_late_peer_promise_accepts_either_race_and_never_a_value() -> None:
    """The check of the test above, on the outcomes each race gives (no GPU needed)."""
    late = "timeout 1: timed out after 4.0 s waiting for rank 1 (before loading a kernel variant: call #3)"
    aborted = ("aborted by 1: rank 1 abandoned collective call #3: PeerTimeoutError: timed out after 4.0 s "
               "waiting for rank 0 (before loading a kernel variant: call #3)")
    assert _error_naming(late, 1) and _error_naming(aborted, 1)
    assert _error_naming("timeout 0: timed out after 4.0 s waiting for rank 0 (call #3)", 0)
    assert _error_naming("broken: its group is broken: rank 0 abandoned call #3: x", 0)
    for bad in ("ok", "ok tensor([3.])", "timeout 0: timed out after 4.0 s waiting for rank 0", "error: boom",
                "broken: rank 10 abandoned call #3"):
        assert not _error_naming(bad, 1), bad


# ---- 11. an interrupt (KeyboardInterrupt) inside a call ------------------------------------
def _interrupted_by_a_signal(rank: int, W: int) -> dict:
    import signal

    import tide_triton as tt

    g = tt.init(timeout_s=8)
    shapes = [(8, 4)]
    layout = tt.ShardLayout(shapes, W)
    shards = [torch.zeros(s) for s in layout.shard_shapes(rank)]
    tt.reduce_scatter([torch.ones(shapes[0], dtype=torch.bfloat16)], shards, op="sum")  # warm
    t = g.transport(torch.device("cpu"))
    out: dict = {}
    if rank == 1:  # slow: its pushes of call 2 start 2 s late, so rank 0 is inside its waits
        real = t.copy_prepared

        def slow(*a, **k):
            time.sleep(2.0)
            return real(*a, **k)
        t.copy_prepared = slow
    else:  # Ctrl-C one second into call 2, after rank 0 pushed its own slices
        def on_alarm(*_):
            raise KeyboardInterrupt("simulated Ctrl-C")
        signal.signal(signal.SIGALRM, on_alarm)
        signal.setitimer(signal.ITIMER_REAL, 1.0)
    for call, scale in (("call2", 100.0), ("call3", 1000.0)):  # expected sums 300, 3000
        shards = [torch.zeros(s) for s in layout.shard_shapes(rank)]
        try:
            tt.reduce_scatter([torch.full(shapes[0], scale * (rank + 1), dtype=torch.bfloat16)], shards, op="sum")
            out[call] = ("ok", shards[0].unique().tolist())
        except BaseException as e:  # noqa: BLE001 - the outcome is the test's subject
            out[call] = (type(e).__name__, str(e)[:200])
        if rank == 1:
            t.copy_prepared = real
    return out


def test_an_interrupted_call_breaks_the_group_and_its_next_call_never_pairs() -> None:
    """A KeyboardInterrupt inside a collective (a script that catches Ctrl-C and checkpoints
    goes on calling) must publish an abort and break the group (handling only ``Exception``
    would not): else rank 0's next reduce-scatter reuses the interrupted call's flags and sums
    rank 1's stale slot -- 1200 where 3000 is due, no error.  The interrupt propagates, the
    group breaks, and the peer learns it by name."""
    out = run_multiprocess(_interrupted_by_a_signal, 2, timeout=120)
    r0, r1 = out
    assert r0["call2"][0] == "KeyboardInterrupt", r0
    assert r0["call3"][0] == "GroupBrokenError" and "KeyboardInterrupt" in r0["call3"][1], r0
    assert r1["call2"] in (("ok", [300.0]),) or r1["call2"][0] in ("PeerAbortedError", "PeerTimeoutError"), r1
    assert r1["call3"][0] in ("PeerAbortedError", "PeerTimeoutError") and "rank 0" in r1["call3"][1], r1


# ---- 12. group options that differ between ranks ----------------------------------------
def _options_differ(rank: int, W: int, name: str) -> str:
    import tide_triton as tt

    values = {"ring_bytes": (1 << 20, 2 << 20), "stages": (2, 3), "agree": ("always", "first")}[name]
    try:
        tt.init(timeout_s=20, **{name: values[rank]})
    except ValueError as e:
        return f"ValueError: {e}"
    layout = tt.ShardLayout([(8, 4)], W)  # only reached without the check
    shards = [torch.zeros(s) for s in layout.shard_shapes(rank)]
    return _outcome(lambda: tt.reduce_scatter([torch.ones((8, 4), dtype=torch.bfloat16)], shards, op="sum")
                    and None, "cpu") + f" {shards[0].unique().tolist()}"


@pytest.mark.parametrize("name", ["ring_bytes", "stages", "agree"])
def test_group_options_that_differ_between_ranks_raise_at_creation(name: str) -> None:
    """``tt.init(ring_bytes=...)`` with another value on one rank: the heap layout, the ring
    plan and the flag map are each rank's own reading of the options, so the ranks read each
    other's data at the wrong places -- an all-gather returned zeros, a reduce-scatter wrong
    sums on one rank, no error.  So every rank raises at creation, naming the option and
    both values."""
    out = run_multiprocess(_options_differ, 2, name, timeout=120)
    for r, o in enumerate(out):
        assert o.startswith(f"ValueError: ranks disagree on the group option {name} (rank 0: "), (r, o)


# ---- 13. a tensor whose storage was freed --------------------------------------------------
def test_a_freed_parameter_storage_is_refused_naming_it_on_every_rank() -> None:
    """FSDP2 frees unsharded parameters with ``untyped_storage().resize_(0)``: shape, dtype and
    contiguity stay, the address becomes 0.  Without a storage check such a parameter passes
    and the all-gather copies to address 0 -- the process dies (SIGSEGV) and its peer only
    times out.  The rank raises ValueError naming ``params[0]``, its peer an error naming it,
    and the next call on allocated storage is exact."""
    import tide_triton as tt

    try:
        from _dist import run_threads
    except ImportError:  # pragma: no cover
        from tests._dist import run_threads
    W = 2
    layout = tt.ShardLayout([(8, 4)], W)
    groups = tt.local_groups(W, timeout_s=10)

    def body(r: int):
        shards = [torch.full(s, 1.0 + r) for s in layout.shard_shapes(r)]
        params = [torch.zeros(8, 4)]
        freed = torch.zeros(8, 4)
        freed.untyped_storage().resize_(0)
        got = _outcome(lambda: tt.all_gather(shards, [freed] if r == 0 else params, group=groups[r]), "cpu")
        tt.all_gather(shards, params, group=groups[r])
        return got, params[0][:4].unique().tolist() + params[0][4:].unique().tolist()

    try:
        out = run_threads(body, W, timeout=60)
    finally:
        for g in groups:
            g.close()
    assert out[0][0].startswith("own error: params[0] views 128 bytes of a storage that holds 0"), out[0]
    assert out[1][0].startswith(("peer argument 0", "aborted by 0")), out[1]
    assert out[0][1] == out[1][1] == [1.0, 2.0], out


# ---- 14. outputs that share bytes ------------------------------------------------------------
def test_outputs_that_overlap_are_refused_naming_both() -> None:
    """One tensor passed as two shards (or two params) received both parameters' rows: 23
    where 3 was due for the first, no error, without the check.  The rank raises ValueError
    naming both outputs, its peer an error naming it."""
    import tide_triton as tt

    W, shapes = 2, [(8, 4), (8, 4)]
    layout = tt.ShardLayout(shapes, W)

    def body(r: int, groups: list):
        grads = [torch.full(s, float(r + 1 + 10 * i), dtype=torch.bfloat16) for i, s in enumerate(shapes)]
        one = torch.zeros(layout.shard_shapes(r)[0])
        rs = _outcome(lambda: tt.reduce_scatter(grads, [one, one], op="sum", group=groups[r]), "cpu")
        shards = [torch.full(s, float(r + 1 + 10 * i)) for i, s in enumerate(layout.shard_shapes(r))]
        both = torch.zeros(8, 4)
        ag = _outcome(lambda: tt.all_gather(shards, [both, both.view(8, 4)], group=groups[r]), "cpu")
        # prepared: the first set of addresses is bound at preparation, and checked there
        prep = _outcome(lambda: tt.prepare_all_gather(shards, [both, both.view(8, 4)], group=groups[r])
                        and None, "cpu")
        return rs, ag, prep

    for r, (rs, ag, prep) in enumerate(_on_local_groups(W, body)):
        assert rs.startswith("own error: shards[0] and shards[1] overlap in memory"), (r, rs)
        assert ag.startswith("own error: params[0] and params[1] overlap in memory"), (r, ag)
        assert prep.startswith("own error: params[0] and params[1] overlap in memory"), (r, prep)


# ---- 14b. reduce-scatter shards over gradient bytes ----------------------------------------
def test_shards_over_gradient_bytes_are_refused_naming_both() -> None:
    """A shard that is a view of the gradients (a peer's rows, or this rank's own) is written
    while the reduce-scatter still reads those bytes -- on a GPU the peers' rows are pushed by
    the copy queue while the sums are written from the caller's stream: the peer would receive
    sums instead of gradients, with no error.  Refused on every path (eager, prepared, the
    drop-in's binds), naming both tensors; the all-gather's shards may be views of its params
    (they are staged before any row is written)."""
    import tide_triton as tt

    W, shapes = 2, [(8, 4), (6, 4)]
    layout = tt.ShardLayout(shapes, W)

    def body(r: int, groups: list):
        grads = [torch.full(s, float(r + 1), dtype=torch.float32) for s in shapes]
        over_peer = [g[(1 - r) * (s[0] // W):(2 - r) * (s[0] // W)] for g, s in zip(grads, shapes)]
        eager = _outcome(lambda: tt.reduce_scatter(grads, over_peer, op="sum", group=groups[r]), "cpu")
        prep = _outcome(lambda: tt.prepare_reduce_scatter(grads, over_peer, op="sum", group=groups[r]) and None,
                        "cpu")
        shards = [torch.zeros(s) for s in layout.shard_shapes(r)]
        ok = _outcome(lambda: tt.reduce_scatter(grads, shards, op="sum", group=groups[r])
                      and sorted({v for x in shards for v in x.flatten().tolist()}), "cpu")
        params = [torch.zeros(s) for s in shapes]
        own_rows = [p[r * (s[0] // W):(r + 1) * (s[0] // W)].fill_(float(r + 1)) for p, s in zip(params, shapes)]
        ag = _outcome(lambda: tt.all_gather(own_rows, params, group=groups[r])
                      and [p[:, 0].tolist() for p in params], "cpu")
        return eager, prep, ok, ag

    import re

    for r, (eager, prep, ok, ag) in enumerate(_on_local_groups(W, body)):
        # any overlapping pair may be named (the first in address order): shard i over grads[i]
        assert re.match(r"own error: shards\[(\d)\] shares memory with grads\[\1\]", eager), (r, eager)
        assert re.match(r"own error: shards\[(\d)\] shares memory with grads\[\1\]", prep), (r, prep)
        assert ok == "ok [3.0]", (r, ok)
        assert ag == "ok [[1.0, 1.0, 1.0, 1.0, 2.0, 2.0, 2.0, 2.0], [1.0, 1.0, 1.0, 2.0, 2.0, 2.0]]", (r, ag)


def test_remembered_shards_of_another_dtype_are_checked_again() -> None:
    """The eager reduce-scatter remembers a shard list's checks by its addresses and sizes --
    and its dtype: bf16 shards at the same addresses and element counts as fp32 ones cover half
    their bytes, so their remembered spans must not stand in for the fp32 ones.  Here rank 0's
    gradient lies over the upper half of its fp32 shard, bytes the bf16 shard never had:
    refused, naming both, after an exact call on the bf16 shards."""
    import tide_triton as tt

    W, shapes = 2, [(8, 4)]
    layout = tt.ShardLayout(shapes, W)
    numel = layout.shard_numels(0)[0]

    def body(r: int, groups: list):
        buf = torch.zeros(4 * numel)  # fp32: room for the fp32 shard and a gradient past its first half
        half = buf.view(torch.bfloat16)[:numel].view(layout.shard_shapes(r)[0])
        grads = [torch.full(shapes[0], float(r + 1), dtype=torch.bfloat16)]
        first = _outcome(lambda: tt.reduce_scatter(grads, [half], op="sum", group=groups[r])
                         and sorted(set(half.float().flatten().tolist())), "cpu")
        full = buf[:numel].view(layout.shard_shapes(r)[0])
        if r == 0:  # bytes from 2 * numel * 2: inside full's (4 * numel), past half's (2 * numel)
            grads = [buf.view(torch.bfloat16)[numel:numel + 32].view(shapes[0]).fill_(1.0)]
        second = _outcome(lambda: tt.reduce_scatter(grads, [full], op="sum", group=groups[r]), "cpu")
        return first, second

    out = _on_local_groups(W, body)
    for r, (first, _second) in enumerate(out):
        assert first == "ok [3.0]", (r, first)
    assert out[0][1].startswith("own error: shards[0] shares memory with grads[0]"), out[0]
    assert "rank 0" in out[1][1], out[1]
