"""Reduce-scatter pushes by the segment kernel (``GroupOptions.rs_push``): which rounds take
it, and that the shards it produces are exact and bit-identical to the copy-engine pushes' --
eager calls, prepared runs, runs on new gradient addresses (FSDP2's MoE steady state), at
several world sizes, on the host transport with the copy queue in step and behind the caller.
(The GPU side runs in tests/test_programs.py: one process per rank, and captured.)"""
from __future__ import annotations

import pytest
import torch

try:
    from _dist import run_threads
except ImportError:  # pragma: no cover
    from tests._dist import run_threads

import tide_triton as tt
from tide_triton.executors import prepare as node_prepare
from tide_triton.plan.layout import ShardLayout
from tide_triton.plan.schedule import ring_plan
from tide_triton.plan.workloads import layer_shapes

# many small parameters (a MoE layer in miniature: > KERNEL_PUSH_MIN_PIECES pieces per round)
# beside uneven ones (padded and empty shards)
SHAPES = [(37, 5), (3,), (1, 4)] + [(8, 4)] * 40 + [(53, 2)]


def test_the_rounds_pushed_by_the_kernel() -> None:
    """``auto``: the rounds with more than KERNEL_PUSH_MIN_PIECES pieces take the kernel -- all
    but at most a short last one on the MoE layers, none of the Llama layer's (9 parameters);
    ``kernel`` every round with pieces; ``copy_engine`` none."""
    least = node_prepare.KERNEL_PUSH_MIN_PIECES
    for model, W, moe in (("qwen3-30b-a3b", 2, True), ("synthetic-moe-256e", 8, True),
                          ("llama-3.1-70b", 2, False)):
        layout = ShardLayout(layer_shapes(model), W)
        plan = ring_plan(layout, 256 << 20, 2, 2)
        for me in (0, W - 1):
            auto = node_prepare.kernel_push_rounds(plan, me, "auto")
            every = node_prepare.kernel_push_rounds(plan, me, "kernel")
            pieces = [sum(len(plan.chunks[d][j]) for d in range(W) if d != me and j < len(plan.chunks[d]))
                      for j in range(plan.rounds)]
            assert every == frozenset(j for j, n in enumerate(pieces) if n), (model, W, me)
            assert auto == frozenset(j for j, n in enumerate(pieces) if n > least), (model, W, me, auto)
            assert len(auto) >= plan.rounds - 1 if moe else not auto, (model, W, me, pieces)
            assert node_prepare.kernel_push_rounds(plan, me, "copy_engine") == frozenset()
    with pytest.raises(ValueError, match="rs_push must be"):
        tt.GroupOptions(rs_push="sms")


def test_rs_push_from_the_environment_unless_given(monkeypatch) -> None:
    """``$TIDE_TRITON_RS_PUSH`` sets a group's ``rs_push`` where the caller gave none (a job
    run both ways without a code change); an explicit option wins; a bad value names the
    variable.  The group's rounds follow it."""
    monkeypatch.delenv("TIDE_TRITON_RS_PUSH", raising=False)
    assert tt.GroupOptions().rs_push == "auto"
    monkeypatch.setenv("TIDE_TRITON_RS_PUSH", "copy_engine")
    assert tt.GroupOptions().rs_push == "copy_engine"
    assert tt.GroupOptions(rs_push="kernel").rs_push == "kernel"
    monkeypatch.setenv("TIDE_TRITON_RS_PUSH", "kernel")
    groups = tt.local_groups(2, timeout_s=60)
    try:
        assert [g.options.rs_push for g in groups] == ["kernel", "kernel"]
    finally:
        for g in groups:
            g.close()
    monkeypatch.setenv("TIDE_TRITON_RS_PUSH", "sms")
    with pytest.raises(ValueError, match=r"\$TIDE_TRITON_RS_PUSH must be one of"):
        tt.GroupOptions()


@pytest.mark.parametrize("W, queue, ring", [(2, "sync", 1024), (3, "async", 64 << 10)],
                         ids=["W2-sync-rounds", "W3-async-one-round"])
def test_kernel_pushes_equal_copy_engine_pushes_bit_for_bit(monkeypatch, W: int, queue: str, ring: int) -> None:
    """Per rank, the same integer-valued gradients reduce-scattered by groups pushing with the
    kernel (``kernel``; ``auto`` where a round exceeds the threshold: the one-round case) and
    with the copy engines: eager calls, prepared runs, and a prepared collective run on
    gradients at new addresses each call.  Every result equals the exact sums (zero padding
    rows) and the copy engines' bit for bit; the prepared pushes are kernel launches where the
    option says so.  The small ring makes many rounds (slots reused within a call)."""
    if queue == "async":
        monkeypatch.setattr("tide_triton.transport.host.COPY_QUEUE", "async")
        monkeypatch.setattr("tide_triton.transport.host.COPY_QUEUE_JITTER_S", 100e-6)
    layout = ShardLayout(SHAPES, W)
    gen = torch.Generator().manual_seed(7 + W)
    sets = [[[torch.randint(-8, 9, s, generator=gen).to(torch.bfloat16) for s in SHAPES] for _ in range(W)]
            for _ in range(2)]
    results = {}
    for how in ("copy_engine", "kernel", "auto"):
        groups = tt.local_groups(W, timeout_s=60, ring_bytes=ring, rs_push=how, agree="first")

        def body(r: int, how=how, groups=groups) -> list:
            g = groups[r]
            grads = [x.clone() for x in sets[0][r]]
            shards = [torch.full(s, -1.0) for s in layout.shard_shapes(r, padded=True)]
            prep = tt.prepare_reduce_scatter(grads, shards, group=g, op="sum")
            kinds = {type(p).__name__ for p in prep._bindings[next(iter(prep._bindings))][1]}
            assert ring > 1024 or prep.plan.rounds >= 3, prep.plan.rounds
            by_kernel = bool(node_prepare.kernel_push_rounds(prep.plan, r, how))
            out = []
            for k in range(2):
                for x, v in zip(grads, sets[k][r]):
                    x.copy_(v)
                for x in shards:
                    x.fill_(-1.0)
                prep.run()
                out.append([x.clone() for x in shards])
                eager = [torch.full(s, -1.0) for s in layout.shard_shapes(r, padded=True)]
                tt.reduce_scatter(sets[k][r], eager, group=g, op="sum")
                out.append(eager)
                new = [x.clone() for x in sets[k][r]]  # new addresses: bound anew
                for x in shards:
                    x.fill_(-1.0)
                prep._run_on(new, shards)
                out.append([x.clone() for x in shards])
            tt.synchronize(g, timeout_s=60)
            return kinds, by_kernel, out

        try:
            results[how] = run_threads(body, W, timeout=300)
        finally:
            for g in groups:
                g.close()
    for r in range(W):
        assert "KernelPush" not in results["copy_engine"][r][0], results["copy_engine"][r][0]
        assert "KernelPush" in results["kernel"][r][0], results["kernel"][r][0]
        assert ("KernelPush" in results["auto"][r][0]) == results["auto"][r][1] == (ring > 1024), results["auto"][r]
        for i, ce in enumerate(results["copy_engine"][r][2]):
            k = i // 3
            for p in range(len(SHAPES)):
                c, rows = layout.rows_per_rank[p], layout.shard_rows(r)[p]
                want = sum(sets[k][q][p].float() for q in range(W)).flatten()[r * c * _row(SHAPES[p]):]
                got = ce[p].flatten()
                n = rows * _row(SHAPES[p])
                assert torch.equal(got[:n], want[:n]), (r, i, p)
                assert torch.equal(got[n:], torch.zeros_like(got[n:])), (r, i, p)
                for how in ("kernel", "auto"):
                    assert torch.equal(results[how][r][2][i][p], ce[p]), (how, r, i, p)


def _row(shape: tuple) -> int:
    n = 1
    for d in shape[1:]:
        n *= d
    return n



def test_a_kernel_push_waits_for_tables_uploaded_on_another_stream() -> None:
    """A collective prepared on one stream and run on another (``run(stream=...)``): the copy
    queue is fenced from the run's stream only, so the push kernel must wait for its tables'
    upload there itself (without that wait a busy upload stream lets it read unwritten
    tables); on the upload stream the fence orders it
    already.  Never ``record_stream`` on the copy queue's stream (the transport's own), always
    kept for the run's stream."""
    calls: dict = {}

    class FakeBinding:
        def uploaded_on(self, s):
            return s == "upload"

        def keep_tables_for(self, s):
            calls.setdefault("kept", []).append(s)

        def launch(self, **kw):
            calls["launch"] = kw

    class FakeTransport:
        def on_copy_queue(self, fn):
            fn("copy")

    push = node_prepare.KernelPush(FakeBinding())
    for cs, ordered in (("other", False), ("upload", True)):
        calls.clear()
        push.enqueue(FakeTransport(), cs)
        kw = calls["launch"]
        assert kw["stream"] == "copy" and kw["record"] is False and kw["ordered"] is ordered, (cs, kw)
        assert calls["kept"] == [cs]
    calls.clear()
    push.enqueue(FakeTransport(), "other", captured=True)  # a capture: no waits, nothing kept
    assert calls["launch"]["ordered"] is True and calls["launch"]["capturing"] is True and "kept" not in calls


def test_a_failed_run_keeps_its_kernel_pushes_for_the_group() -> None:
    """A prepared run that fails after enqueueing kernel pushes (here: its peer never runs, the
    wait times out) leaves them queued behind a flag wait its run's end would have joined: the
    group keeps their tables (``node_prepare.keep_after_failure``) so their memory is never
    reused under a late launch -- past the group's close where that leaked the heap (its streams
    still busy), else until it."""
    from tide_triton.group import parts
    from tide_triton.errors import PeerTimeoutError

    W = 2
    layout = ShardLayout(SHAPES, W)
    groups = tt.local_groups(W, timeout_s=1.0, ring_bytes=1024, rs_push="kernel")

    def prepare(r: int):
        grads = [torch.ones(s, dtype=torch.bfloat16) for s in SHAPES]
        shards = [torch.zeros(s) for s in layout.shard_shapes(r, padded=True)]
        return tt.prepare_reduce_scatter(grads, shards, group=groups[r], op="sum")

    try:
        preps = run_threads(prepare, W, timeout=120)
        assert groups[0].kept_until_idle == ()
        with pytest.raises(PeerTimeoutError):
            preps[0].run()  # rank 1 never runs
        kept = groups[0].kept_until_idle
        assert kept and all(isinstance(p, node_prepare.KernelPush) for p in kept[0]), kept
        # close: rank 0's transport leaked its heap (what a GPU's close does when its streams do
        # not drain) -- the pushes stay for the rest of the process; rank 1's did not -- freed
        groups[1].keep_until_idle(marker := object())
        cpu = torch.device("cpu")
        small = groups[0].zeros(cpu, 1 << 20)  # the zero buffer (padding copies read it), grown
        big = groups[0].zeros(cpu, 1 << 21)
        assert any(x is small for x in groups[0].kept_until_idle)
        tr = groups[0].transport(cpu)
        getattr(tr, "inner", tr).leaked = True
        groups[0].close()
        groups[1].close()
        assert groups[0].kept_until_idle == () == groups[1].kept_until_idle
        left = parts.PAST_LEAKED_HEAPS
        for x in (kept[0], small, big):
            assert any(y is x for y in left)
        assert not any(x is marker for x in left)
        left[:] = [y for y in left if not any(y is x for x in (kept[0], small, big))]
    finally:
        for g in groups:
            g.close()
