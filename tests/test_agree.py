"""``agree="first"``: a signature agreed once is trusted afterwards (no bootstrap round trip
per collective), results unchanged; a rank with bad arguments on a repeated call raises
alone and publishes that it abandoned the call: its peers raise ``PeerArgumentError`` naming
it at once (not after the timeout)."""
from __future__ import annotations

import pytest
import torch

try:
    from _dist import run_multiprocess
except ImportError:  # pragma: no cover
    from tests._dist import run_multiprocess

from tide_triton.plan.layout import ShardLayout

pytestmark = pytest.mark.multiproc


def _repeat(rank: int, W: int, bad_on_repeat: bool) -> dict:
    import time

    import tide_triton as tt
    from tide_triton.errors import PeerTimeoutError

    g = tt.init(timeout_s=20, agree="first")
    exchanges = []
    real = g.exchange
    g.exchange = lambda obj: (exchanges.append(1), real(obj))[1]
    shapes = [(5, 3), (2,)]
    layout = ShardLayout(shapes, W)
    grads = [torch.full(s, float(rank + 1), dtype=torch.bfloat16) for s in shapes]
    out = {}
    for call in range(3):
        shards = [torch.empty(s) for s in layout.shard_shapes(rank)]
        if bad_on_repeat and call == 2 and rank == 1:
            shards = shards[:1]  # wrong length: this rank's own error, raised at once
        t0 = time.monotonic()
        try:
            tt.reduce_scatter(grads, shards, op="sum")
        except PeerTimeoutError as e:
            out[call] = f"timeout peer={e.peer}"
            break
        except tt.PeerArgumentError as e:
            out[call] = f"peer error rank={e.rank}: {e}"
            out["seconds"] = time.monotonic() - t0
            break
        except ValueError as e:
            out[call] = f"own error: {e}"
            break
        want = W * (W + 1) / 2
        out[call] = all(bool((x == want).all()) for x in shards)
        out[f"exchanges after {call}"] = len(exchanges)
    g.close()
    return out


def test_agree_first_skips_the_exchange_for_a_known_signature() -> None:
    out = run_multiprocess(_repeat, 2, False, timeout=120)
    for res in out:
        assert res[0] is True and res[1] is True and res[2] is True, res
        # one exchange to create the host transport's heap names etc. may precede; the
        # agreement itself happens at the first call only
        assert res["exchanges after 1"] == res["exchanges after 0"], res
        assert res["exchanges after 2"] == res["exchanges after 0"], res


def test_agree_first_bad_repeat_raises_locally_and_peers_raise_naming_it_at_once() -> None:
    out = run_multiprocess(_repeat, 2, True, timeout=120)
    assert out[1][2].startswith("own error: shards must have 2 entries"), out[1]
    assert out[0][2].startswith("peer error rank=1: rank 1 rejected its arguments: ValueError: shards must "
                                "have 2 entries"), out[0]
    assert out[0]["seconds"] < 5, out[0]  # the timeout is 20 s: the abort was seen, not waited out


def test_agree_option_is_validated() -> None:
    import tide_triton as tt

    with pytest.raises(ValueError, match='agree must be "always" or "first"'):
        tt.GroupOptions(agree="sometimes")


def test_agreement_exchanges_a_fingerprint_not_the_signature() -> None:
    """``agree="always"`` (the default) exchanges each call's signature fingerprint: no
    bootstrap message grows with the parameter count (pickling, unpickling and comparing W
    signatures of 771 shapes cost ~1 ms per call).  Different calls still fail with the
    field named (a second exchange brings the signatures, tests/test_faults.py)."""
    import pickle

    import tide_triton as tt

    try:
        from _dist import run_threads
    except ImportError:  # pragma: no cover
        from tests._dist import run_threads

    W, shapes = 2, [(4, 2)] * 3000
    layout = ShardLayout(shapes, W)
    groups = tt.local_groups(W, timeout_s=60)
    sizes: list[int] = []
    def recording(real):
        def exchange(obj):
            sizes.append(len(pickle.dumps(obj)))
            return real(obj)
        return exchange

    for g in groups:
        g.exchange = recording(g.exchange)

    def body(r: int) -> None:
        shards = [torch.full(s, float(r + 1), dtype=torch.bfloat16) for s in layout.shard_shapes(r)]
        params = [torch.empty(s, dtype=torch.bfloat16) for s in shapes]
        for _ in range(2):
            tt.all_gather(shards, params, group=groups[r])
        assert all(bool((p[:2] == 1).all() and (p[2:] == 2).all()) for p in params)

    try:
        run_threads(body, W, timeout=300)
    finally:
        for g in groups:
            g.close()
    assert sizes and max(sizes) < 1024, sorted(sizes)[-5:]


def test_thousands_of_signatures_stay_fingerprinted_and_calls_describe_none() -> None:
    """The FSDP2 drop-in labels each parameter group's signatures with its module: a model of
    a few thousand groups has as many signatures, and each call looks its own up.  All of them
    stay cached (a second pass over 5,000 costs no fingerprint again), and a call's identity
    keeps its signature, described only for an error message -- ``describe`` of a 771-parameter
    signature is a ``repr`` of every shape (~0.2 ms) and its cache is small."""
    from tide_triton.group import calls
    from tide_triton.group import signatures

    sigs = [("reduce_scatter", ("FSDP2 group", f"layers.{i}"), ("shapes", ((512, 1024),) * 3)) for i in range(5000)]
    for s in sigs:
        signatures.fingerprint(s)
    before = signatures.fingerprint.cache_info()
    for s in sigs:
        signatures.fingerprint(s)
    after = signatures.fingerprint.cache_info()
    assert after.misses == before.misses and after.hits - before.hits == len(sigs), (before, after)

    class G:
        _keys: dict = {}
    c = calls.Call(G(), "reduce_scatter")
    c.seq = 7
    described = signatures.describe.cache_info()
    c.set_signature(("reduce_scatter", ("shapes", ((3, 5),) * 771), ("new", 1)))
    assert signatures.describe.cache_info() == described and G._keys[7][1][0] == "reduce_scatter"


def test_an_agreement_nested_in_a_call_keeps_the_calls_identity() -> None:
    """A collective that makes a heap region inside itself (the multicast path's object)
    agrees the region's signature without replacing the call's own: the call-identity check
    compares the call's, and errors name the call, not ``heap_region``."""
    import tide_triton as tt

    g = tt.local_groups(1, timeout_s=10)[0]
    try:
        with g.call("reduce_scatter") as c:
            g.agree(("reduce_scatter", ("shapes", ((4,),))), None)
            key, sig = c.key, c.signature
            g.agree(("heap_region", "multicast", "cuda"), None)
            assert (c.key, c.signature) == (key, sig)
    finally:
        g.close()
