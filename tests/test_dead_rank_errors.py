"""A killed rank is the rank every survivor's error names (docs/errors.md, "Deadlines").

* Across declared nodes a survivor often waits for a rank that is alive and itself waits for
  the dead one: its ``PeerTimeoutError`` names the dead rank (``e.peer``) and the ranks
  between (``e.via``) -- whether it times out first (it follows the waits its peers noted) or
  its peer gives up first (the peer's published abort names the rank it gave up on).
* When the killed rank hosts torch.distributed's store (rank 0 under
  ``init_method="tcp://..."``), a survivor waiting in an agreement raises ``PeerLostError``
  naming rank 0 at once -- a ``PeerTimeoutError`` and a ``RuntimeError`` -- not torch's
  ``DistNetworkError``, and its group is broken afterwards.

Host transport, processes joined by gloo; the killed rank SIGKILLs itself.
"""
from __future__ import annotations

import contextlib
import os
import signal
import threading
import time

import pytest
import torch

try:
    from _dist import run_multiprocess
except ImportError:  # pragma: no cover
    from tests._dist import run_multiprocess

pytestmark = pytest.mark.multiproc


def _outcome(fn) -> dict:
    t0 = time.monotonic()
    try:
        fn()
    except Exception as e:  # noqa: BLE001 -- reported to the test
        return {"type": type(e).__name__, "peer": getattr(e, "peer", None), "via": getattr(e, "via", None),
                "message": str(e), "seconds": time.monotonic() - t0,
                "timeout": isinstance(e, TimeoutError), "runtime": isinstance(e, RuntimeError)}
    return {"type": None, "seconds": time.monotonic() - t0}


def _killed_across_nodes(rank: int, W: int, who_first: str, collective: str) -> dict:
    """2 x 2 nodes; rank 0 dies between two calls.  ``who_first``: whose deadline passes
    first -- ``"survivor"``: rank 3's (2 s; ranks 1 and 2, waiting for rank 0, have 5 s), or
    ``"waiter"``: ranks 1 and 2's (2 s; rank 3 has 6 s and sees their aborts)."""
    import tide_triton as tt

    short = rank == 3 if who_first == "survivor" else rank in (1, 2)
    tt.init(local_size=2, timeout_s=2.0 if short else (5.0 if who_first == "survivor" else 6.0), agree="first")
    layout = tt.ShardLayout([(8, 4)], W)
    grads = [torch.ones((8, 4), dtype=torch.bfloat16)]
    shards = [torch.zeros(s) for s in layout.shard_shapes(rank)]
    params = [torch.zeros(8, 4)]

    def call():
        if collective == "all_gather":
            tt.all_gather(shards, params)
        else:
            tt.reduce_scatter(grads, shards, op="sum")
    call()  # every rank alive: fine
    if rank == 0:
        os.kill(os.getpid(), signal.SIGKILL)
    return _outcome(call)


@pytest.mark.parametrize("who_first, collective", [("survivor", "all_gather"), ("waiter", "reduce_scatter")])
def test_every_survivor_across_nodes_names_the_killed_rank(who_first: str, collective: str) -> None:
    out = run_multiprocess(_killed_across_nodes, 4, who_first, collective, timeout=300, may_die=(0,),
                           env={"LOCAL_WORLD_SIZE": "2"})
    assert out[0] is None, out
    for r in (1, 2, 3):
        o = out[r]
        assert o["type"] == "PeerTimeoutError" and o["peer"] == 0, (r, o)
        assert "waiting for rank 0" in o["message"], (r, o)
        assert 0 not in o["via"] and r not in o["via"], (r, o)
    # rank 3 shares no node and no rail with rank 0: it waited for a live rank waiting for 0
    assert out[3]["via"] and set(out[3]["via"]) <= {1, 2}, out[3]
    assert f"rank {out[3]['via'][0]}" in out[3]["message"], out[3]
    assert out[3]["seconds"] < (4 if who_first == "survivor" else 5), out[3]


def _store_host_killed(rank: int, W: int, where: str) -> dict:
    """The process group re-made over a TCPStore served by rank 0 (what
    ``init_method="tcp://..."`` makes); rank 0 is killed while rank 1 waits for it in an
    agreement (``where="call"``) or in the group's set-up (``where="init"``)."""
    import datetime

    import torch.distributed as dist

    import tide_triton as tt
    from torch.distributed import distributed_c10d as c10d

    if rank == 0:
        store = dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=60))
        c10d._get_default_store().set("rank0-store-port", str(store.port))
    port = int(c10d._get_default_store().get("rank0-store-port"))
    dist.barrier()
    dist.destroy_process_group()
    if rank != 0:
        store = dist.TCPStore("127.0.0.1", port, None, False, timeout=datetime.timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=W,
                            timeout=datetime.timedelta(seconds=60))
    out: dict = {}
    if where == "init":
        if rank == 0:
            time.sleep(0.5)  # rank 1 is waiting in the group's set-up
            os.kill(os.getpid(), signal.SIGKILL)
        out["init"] = _outcome(lambda: tt.init(timeout_s=20))
        return out
    g = tt.init(timeout_s=20)
    layout = tt.ShardLayout([(4, 2)], W)
    grads = [torch.ones((4, 2), dtype=torch.bfloat16)]
    shards = [torch.zeros(s) for s in layout.shard_shapes(rank)]
    tt.reduce_scatter(grads, shards, op="sum")  # every rank alive: fine
    if rank == 0:
        time.sleep(0.5)  # rank 1 is waiting in the next call's agreement
        os.kill(os.getpid(), signal.SIGKILL)
    out["call"] = _outcome(lambda: tt.reduce_scatter(grads, shards, op="sum"))
    out["next"] = _outcome(lambda: tt.reduce_scatter(grads, shards, op="sum"))
    out["close"] = _outcome(g.close)
    return out


@pytest.mark.parametrize("where", ["call", "init"])
def test_store_host_killed_names_rank_0_and_breaks_the_group(where: str) -> None:
    out = run_multiprocess(_store_host_killed, 2, where, timeout=300, may_die=(0,))
    assert out[0] is None, out
    o = out[1][where]
    assert o["type"] == "PeerLostError" and o["peer"] == 0, o
    assert o["timeout"] and o["runtime"], o  # caught as a PeerTimeoutError and as torch's RuntimeError
    assert o["message"].startswith("lost rank 0 while waiting for "), o
    assert "rank 0, the store's host" in o["message"] and "restart" in o["message"], o
    assert o["seconds"] < 10, o  # the connection's failure, not the 20 s deadline
    if where == "call":
        assert out[1]["next"]["type"] == "GroupBrokenError" and "PeerLostError" in out[1]["next"]["message"], out
        assert out[1]["close"]["type"] is None, out


def test_a_failing_store_raises_peer_lost_naming_its_host() -> None:
    """Any store operation that fails (here every one) ends an exchange in ``PeerLostError``
    naming the store's host, torch's error as its cause."""
    import tide_triton as tt
    from tide_triton.group.bootstrap import Exchange, StoreKeyValue

    class DeadStore:
        host, port = "10.0.0.1", 29500

        def _reset(self, *_a):
            raise RuntimeError("Connection reset by peer")
        set = check = multi_get = get = delete_key = _reset

    assert issubclass(tt.PeerLostError, tt.PeerTimeoutError) and issubclass(tt.PeerLostError, RuntimeError)
    assert "PeerLostError" in tt.__all__
    ex = Exchange(StoreKeyValue(DeadStore()), "g/", 1, 2)
    with pytest.raises(tt.PeerLostError) as got:
        ex.exchange("x", call=3, index=1, timeout_s=5.0, what="call #3 (reduce_scatter)")
    e = got.value
    assert e.peer == 0 and e.timeout_s == 5.0, e
    assert str(e).startswith("lost rank 0 while waiting for call #3 (reduce_scatter): its part of bootstrap "
                             "exchange (call #3, step 1): torch.distributed's store (DeadStore at 10.0.0.1:29500) "
                             "failed: RuntimeError: Connection reset by peer: rank 0, the store's host"), e
    assert isinstance(e.__cause__, RuntimeError) and "Connection reset" in str(e.__cause__), e.__cause__
    ex.store_host = None  # the host is not a rank of this group
    with pytest.raises(tt.PeerLostError, match=r"^lost the store's host .* global rank 0 \(not in this group\)"):
        ex.identities([0], 3, timeout_s=5.0, what="call #3")


def _identity(rank: int, kv, world_size: int = 4):
    """A group's call-identity side alone (no transport), in call #5, over the store ``kv``."""
    from tide_triton.group.bootstrap import Exchange
    from tide_triton.group.calls import CallIdentity

    g = CallIdentity(rank, world_size, Exchange(kv, "g/", rank, world_size), flags=None, timeout_s=2.0)
    g.seq = 5
    return g


@contextlib.contextmanager
def _waiting(kv, waits: dict[int, int]):
    """Ranks ``waits`` keys waiting for their values in call #5: notes renewed every 50 ms."""
    from tide_triton.group.bootstrap import Exchange

    ex = {r: Exchange(kv, "g/", r, 4) for r in waits}
    stop = threading.Event()

    def renew() -> None:
        while not stop.is_set():
            for r, p in waits.items():
                ex[r].note_wait(5, p)
            stop.wait(0.05)
    th = threading.Thread(target=renew, daemon=True)
    th.start()
    try:
        yield
    finally:
        stop.set()
        th.join()


def test_a_timeout_follows_live_waits_to_the_rank_that_waits_for_nobody() -> None:
    """Rank 3 timed out waiting for rank 2, whose note (renewed while it waits) says it waits
    for rank 1, whose note says rank 0; rank 0 noted nothing: rank 0 is named, via 2 and 1.
    A note that is not renewed is a wait that ended: the chain stops there."""
    import tide_triton as tt
    from tide_triton.group.bootstrap import LocalKeyValue

    kv = LocalKeyValue()
    me = _identity(3, kv)
    with _waiting(kv, {2: 1, 1: 0}):
        e = me.explain_timeout(tt.PeerTimeoutError(2, "rank 2's all-gather rail", 2.0), 5)
    assert isinstance(e, tt.PeerTimeoutError) and e.peer == 0 and e.via == (2, 1), e
    assert str(e) == ("timed out after 2.0 s waiting for rank 0 (rank 2's all-gather rail -- from rank 2; rank 2 "
                      "waits for rank 1; rank 1 waits for rank 0, which is missing)"), e
    # the notes are no longer renewed (both waits ended): rank 2 is the one to look at
    t0 = time.monotonic()
    assert me.explain_timeout(tt.PeerTimeoutError(2, "x", 2.0), 5) is None
    assert time.monotonic() - t0 < 2.0


def test_a_timeout_keeps_its_rank_when_the_waits_go_round() -> None:
    """Ranks waiting on each other (rank 2 for this rank, or 2 for 1 and 1 for 2: calls that
    differ) leave nobody missing: the error keeps the rank waited for."""
    import tide_triton as tt
    from tide_triton.group.bootstrap import LocalKeyValue

    for waits in ({2: 3}, {2: 1, 1: 2}):
        kv = LocalKeyValue()
        me = _identity(3, kv)
        with _waiting(kv, waits):
            assert me.explain_timeout(tt.PeerTimeoutError(2, "x", 2.0), 5) is None, waits


def test_a_peer_that_gave_up_on_a_third_rank_names_that_rank() -> None:
    """Rank 1 gave up waiting for rank 0 (its published abort says so): rank 3, waiting for
    rank 1, raises ``PeerTimeoutError`` naming rank 0 via rank 1 -- and rank 0, the rank it
    gave up on, keeps ``PeerAbortedError`` naming rank 1."""
    import tide_triton as tt
    from tide_triton.group.bootstrap import Exchange, LocalKeyValue

    kv = LocalKeyValue()
    Exchange(kv, "g/", 1, 4).publish_abort(
        5, "failed", "PeerTimeoutError: timed out after 1.5 s waiting for rank 0 (x)", gave_up=(0, 1.5, "x", ()))
    three, zero = _identity(3, kv), _identity(0, kv)
    with pytest.raises(tt.PeerTimeoutError) as got:
        three._raise_abort(1, three._exchange.abort_of(1, 5))
    assert got.value.peer == 0 and got.value.via == (1,), got.value
    # the deadline that passed is rank 1's, not this rank's (2.0 s)
    assert str(got.value) == "timed out after 1.5 s waiting for rank 0 (rank 1 gave up waiting for it in call #5: x)"
    with pytest.raises(tt.PeerAbortedError, match="rank 1 abandoned collective call #5"):
        zero._raise_abort(1, zero._exchange.abort_of(1, 5))
    e = three.explain_timeout(tt.PeerTimeoutError(1, "y", 2.0), 5)  # its deadline passed first
    assert isinstance(e, tt.PeerTimeoutError) and e.peer == 0 and e.via == (1,), e
