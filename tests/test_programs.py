"""Prepared collectives (``tt.prepare_reduce_scatter`` / ``tt.prepare_all_gather``, then
``.run()``), on the host transport with the ranks as threads: every run exact (integer-valued
bf16: the fp32 sums are exact) and bit-identical to the eager call on the same values, runs
interleaved with eager calls and with other prepared collectives, two ranks running different
prepared collectives end in a timeout naming the peer (the token protocol never pairs them),
moved storage is refused, and a run's host work does not grow with the parameter count."""
from __future__ import annotations

import os

import pytest
import torch

try:
    from _dist import run_threads
except ImportError:  # pragma: no cover
    from tests._dist import run_threads

import tide_triton as tt
from tide_triton.executors import state as exec_state
from tide_triton.errors import GroupBrokenError, PeerAbortedError, PeerTimeoutError
from tide_triton.plan.layout import ShardLayout

W = 3
SHAPES = [(37, 5), (3,), (53, 2), (1, 4), (100,)]  # uneven rows: padded and empty shards at W=3


def _grads(gen: torch.Generator, shapes) -> list[list[torch.Tensor]]:
    return [[torch.randint(-8, 9, s, generator=gen).to(torch.bfloat16) for s in shapes] for _ in range(W)]


def _refill(grads, gen: torch.Generator) -> None:
    """New values, same storage (what a training step does to its gradients)."""
    for per_rank in grads:
        for x in per_rank:
            x.copy_(torch.randint(-8, 9, x.shape, generator=gen).to(torch.bfloat16))


def _want(grads, p: int) -> torch.Tensor:
    return sum(grads[q][p].float() for q in range(W))


def _assert_exact(layout: ShardLayout, r: int, shards, params, want, where: tuple, eager=None) -> None:
    """Rank ``r``'s shards hold its rows of each sum ``want[p]`` with zero padding rows, its
    bf16 params the whole sum, and -- ``eager`` given -- the shards equal the eager call's bit
    for bit."""
    for p, w in enumerate(want):
        c, rows = layout.rows_per_rank[p], layout.shard_rows(r)[p]
        assert torch.equal(shards[p][:rows], w[r * c: r * c + rows]), (*where, r, p)
        assert torch.equal(shards[p][rows:], torch.zeros_like(shards[p][rows:])), (*where, r, p)
        if eager is not None:
            assert torch.equal(shards[p], eager[p]), (*where, r, p)  # bit for bit the eager call
        assert torch.equal(params[p], w.to(torch.bfloat16)), (*where, r, p)


def _groups(**options):
    return tt.local_groups(W, timeout_s=options.pop("timeout_s", 30), ring_bytes=options.pop("ring_bytes", 128 * W),
                           **options)


def _spawn(child, world: int, *args, **env: str) -> list:
    """``child`` in ``world`` processes (``tests/_dist.run_multiprocess``, 240 s), multicast off,
    ``env`` added to the children's environment."""
    try:
        from _dist import run_multiprocess
    except ImportError:  # pragma: no cover
        from tests._dist import run_multiprocess
    return run_multiprocess(child, world, *args, timeout=240,
                            env={"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", **env})


def _close(groups) -> None:
    for g in groups:
        g.close()


@pytest.mark.parametrize("rs_push", ["auto", "kernel"])
def test_prepared_runs_are_exact_and_equal_the_eager_calls(rs_push: str) -> None:
    """Three runs of a prepared reduce-scatter (op sum, padded shards) and of two prepared
    all-gathers (fp32 shards -> bf16 params, a cast; bf16 -> bf16, copies), with new gradient
    values before each and eager calls on other tensors in between; each run equals the
    contract and the eager call on the same values, bit for bit; padding rows become zero.
    ``rs_push="kernel"``: the reduce-scatters push their slices with the segment kernel."""
    layout = ShardLayout(SHAPES, W)
    other_shapes = [(4, 4), (9,)]
    other_layout = ShardLayout(other_shapes, W)
    gen = torch.Generator().manual_seed(11)
    grads = _grads(gen, SHAPES)
    other = _grads(gen, other_shapes)
    groups = _groups(rs_push=rs_push)
    state: dict[int, dict] = {}

    def prepare(r: int) -> None:
        g = groups[r]
        st = state[r] = {
            "shards": [torch.full(s, -1.0) for s in layout.shard_shapes(r, padded=True)],
            "params": [torch.full(s, -3.0, dtype=torch.bfloat16) for s in SHAPES],
            "bshards": [torch.zeros(s, dtype=torch.bfloat16) for s in layout.shard_shapes(r)],
            "bparams": [torch.zeros(s, dtype=torch.bfloat16) for s in SHAPES],
        }
        st["rs"] = tt.prepare_reduce_scatter(grads[r], st["shards"], group=g, op="sum")
        st["ag"] = tt.prepare_all_gather([x[:n] for x, n in zip(st["shards"], layout.shard_rows(r))],
                                         st["params"], group=g)
        st["ag16"] = tt.prepare_all_gather(st["bshards"], st["bparams"], group=g)
        assert st["rs"].plan.rounds >= 3  # more rounds than stages: slots reused within a run

    def step(r: int):
        g, st = groups[r], state[r]
        for x in st["shards"]:
            x.fill_(-1.0)  # stale values: a run must overwrite every real row and zero the padding
        st["rs"].run()
        st["ag"].run()
        for i, x in enumerate(st["bshards"]):
            x.copy_(st["shards"][i][:x.shape[0]].to(torch.bfloat16))
        st["ag16"].run()
        osh = [torch.empty(s) for s in other_layout.shard_shapes(r)]  # eager calls between runs
        tt.reduce_scatter(other[r], osh, group=g, op="sum")
        eager = [torch.empty(s) for s in layout.shard_shapes(r, padded=True)]
        tt.reduce_scatter(grads[r], eager, group=g, op="sum")
        return ([x.clone() for x in st["shards"]], [x.clone() for x in st["params"]],
                [x.clone() for x in st["bparams"]], eager, osh)

    try:
        run_threads(prepare, W, timeout=120)
        for k in range(3):
            if k:
                _refill(grads, gen)
            out = run_threads(step, W, timeout=120)
            for r, (shards, params, bparams, eager, osh) in enumerate(out):
                want = [_want(grads, p) for p in range(len(SHAPES))]
                _assert_exact(layout, r, shards, params, want, (k,), eager=eager)
                for p, w in enumerate(want):
                    assert torch.equal(bparams[p], w.to(torch.bfloat16)), (k, r, p)
                for p in range(len(other_shapes)):
                    want = _want(other, p)
                    c, rows = other_layout.rows_per_rank[p], other_layout.shard_rows(r)[p]
                    assert torch.equal(osh[p], want[r * c: r * c + rows]), (k, r, p)
    finally:
        _close(groups)


def test_prepared_collectives_alternate_and_accumulate() -> None:
    """Two prepared reduce-scatters of different layers share the prepared ring (each run ends
    with every slot reduced): A (avg), B (sum, accumulate), A, B -- each run exact, B adding to
    its shards; several rounds per run, so slots are reused inside a run too."""
    shapes_a, shapes_b = SHAPES, [(60, 3), (50,), (2, 2)]
    la, lb = ShardLayout(shapes_a, W), ShardLayout(shapes_b, W)
    gen = torch.Generator().manual_seed(5)
    ga, gb = _grads(gen, shapes_a), _grads(gen, shapes_b)
    groups = _groups()
    state: dict[int, tuple] = {}

    def prepare(r: int) -> int:
        sa = [torch.empty(s) for s in la.shard_shapes(r)]
        sb = [torch.zeros(s) for s in lb.shard_shapes(r)]
        a = tt.prepare_reduce_scatter(ga[r], sa, group=groups[r], op=0.5)
        b = tt.prepare_reduce_scatter(gb[r], sb, group=groups[r], op="sum", accumulate=True)
        state[r] = (a, b, sa, sb)
        return a.plan.rounds

    def run(r: int, which: str):
        a, b, sa, sb = state[r]
        (a if which == "a" else b).run()
        return [x.clone() for x in (sa if which == "a" else sb)]

    try:
        rounds = run_threads(prepare, W, timeout=60)
        assert min(rounds) >= 3, rounds  # more rounds than stages: slots reused within a run
        for k, which in enumerate("abab"):
            out = run_threads(lambda r, w=which: run(r, w), W, timeout=60)
            layout, grads = (la, ga) if which == "a" else (lb, gb)
            times = 1 if which == "a" else (k + 1) // 2  # b accumulates: 1x, then 2x the sum
            for r, shards in enumerate(out):
                for p in range(len(layout)):
                    c, rows = layout.rows_per_rank[p], layout.shard_rows(r)[p]
                    want = _want(grads, p)[r * c: r * c + rows]
                    want = want * 0.5 if which == "a" else want * times
                    assert torch.equal(shards[p], want), (which, k, r, p)
    finally:
        _close(groups)


def test_ranks_running_different_prepared_collectives_time_out_naming_the_peer() -> None:
    """Rank 0 runs prepared collective A while the others run B: their tokens differ, so no
    rank takes the other's data; every rank raises -- PeerTimeoutError naming the peer whose
    token did not come, or PeerAbortedError naming the peer that gave up first -- and the
    group is broken afterwards (its flags hold a half-done run)."""
    layout, grads, groups = _mismatch_setup(2)

    def body(r: int):
        sa, sb = _two_shard_sets(layout, r)
        a = tt.prepare_reduce_scatter(grads[r], sa, group=groups[r], op="sum")
        b = tt.prepare_reduce_scatter(grads[r], sb, group=groups[r], op="sum")
        try:
            (a if r == 0 else b).run()
        except (PeerTimeoutError, PeerAbortedError) as e:
            first = e
        else:
            return "no error"
        with pytest.raises(GroupBrokenError):
            a.run()
        return first

    try:
        out = run_threads(body, W, timeout=60)
    finally:
        _close(groups)
    _assert_each_rank_names_another(out)
    for r, e in enumerate(out):
        assert "prepared reduce-scatter" in str(e), (r, str(e))


def _mismatch_setup(seed: int):
    """Layout, gradients and groups (3 s deadline) for the tests where rank 0 runs one
    collective and the others another."""
    return ShardLayout(SHAPES, W), _grads(torch.Generator().manual_seed(seed), SHAPES), _groups(timeout_s=3)


def _two_shard_sets(layout: ShardLayout, r: int):
    return ([torch.empty(s) for s in layout.shard_shapes(r)] for _ in range(2))


def _assert_each_rank_names_another(errors) -> None:
    """Every rank raised PeerTimeoutError naming a peer whose token did not come, or
    PeerAbortedError naming the peer that gave up first; someone saw the wrong token."""
    for r, e in enumerate(errors):
        assert isinstance(e, (PeerTimeoutError, PeerAbortedError)), (r, e)
        assert (e.peer if isinstance(e, PeerTimeoutError) else e.rank) != r, (r, str(e))
    assert any(isinstance(e, PeerTimeoutError) for e in errors)


def test_prepared_collective_refuses_moved_storage_and_bad_arguments() -> None:
    """A run whose tensors' storage moved raises ValueError naming the tensor, a bad ``stream``
    TypeError -- before anything moves, but a run is not agreed with the peers, so the error
    breaks the group (see the next test): the next run raises ``GroupBrokenError`` naming the
    first cause; after the group is closed a run says so."""
    layout = ShardLayout(SHAPES, W)
    gen = torch.Generator().manual_seed(3)
    grads = _grads(gen, SHAPES)

    def body(r: int, groups, how: str):
        shards = [torch.empty(s) for s in layout.shard_shapes(r)]
        rs = tt.prepare_reduce_scatter(grads[r], shards, group=groups[r], op="sum")
        rs.run()  # usable
        if how == "moved":
            moved = grads[r][2]
            keep = moved.data
            moved.data = moved.data.clone()  # same values, new storage
            with pytest.raises(ValueError, match=r"grads\[2\] moved \(data_ptr 0x[0-9a-f]+ when prepared"):
                rs.run()
            moved.data = keep
        else:
            with pytest.raises(TypeError, match="stream must be None or a torch.cuda.Stream, got str"):
                rs.run(stream="default")
        with pytest.raises(GroupBrokenError, match="ValueError|TypeError"):
            rs.run()
        return [x.clone() for x in shards], rs

    for how in ("moved", "stream"):
        groups = _groups()
        try:
            out = run_threads(lambda r, gs=groups, h=how: body(r, gs, h), W, timeout=60)
            preps = [rs for _, rs in out]
        finally:
            _close(groups)
        with pytest.raises(RuntimeError, match="this tide_triton group is closed"):
            preps[0].run()
        for r, (shards, _) in enumerate(out):  # the first run's sums, untouched since
            for p in range(len(SHAPES)):
                c, rows = layout.rows_per_rank[p], layout.shard_rows(r)[p]
                assert torch.equal(shards[p], _want(grads, p)[r * c: r * c + rows]), (how, r, p)


@pytest.mark.parametrize("entry", ["run", "run_on"])
def test_a_run_that_fails_on_one_rank_never_pairs_with_the_peers_next_run(entry: str) -> None:
    """Rank 0's run raises before it moves anything (its gradients' storage moved), the
    others' run normally and wait for its tokens.  Counted as an argument error, the group
    would stay usable and rank 0's next run's tokens complete the peers' *previous* run --
    every later run paired with a neighbour, wrong sums on every rank and no error.  Every
    rank's every step is its exact sum or an error, and after the failed step no rank returns
    a value."""
    layout = ShardLayout(SHAPES, W)
    groups = _groups(timeout_s=3)
    steps = 4

    def body(r: int):
        grads = [torch.zeros(s, dtype=torch.bfloat16) for s in SHAPES]
        shards = [torch.full(s, -1.0) for s in layout.shard_shapes(r, padded=True)]
        if entry == "run":
            rs = tt.prepare_reduce_scatter(grads, shards, group=groups[r], op="sum")
        else:  # as the FSDP2 drop-in makes it: keeps no tensors, run on those of the moment
            from tide_triton.collectives import prepared_reduce_scatter_call

            rs = prepared_reduce_scatter_call(groups[r], grads, shards, "sum", False, hold=False)
        got = []
        for step in range(1, steps + 1):
            for x in grads:
                x.fill_(10 * step + r)
            try:
                if r == 0 and step == 2:
                    keep = grads[0].data
                    grads[0].data = keep.clone()
                    try:
                        if entry == "run":
                            rs.run()
                        else:  # the drop-in's entry: new addresses are checked in full
                            rs._run_on([torch.zeros(3, 3, dtype=torch.bfloat16), *grads[1:]], shards)
                    finally:
                        grads[0].data = keep
                elif entry == "run":
                    rs.run()
                else:
                    rs._run_on(grads, shards)
                got.append((step, "ok", shards[1][0].item()))
            except Exception as e:  # noqa: BLE001 - the outcome is the test's subject
                got.append((step, type(e).__name__, str(e)[:200]))
        return got

    try:
        out = run_threads(body, W, timeout=90)
    finally:
        _close(groups)
    want = {step: float(sum(10 * step + q for q in range(W))) for step in range(1, steps + 1)}
    for r, got in enumerate(out):
        assert got[0] == (1, "ok", want[1]), (r, got)
        for step, kind, value in got:
            if kind == "ok":
                assert value == want[step], (r, got)  # a value is always the right one
                assert step < 2, (r, got)  # and none after the failed step
    assert out[0][1][1] in ("ValueError", "TypeError"), out[0]
    assert all(kind == "GroupBrokenError" for _, kind, _ in out[0][2:]), out[0]
    for r in range(1, W):  # the peers' step 2 names rank 0 (its abort), later steps the break
        assert out[r][1][1] in ("PeerAbortedError", "PeerTimeoutError"), out[r]
        assert "rank 0" in out[r][1][2], out[r]


@pytest.mark.parametrize("entry", ["prepared", "eager"])
@pytest.mark.parametrize("case", ["exact", "dtype", "over_a_shard", "shard_transposed"])
def test_new_gradients_beside_known_shards_are_checked_and_paired_with_them(case: str, entry: str) -> None:
    """The drop-in's steady state on MoE layers: autograd's gradients at new addresses every
    step, beside the same shards -- its prepared runs and its eager calls.  The shards' own
    checks are remembered, not redone; the new gradients' checks and their pairing with the
    shards are never skipped, nor the shards' shapes and layout: at step 3 rank 0 passes a
    gradient of another dtype, or one over a shard's bytes, or a shard as a transposed view of
    its own bytes (same address, same element count, not contiguous), and it is refused naming
    it (its peers' step names rank 0); every step before is exact, and with good gradients
    every step is."""
    from tide_triton.executors import state as exec_state
    from tide_triton.collectives import prepared_reduce_scatter_call

    layout = ShardLayout(SHAPES, W)
    groups = _groups(timeout_s=3)
    steps = 4

    def body(r: int):
        shards = [torch.full(s, -1.0) for s in layout.shard_shapes(r, padded=True)]
        if entry == "prepared":
            rs = prepared_reduce_scatter_call(groups[r], [torch.zeros(s, dtype=torch.bfloat16) for s in SHAPES],
                                              shards, "sum", False, hold=False)
        got = []
        for step in range(1, steps + 1):
            grads = [torch.full(s, 10.0 * step + r, dtype=torch.bfloat16) for s in SHAPES]  # new addresses
            if r == 0 and step == 3 and case == "dtype":
                grads[1] = grads[1].half()
            elif r == 0 and step == 3 and case == "over_a_shard":
                grads[1] = shards[0].view(-1).view(torch.bfloat16)[:3].fill_(10.0 * step)
            passed = shards
            if r == 0 and step == 3 and case == "shard_transposed":
                rows, cols = shards[0].shape
                passed = [shards[0].view(cols, rows).t(), *shards[1:]]
            try:
                if entry == "prepared":
                    rs._run_on(grads, passed)
                else:
                    tt.reduce_scatter(grads, passed, group=groups[r], op="sum")
                got.append((step, "ok", [x.clone() for x in shards]))
            except Exception as e:  # noqa: BLE001 - the outcome is the test's subject
                got.append((step, type(e).__name__, str(e)[:300]))
        return got, len(rs._checked_second if entry == "prepared" else exec_state.of(groups[r]).checked_shards)

    try:
        out = run_threads(body, W, timeout=90)
    finally:
        _close(groups)
    for r, (got, remembered) in enumerate(out):
        assert remembered == 1, (r, remembered)  # one set of shards, checked once
        for step, kind, value in got:
            if case == "exact" or step < 3:
                assert kind == "ok", (r, step, kind, value)
                sums = [torch.full(s, float(sum(10 * step + q for q in range(W)))) for s in SHAPES]
                _assert_exact(layout, r, value, [x.to(torch.bfloat16) for x in sums], sums, (case, step))
    if case == "exact":
        return
    step3 = out[0][0][2]
    if case == "dtype":
        assert step3[1] == "TypeError" and "grads[1] must be bfloat16" in step3[2], step3
    elif case == "shard_transposed":
        assert step3[1] == "ValueError" and "shards[0] must be contiguous" in step3[2], step3
    else:
        assert step3[1] == "ValueError" and "shards[0] shares memory with grads[1]" in step3[2], step3
    # a prepared run's error breaks the group (its peers time out on, or read, rank 0's abort);
    # an eager call's refusal reaches its peers as rank 0's argument error
    peer_errors = ("PeerAbortedError", "PeerTimeoutError") if entry == "prepared" else (
        "PeerArgumentError", "PeerAbortedError", "PeerTimeoutError")
    for r in range(1, W):
        assert out[r][0][2][1] in peer_errors and "rank 0" in out[r][0][2][2], out[r][0][2]


def test_prepared_collectives_need_one_node() -> None:
    """A group of several nodes cannot prepare: ValueError on every rank, naming why."""
    nodes = tt.local_groups(4, local_size=2, timeout_s=30)
    two = ShardLayout([(8, 2)], 4)
    try:
        def refuse(r: int):
            with pytest.raises(ValueError, match="prepared collectives need a group of one node, this one spans 2"):
                tt.prepare_reduce_scatter([torch.zeros(8, 2, dtype=torch.bfloat16)],
                                          [torch.empty(s) for s in two.shard_shapes(r)], group=nodes[r])
        run_threads(refuse, 4, timeout=60)
    finally:
        _close(nodes)


def test_a_run_does_host_work_independent_of_the_parameter_count(monkeypatch) -> None:
    """A run makes no argument check and no agreement, and hands the transport the same
    number of operations for a layer of 8 parameters as for one of 64 with the same bytes
    (the rounds of the ring decide it, not the parameters)."""
    import tide_triton.collectives as coll
    from tide_triton.transport.host import HostTransport

    calls: dict[str, int] = {}
    for name in ("copy_prepared", "signal_all", "wait_all_equal", "wait_all"):
        real = getattr(HostTransport, name)

        def counted(self, *a, _real=real, _name=name, **k):
            calls[_name] = calls.get(_name, 0) + 1
            return _real(self, *a, **k)
        monkeypatch.setattr(HostTransport, name, counted)

    def per_run(shapes) -> dict[str, int]:
        layout = ShardLayout(shapes, W)
        gen = torch.Generator().manual_seed(9)
        grads = _grads(gen, shapes)
        groups = _groups(ring_bytes=1024 * W)
        preps: dict[int, tuple] = {}

        def prepare(r: int) -> None:
            shards = [torch.empty(s) for s in layout.shard_shapes(r)]
            params = [torch.empty(s, dtype=torch.bfloat16) for s in shapes]
            preps[r] = (tt.prepare_reduce_scatter(grads[r], shards, group=groups[r], op="sum"),
                        tt.prepare_all_gather(shards, params, group=groups[r]))

        try:
            run_threads(prepare, W, timeout=60)
            calls.clear()
            checks = monkeypatch.context()
            with checks as m:
                m.setattr(coll, "_full_and_shards", lambda *a, **k: pytest.fail("a run checked its arguments"))
                m.setattr(groups[0], "agree", lambda *a, **k: pytest.fail("a run agreed with its peers"))
                run_threads(lambda r: (preps[r][0].run(), preps[r][1].run()), W, timeout=60)
            return dict(calls)
        finally:
            _close(groups)

    few = per_run([(24, 32)] * 8)                      # 8 parameters
    many = per_run([(3, 32)] * 64)                     # 64 parameters, the same bytes and rows per rank
    assert few == many, (few, many)


class _RankPair:
    """One process's prepared reduce-scatter (bf16 -> fp32, sum, padded shards) and all-gather
    (fp32 shards -> bf16 params, a cast) over ``SHAPES``, with the helpers the children share:
    new gradient values, and a snapshot of the shards, params and the eager reduce-scatter of the
    same values (on other tensors), on the CPU."""

    def __init__(self, rank: int, world_size: int, device: str) -> None:
        import tide_triton as tt_

        try:
            from _dist import rank_device
        except ImportError:  # pragma: no cover
            from tests._dist import rank_device
        self.rank, self.tt = rank, tt_
        dev = self.dev = rank_device(rank) if device == "cuda" else torch.device("cpu")
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
        self.g = tt_.init(timeout_s=60, ring_bytes=4096 * world_size,
                          rs_push=os.environ.get("TIDE_TEST_RS_PUSH", "auto"))
        self.layout = layout = ShardLayout(SHAPES, world_size)
        self.grads = [torch.zeros(s, dtype=torch.bfloat16, device=dev) for s in SHAPES]
        self.shards = [torch.full(s, -1.0, device=dev) for s in layout.shard_shapes(rank, padded=True)]
        self.params = [torch.full(s, -3.0, dtype=torch.bfloat16, device=dev) for s in SHAPES]
        self.rs = tt_.prepare_reduce_scatter(self.grads, self.shards, group=self.g, op="sum")
        self.ag = tt_.prepare_all_gather([x[:n] for x, n in zip(self.shards, layout.shard_rows(rank))],
                                         self.params, group=self.g)

    def values(self, k: int) -> None:
        """Gradients of values set ``k`` (see :func:`_pair_want`); shards reset to -1."""
        gen = torch.Generator().manual_seed(100 * k + self.rank)
        for x in self.grads:
            x.copy_(torch.randint(-8, 9, x.shape, generator=gen).to(torch.bfloat16))
        for x in self.shards:
            x.fill_(-1.0)

    def run(self) -> None:
        self.rs.run()
        self.ag.run()

    def snapshot(self) -> tuple:
        eager = [torch.empty(s, device=self.dev) for s in self.layout.shard_shapes(self.rank, padded=True)]
        self.tt.reduce_scatter(self.grads, eager, group=self.g, op="sum")
        if self.dev.type == "cuda":
            self.tt.synchronize(self.g, timeout_s=60)
        return tuple([x.to("cpu", copy=True) for x in xs] for xs in (self.shards, self.params, eager))


def _pair_want(k: int, world: int) -> list[torch.Tensor]:
    """The exact sums of :meth:`_RankPair.values` set ``k`` over ``world`` ranks."""
    grads = [[torch.randint(-8, 9, s, generator=gen).to(torch.bfloat16) for s in SHAPES]
             for gen in (torch.Generator().manual_seed(100 * k + q) for q in range(world))]
    return [sum(grads[q][p].float() for q in range(world)) for p in range(len(SHAPES))]


def _prepared_child(rank: int, world_size: int, device: str) -> list:
    """One process per rank: the prepared pair run three times with new gradient values each
    time, then its reduce-scatter once more on copies of the gradients at new addresses (bound
    anew: the FSDP2 drop-in's ``_run_on``), each beside the eager reduce-scatter on the same
    values; what every run produced."""
    pair = _RankPair(rank, world_size, device)
    out = []
    try:
        for k in range(3):
            pair.values(k)
            pair.run()
            out.append(pair.snapshot())
        pair.values(3)
        pair.rs._run_on([x.clone() for x in pair.grads], pair.shards)
        pair.ag.run()
        out.append(pair.snapshot())
    finally:
        pair.g.close()
    return out


@pytest.mark.multiproc
@pytest.mark.parametrize("rs_push", ["auto", "kernel"])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_prepared_collectives_one_process_per_rank(device: str, rs_push: str) -> None:
    """How users run: one process per rank (on a GPU machine: cuda:LOCAL_RANK, or every rank
    on one GPU with --share-gpu); every run exact and bit-identical to the eager call
    (``rs_push="kernel"``: reduce-scatter pushes by the segment kernel, on the copy stream)."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    world = 2
    out = _spawn(_prepared_child, world, device, TIDE_TEST_RS_PUSH=rs_push)
    layout = ShardLayout(SHAPES, world)
    for k in range(4):
        want = _pair_want(k, world)
        for r in range(world):
            shards, params, eager = out[r][k]
            _assert_exact(layout, r, shards, params, want, (k,), eager=eager)


def _captured_child(rank: int, world_size: int, device: str) -> list:
    """One process per rank on CUDA: the prepared pair run once eagerly, captured together into
    one CUDA graph (``torch.cuda.graph``, its default global capture mode), replayed with new
    gradient values copied in place, an eager run between replays; a snapshot after each."""
    pair = _RankPair(rank, world_size, device)
    out = []
    try:
        pair.values(0)
        pair.run()
        out.append(pair.snapshot())
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            pair.run()
        for k in (1, 2, 3):
            pair.values(k)
            graph.replay()
            out.append(pair.snapshot())
            if k == 2:  # an eager run between replays
                pair.values(7)
                pair.run()
                out.append(pair.snapshot())
    finally:
        pair.g.close()
    return out


@pytest.mark.gpu
@pytest.mark.multiproc
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("rs_push", ["auto", "kernel"])
def test_prepared_collectives_captured_in_a_cuda_graph_replay_exactly(rs_push: str) -> None:
    """Issue 15's capture: prepared runs recorded into a CUDA graph (one process per rank);
    every replay -- and an eager run between replays -- exact, bit-identical to the eager
    reduce-scatter on the same values, padding rows zero (``rs_push="kernel"``: the pushes'
    kernel launches on the copy stream are captured too)."""
    world = 2
    out = _spawn(_captured_child, world, "cuda", TIDE_TEST_RS_PUSH=rs_push)
    layout = ShardLayout(SHAPES, world)
    for n, k in enumerate((0, 1, 2, 7, 3)):
        want = _pair_want(k, world)
        for r in range(world):
            shards, params, eager = out[r][n]
            _assert_exact(layout, r, shards, params, want, (k,), eager=eager)


def _other_stream_child(rank: int, world_size: int, device: str) -> list:
    """Kernel pushes of a reduce-scatter prepared on one stream and run on another: the pair
    runs once and a prepared reduce-scatter on other new gradients runs (kernels compiled and
    loaded, templates made), then the default stream sleeps ~200 ms, a third prepared
    reduce-scatter binds on it and runs at once on a side stream --
    whose copy queue is fenced from the side stream only.  Its gradients are new tensors (the
    push tables are cached by the gradients' addresses: on the pair's own gradients no table
    would go up behind the sleep), and the pair's gradients then hold other values (a stale
    table read in place of the new one gives other sums, not the same ones).  Returns the
    shards of that run and of the eager call on the same gradients (on the CPU)."""
    pair = _RankPair(rank, world_size, device)
    try:
        pair.values(5)
        pair.run()
        grads = [x.clone() for x in pair.grads]
        # A run on other new gradients first: the new alignment's kernels compile and load
        # there (a module load waits for the device, which would end the sleep below first).
        warm = pair.tt.prepare_reduce_scatter([x.clone() for x in grads], [torch.empty_like(x) for x in pair.shards],
                                              group=pair.g, op="sum")
        warm.run(stream=torch.cuda.Stream())
        pair.tt.synchronize(pair.g, timeout_s=60)
        pair.values(6)
        shards = [torch.full_like(x, -1.0) for x in pair.shards]
        torch.cuda.synchronize()
        torch.cuda._sleep(400_000_000)  # the default stream, where the tables go up, busy
        rs = pair.tt.prepare_reduce_scatter(grads, shards, group=pair.g, op="sum")
        side = torch.cuda.Stream()
        rs.run(stream=side)
        pair.tt.synchronize(pair.g, timeout_s=60)
        torch.cuda.synchronize()
        eager = [torch.empty_like(x) for x in shards]
        pair.tt.reduce_scatter(grads, eager, group=pair.g, op="sum")
        pair.tt.synchronize(pair.g, timeout_s=60)
        return [[x.cpu() for x in shards], [x.cpu() for x in eager]]
    finally:
        pair.g.close()


@pytest.mark.gpu
@pytest.mark.multiproc
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_kernel_pushes_prepared_on_a_busy_stream_and_run_on_another() -> None:
    """The push kernel waits for its tables' upload, which the copy queue's fence covers only
    where the run's stream is the upload stream; here the upload stream is busy and the run
    goes on another, so without the wait the kernel reads unwritten tables (both ranks abort
    on an H100).  The run must be exact and equal the eager call bit for bit."""
    world = 2
    out = _spawn(_other_stream_child, world, "cuda", TIDE_TEST_RS_PUSH="kernel")
    layout = ShardLayout(SHAPES, world)
    want = _pair_want(5, world)
    for r in range(world):
        shards, eager = out[r]
        for p, w in enumerate(want):
            c, rows = layout.rows_per_rank[p], layout.shard_rows(r)[p]
            assert torch.equal(shards[p][:rows], w[r * c: r * c + rows]), (r, p)
            assert torch.equal(shards[p], eager[p]), (r, p)


BACK_TO_BACK_SHAPES = [(1024, 512), (768, 1024), (2048, 256), (512, 512)]
BACK_TO_BACK_RUNS = 12


def _back_to_back_value(k: int, which: int, rank: int) -> float:
    """Run ``k`` of all-gather ``which`` fills rank ``rank``'s shards with this (exact in bf16,
    distinct for neighbouring runs and the two collectives)."""
    return float((k % 8) * 16 + which * 4 + rank)


def _back_to_back_child(rank: int, world_size: int, device: str) -> list:
    """Two prepared all-gathers of the same block size (fp32 shards -> bf16 params: the cast
    writes this rank's block on its stream) run alternately with no synchronization between
    runs; rank 1 stalls its stream before every other run (a slow peer).  Each run's params are
    cloned on the stream; returns the clones' distinct values per parameter (on the CPU)."""
    import tide_triton as tt_

    try:
        from _dist import rank_device
    except ImportError:  # pragma: no cover
        from tests._dist import rank_device
    dev = rank_device(rank)
    torch.cuda.set_device(dev)
    g = tt_.init(timeout_s=60)
    layout = ShardLayout(BACK_TO_BACK_SHAPES, world_size)
    shards = [[torch.zeros(s, device=dev) for s in layout.shard_shapes(rank)] for _ in range(2)]
    params = [[torch.zeros(s, dtype=torch.bfloat16, device=dev) for s in BACK_TO_BACK_SHAPES] for _ in range(2)]
    preps = [tt_.prepare_all_gather(shards[i], params[i], group=g) for i in range(2)]
    clones = []
    try:
        torch.cuda.synchronize()
        for k in range(BACK_TO_BACK_RUNS):
            for i in range(2):
                if rank == 1 and (k + i) % 2:
                    torch.cuda._sleep(2_000_000)  # ~1 ms: the peers run ahead
                for x in shards[i]:
                    x.fill_(_back_to_back_value(k, i, rank))
                preps[i].run()
                clones.append([x.clone() for x in params[i]])
        tt_.synchronize(g, timeout_s=60)
        return [[torch.unique(x).float().cpu() for x in run] for run in clones]
    finally:
        g.close()


@pytest.mark.gpu
@pytest.mark.multiproc
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_prepared_all_gathers_back_to_back_with_a_slow_peer() -> None:
    """The FSDP2 drop-in's pattern on a GPU: prepared all-gathers sharing one block, one after
    another on the stream, a peer lagging.  Every run delivers exactly that run's values (a
    run's cast must not overwrite this rank's block while a peer still reads the previous run
    from it)."""
    world = 2
    out = _spawn(_back_to_back_child, world, "cuda")
    layout = ShardLayout(BACK_TO_BACK_SHAPES, world)
    for r in range(world):
        for n, run in enumerate(out[r]):
            k, i = divmod(n, 2)
            for p, values in enumerate(run):
                want = sorted({_back_to_back_value(k, i, q) for q in range(world) if layout.shard_rows(q)[p]})
                assert values.tolist() == want, (f"rank {r}, run {k} of all-gather {i}, parameter {p}: "
                                                 f"values {values.tolist()}, want {want}")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_prepared_collectives_single_process_mode_cuda(monkeypatch) -> None:
    """The single-process mode on one GPU (each rank thread on its own stream): three runs of a
    prepared reduce-scatter and all-gather with new values between them, each exact, every run
    op by op (this mode records no run and replays no copy list by default: envs.graphs_in_process
    -- checked here)."""
    monkeypatch.delenv("TIDE_TRITON_RUN_GRAPHS", raising=False)
    monkeypatch.delenv("TIDE_TRITON_COPY_GRAPHS", raising=False)
    dev = torch.device("cuda", 0)
    layout = ShardLayout(SHAPES, W)
    gen = torch.Generator().manual_seed(21)
    vals = _grads(gen, SHAPES)
    groups = tt.local_groups(W, timeout_s=60, ring_bytes=128 * W, devices=[dev] * W)
    state: dict[int, dict] = {}

    def prepare(r: int) -> None:
        with torch.cuda.stream(torch.cuda.Stream(dev)):
            st = state[r] = {"stream": torch.cuda.current_stream(dev),
                             "grads": [v.to(dev) for v in vals[r]],
                             "shards": [torch.full(s, -1.0, device=dev) for s in layout.shard_shapes(r, padded=True)],
                             "params": [torch.full(s, -3.0, dtype=torch.bfloat16, device=dev) for s in SHAPES]}
            st["rs"] = tt.prepare_reduce_scatter(st["grads"], st["shards"], group=groups[r], op="sum")
            st["ag"] = tt.prepare_all_gather([x[:n] for x, n in zip(st["shards"], layout.shard_rows(r))],
                                             st["params"], group=groups[r])
            torch.cuda.current_stream(dev).synchronize()
            assert not st["rs"]._graphs_on and not st["ag"]._graphs_on, r
            assert groups[r].transport(dev)._copy_graphs.mode == "off", r

    def step(r: int):
        st = state[r]
        with torch.cuda.stream(st["stream"]):
            for x, v in zip(st["grads"], vals[r]):
                x.copy_(v)
            for x in st["shards"]:
                x.fill_(-1.0)
            st["rs"].run()
            st["ag"].run()
            tt.synchronize(groups[r], timeout_s=60)
            return [x.cpu() for x in st["shards"]], [x.cpu() for x in st["params"]]

    try:
        run_threads(prepare, W, timeout=120)
        for k in range(3):
            if k:
                _refill(vals, gen)
            out = run_threads(step, W, timeout=120)
            for r, (shards, params) in enumerate(out):
                _assert_exact(layout, r, shards, params, [_want(vals, p) for p in range(len(SHAPES))], (k,))
    finally:
        _close(groups)


def test_unheld_prepared_collectives_run_on_the_tensors_of_the_moment() -> None:
    """The drop-in's use (``hold=False``): the prepared collective keeps no tensor; each run
    takes the tensors of the moment -- new addresses are checked and bound on this rank alone
    (the peers' side is the heap), known ones run as bound; every run exact.  Wrong shapes at
    new addresses are refused (ValueError naming the argument); ``run()`` says why it cannot."""
    import tide_triton.collectives as coll
    import tide_triton.executors.prepared as programs

    layout = ShardLayout(SHAPES, W)
    gen = torch.Generator().manual_seed(8)
    groups = _groups()
    preps: dict[int, tuple] = {}

    def fresh(r: int, vals):
        grads = [v.clone() for v in vals[r]]  # new storage: new addresses
        shards = [torch.full(s, -1.0) for s in layout.shard_shapes(r, padded=True)]
        params = [torch.full(s, -3.0, dtype=torch.bfloat16) for s in SHAPES]
        return grads, shards, params

    def prepare(r: int) -> None:
        grads, shards, params = fresh(r, _grads(torch.Generator().manual_seed(99), SHAPES))
        rs = coll.prepared_reduce_scatter_call(groups[r], grads, shards, "sum", False, hold=False)
        ag = coll.prepared_all_gather_call(groups[r], [x[:n] for x, n in zip(shards, layout.shard_rows(r))],
                                           params, hold=False)
        with pytest.raises(RuntimeError, match="prepared with hold=False"):
            rs.run()
        preps[r] = (rs, ag)

    def step(r: int, vals, keep: dict):
        rs, ag = preps[r]
        if r not in keep or len(keep) > W:
            keep[r] = fresh(r, vals)
        grads, shards, params = keep[r]
        for x, v in zip(grads, vals[r]):
            x.copy_(v)
        for x in shards:
            x.fill_(-1.0)
        rs._run_on(grads, shards)
        ag._run_on([x[:n] for x, n in zip(shards, layout.shard_rows(r))], params)
        return [x.clone() for x in shards], [x.clone() for x in params], len(rs._bindings)

    try:
        run_threads(prepare, W, timeout=60)
        kept: dict = {}
        kept_most = programs._BINDINGS_KEPT
        for k in range(kept_most + 4):  # new tensors every step, past the bindings kept, then the same
            vals = _grads(gen, SHAPES)
            if k < kept_most + 2:
                kept.clear()
            out = run_threads(lambda r, v=vals: step(r, v, kept), W, timeout=60)
            for r, (shards, params, nb) in enumerate(out):
                assert nb <= kept_most, nb
                _assert_exact(layout, r, shards, params, [_want(vals, p) for p in range(len(SHAPES))], (k,))

        def wrong(r: int):
            rs, _ = preps[r]
            grads, shards, _params = fresh(r, _grads(torch.Generator().manual_seed(1), SHAPES))
            with pytest.raises(ValueError, match=r"shards\[0\] must have shape"):
                rs._run_on(grads, [x.reshape(-1) for x in shards])
        run_threads(wrong, W, timeout=60)
    finally:
        _close(groups)


def test_a_captured_run_records_only_what_a_graph_replays(monkeypatch) -> None:
    """Capture, as far as the CPU can check it: there is no CUDA graph here, so the capture
    decision is forced (``_is_captured``) and the transport's calls are recorded.  A captured
    run warms no copy graphs, asks for no pacer, enqueues capturable copies only, launches its
    kernels as captured, and ends joined (``fence_to`` after its last flag operation: a capture
    must rejoin the copy stream); it keeps its binding past eviction and itself alive in the
    group; its results are exact.  After a capture, eager runs end joined too.  Under capture,
    ``async_op=True`` and tensors it never ran on raise ValueError naming the cause (a run that
    raises breaks the group: runs are not agreed)."""
    import tide_triton.executors.prepared as programs
    from tide_triton.kernels.segments import Binding
    from tide_triton.transport.host import HostTransport

    layout = ShardLayout(SHAPES, W)
    gen = torch.Generator().manual_seed(31)
    vals = _grads(gen, SHAPES)
    groups = _groups()
    log: list[tuple] = []
    capture = {"on": False}

    def spy(name):
        real = getattr(HostTransport, name)

        def wrapped(self, *a, **k):
            log.append((self.rank, name, k.get("capturable", False)))
            return real(self, *a, **k)
        return wrapped

    for name in ("copy_prepared", "warm_replays", "fence_to", "signal_all", "wait_all_equal"):
        monkeypatch.setattr(HostTransport, name, spy(name))
    real_launch = Binding.launch

    def launch(self, **k):
        log.append((None, "launch", k.get("capturing", False)))
        return real_launch(self, **k)

    monkeypatch.setattr(Binding, "launch", launch)
    for cls in (programs.PreparedReduceScatter, programs.PreparedAllGather):
        def run_marked(self, g, *a, _real=cls._run, **k):
            log.append((g.rank, "run", False))
            return _real(self, g, *a, **k)
        monkeypatch.setattr(cls, "_run", run_marked)
    monkeypatch.setattr(programs._Prepared, "_is_captured", lambda self, stream: capture["on"])
    state: dict[int, dict] = {}

    def prepare(r: int) -> None:
        st = state[r] = {"grads": [v.clone() for v in vals[r]],
                         "shards": [torch.full(s, -1.0) for s in layout.shard_shapes(r, padded=True)],
                         "params": [torch.full(s, -3.0, dtype=torch.bfloat16) for s in SHAPES]}
        st["rs"] = tt.prepare_reduce_scatter(st["grads"], st["shards"], group=groups[r], op="sum")
        st["ag"] = tt.prepare_all_gather([x[:n] for x, n in zip(st["shards"], layout.shard_rows(r))],
                                         st["params"], group=groups[r])

    def step(r: int):
        st = state[r]
        for x in st["shards"]:
            x.fill_(-1.0)
        st["rs"].run()
        st["ag"].run()
        return [x.clone() for x in st["shards"]], [x.clone() for x in st["params"]]

    def check(out) -> None:
        for r, (shards, params) in enumerate(out):
            _assert_exact(layout, r, shards, params, [_want(vals, p) for p in range(len(SHAPES))], ())

    def runs(entries) -> list[list[str]]:  # rank 0's transport calls, run by run
        out: list[list[str]] = []
        for _, n, _ in entries:
            if n == "run":
                out.append([])
            elif n != "launch":
                out[-1].append(n)
        return out

    def ends_joined(entries) -> bool:  # every run's last transport call is its join
        rs = runs(entries)
        return len(rs) == 2 and all(r[-1] == "fence_to" and "wait_all_equal" in r for r in rs)

    try:
        run_threads(prepare, W, timeout=60)
        log.clear()
        check(run_threads(step, W, timeout=60))  # eager, before any capture: not joined
        # eager, no capture yet: the copy queue waits for the quiescent end alone
        assert not any(r[-1] == "fence_to" for r in runs([e for e in log if e[0] == 0])), log
        assert any(n == "warm_replays" for _, n, _ in log)
        log.clear()
        capture["on"] = True
        real_pacer = groups[0].pacer

        def pacer(*a):
            if capture["on"]:
                pytest.fail("a captured run asked for a pacer")
            return real_pacer(*a)

        monkeypatch.setattr(groups[0], "pacer", pacer)
        check(run_threads(step, W, timeout=60))
        assert not any(n == "warm_replays" for _, n, _ in log), log
        assert all(flag for _, n, flag in log if n in ("copy_prepared", "launch")), log
        assert ends_joined([e for e in log if e[0] == 0]), log
        for r in range(W):
            kept = exec_state.of(groups[r]).captured
            assert {id(p) for p in kept} == {id(state[r]["rs"]), id(state[r]["ag"])}
            assert all(len(state[r][k]._captured) == 1 for k in ("rs", "ag"))

        capture["on"] = False
        log.clear()
        _refill(vals, gen)
        for r in range(W):
            for x, v in zip(state[r]["grads"], vals[r]):
                x.copy_(v)
        check(run_threads(step, W, timeout=60))  # eager after a capture: joined, exact
        assert ends_joined([e for e in log if e[0] == 0]), log
        capture["on"] = True

        def refused(r: int) -> list[str]:
            st, msgs = state[r], []
            with pytest.raises(ValueError) as e:  # the precondition alone: no call begun
                st["rs"]._begin(None, True)
            msgs.append(str(e.value))
            with pytest.raises(ValueError) as e:  # a run refused: the group breaks (not agreed)
                st["ag"]._run_on([torch.zeros(s) for s in layout.shard_shapes(r, padded=True)],
                                 [torch.zeros(s, dtype=torch.bfloat16) for s in SHAPES])
            msgs.append(str(e.value))
            with pytest.raises(GroupBrokenError, match="has not run on yet"):
                st["rs"].run()
            return msgs

        for msgs in run_threads(refused, W, timeout=60):
            assert msgs[0].startswith("async_op:") and "capture" in msgs[0], msgs
            assert "has not run on yet" in msgs[1], msgs
    finally:
        _close(groups)


@pytest.mark.parametrize("rs_push", ["auto", "kernel"])
@pytest.mark.parametrize("queue", ["sync", "async"])
def test_captured_runs_replay_exactly_on_the_host(monkeypatch, queue: str, rs_push: str) -> None:
    """Issue 15's "replays exact" on the CPU: each rank captures its prepared reduce-scatter
    (sum, padded shards) and all-gather (fp32 -> bf16, a cast) into a host graph
    (:mod:`tide_triton.runtime.host_capture`: the copies, signals, waits, fences and kernel launches are
    recorded, nothing moves), then replays it with new gradient values -- an eager run of the
    same prepared collectives and an eager reduce-scatter between replays; every replay exact
    and bit-identical to the eager reduce-scatter on the same values.  ``async``: the copy queue
    behind the caller, random delays."""
    from tide_triton.runtime.host_capture import HostGraph, capture

    if queue == "async":
        monkeypatch.setattr("tide_triton.transport.host.COPY_QUEUE", "async")
        monkeypatch.setattr("tide_triton.transport.host.COPY_QUEUE_JITTER_S", 200e-6)
    layout = ShardLayout(SHAPES, W)
    gen = torch.Generator().manual_seed(41)
    vals = _grads(gen, SHAPES)
    groups = _groups(rs_push=rs_push)
    state: dict[int, dict] = {}

    def prepare(r: int) -> int:
        st = state[r] = {"grads": [v.clone() for v in vals[r]],
                         "shards": [torch.full(s, -1.0) for s in layout.shard_shapes(r, padded=True)],
                         "params": [torch.full(s, -3.0, dtype=torch.bfloat16) for s in SHAPES]}
        st["rs"] = tt.prepare_reduce_scatter(st["grads"], st["shards"], group=groups[r], op="sum")
        st["ag"] = tt.prepare_all_gather([x[:n] for x, n in zip(st["shards"], layout.shard_rows(r))],
                                         st["params"], group=groups[r])
        st["rs"].run()  # once outside the capture (what a CUDA capture needs too)
        st["ag"].run()
        for x in st["shards"]:
            x.fill_(-7.0)
        graph = st["graph"] = HostGraph()
        with capture(graph):
            st["rs"].run()
            st["ag"].run()
        assert all(bool((x == -7.0).all()) for x in st["shards"]), "a captured run moved data"
        return len(graph)

    def step(r: int, how: str):
        st = state[r]
        for x, v in zip(st["grads"], vals[r]):
            x.copy_(v)
        for x in st["shards"]:
            x.fill_(-1.0)
        if how == "replay":
            st["graph"].replay()
        else:
            st["rs"].run()
            st["ag"].run()
        eager = [torch.empty(s) for s in layout.shard_shapes(r, padded=True)]
        tt.reduce_scatter(st["grads"], eager, group=groups[r], op="sum")
        return [x.clone() for x in st["shards"]], [x.clone() for x in st["params"]], eager

    try:
        assert all(n > 0 for n in run_threads(prepare, W, timeout=60))
        for k, how in enumerate(["replay", "replay", "run", "replay"]):
            _refill(vals, gen)
            out = run_threads(lambda r, h=how: step(r, h), W, timeout=120)
            for r, (shards, params, eager) in enumerate(out):
                _assert_exact(layout, r, shards, params, [_want(vals, p) for p in range(len(SHAPES))], (k, how),
                              eager=eager)
    finally:
        _close(groups)


@pytest.mark.interpreter
def test_ranks_replaying_different_captured_collectives_raise_naming_the_peer(monkeypatch) -> None:
    """Rank 0 replays its captured reduce-scatter A while the others replay B (captured on other
    shards): their tokens differ, so no rank takes the other's data -- every rank's replay ends
    in PeerTimeoutError naming a peer whose token did not come, or PeerAbortedError naming the
    peer that gave up first, within the group's deadline; the shards keep their old values."""
    import time

    from tide_triton.runtime.host_capture import HostGraph, capture

    layout, grads, groups = _mismatch_setup(43)

    def body(r: int):
        sa, sb = _two_shard_sets(layout, r)
        graphs = {}
        for name, shards in (("a", sa), ("b", sb)):
            p = tt.prepare_reduce_scatter(grads[r], shards, group=groups[r], op="sum")
            p.run()  # once outside the capture
            graphs[name] = HostGraph()
            with capture(graphs[name]):
                p.run()
        for x in sa + sb:
            x.fill_(-5.0)
        t0 = time.monotonic()
        try:
            graphs["a" if r == 0 else "b"].replay()
            tt.synchronize(groups[r], timeout_s=3)
        except (PeerTimeoutError, PeerAbortedError) as e:
            return e, time.monotonic() - t0, all(bool((x == -5.0).all()) for x in sa + sb)
        return "no error", time.monotonic() - t0, None

    try:
        out = run_threads(body, W, timeout=120)
    finally:
        _close(groups)
    _assert_each_rank_names_another([e for e, _, _ in out])
    for r, (_, seconds, untouched) in enumerate(out):
        assert seconds < 20, (r, seconds)
        assert untouched, f"rank {r}: a replay wrote shards while its peers ran another collective"


def test_a_run_on_another_stream_than_the_last_waits_for_it() -> None:
    """Every run of a prepared collective uses one token, taken on the compute stream: a run
    after an ``async_op=True`` one (on the group's side stream) must wait for that stream, or
    its waits take the tokens the peers pushed for the first run (a hang or the other run's
    sums).  Runs on one stream add no wait; a capture adds none."""
    import types

    from tide_triton.executors.prepared import PreparedReduceScatter

    class S:
        def __init__(self, name):
            self.name, self.waited = name, []

        def wait_stream(self, other):
            self.waited.append(other.name)

    p = object.__new__(PreparedReduceScatter)
    p.device, p._last_compute = types.SimpleNamespace(type="cuda"), None
    caller, side = S("caller"), S("side")
    p._follow(caller, False)
    p._follow(caller, False)
    assert caller.waited == []
    p._follow(side, False)  # async run
    p._follow(caller, False)  # the next, on the caller's stream: behind the side stream
    assert side.waited == ["caller"] and caller.waited == ["side"]
    p._follow(side, True)  # captured: ordered by its replay instead
    assert side.waited == ["caller"] and p._last_compute is caller
