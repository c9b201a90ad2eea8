"""A prepared collective's run checks that its tensors are still the ones it was prepared for,
and its waits see a peer's published abort (host transport).

* A held tensor changed in place at its address -- ``t_()``, ``set_()`` onto another shape,
  ``resize_()`` smaller, a ``.data`` view of another dtype -- in the full list or the shards,
  of a reduce-scatter or an all-gather, on a run made op by op or replayed from its recording:
  every rank raises, the changed rank naming itself, the argument and what changed, its peer
  naming that rank and carrying its error; no rank returns a value.
* A rank whose run raises at once: its peer's run ends in well under the deadline, also when
  the peer starts its run only after the rank gave up (it is told the rank's error, not a
  timeout waiting for slots).
"""
from __future__ import annotations

import math
import re
import threading
import time

import pytest
import torch

try:
    from _dist import run_multiprocess, run_threads
except ImportError:  # pragma: no cover
    from tests._dist import run_multiprocess, run_threads

import tide_triton as tt
from tide_triton.executors import held as prepared_held
from tide_triton.errors import PeerAbortedError
from tide_triton.plan.layout import ShardLayout

W = 2
SHAPES = [(4, 6), (5,), (6, 6)]  # the first, changed, parameter: 2-D, non-square, even rows
TIMEOUT_S = 15.0
PROMPT_S = 3.0
"""A peer's abort must end a run within this (the deadline is TIMEOUT_S)."""


def _change(t: torch.Tensor, how: str) -> str:
    """Change ``t`` in place at its address (its data pointer stays where it is); returns what
    the error must say it is now."""
    ptr = t.data_ptr()
    if how == "t_":
        t.t_()
    elif how == "set_":  # the same storage seen as another shape
        t.set_(t.untyped_storage(), 0, (t.shape[0] // 2, t.numel() // (t.shape[0] // 2)))
    elif how == "resize_":  # smaller: the storage stays
        t.resize_(t.shape[0] // 2, *t.shape[1:])
    elif how == "dtype":  # the same bytes as another dtype of the same size
        t.data = t.view(torch.float16 if t.dtype is torch.bfloat16 else torch.int32)
    else:
        raise ValueError(how)
    assert t.data_ptr() == ptr
    return f"strides {tuple(t.stride())}" if how == "t_" else f"dtype {t.dtype}" if how == "dtype" else \
        f"shape {tuple(t.shape)}"


def _prepare(kind: str, g, r: int, layout: ShardLayout):
    """A prepared collective of ``kind`` on rank ``r`` with integer-valued inputs; returns it,
    its (full, shards) lists and the names the errors use for them."""
    if kind == "rs":
        grads = [(torch.arange(math.prod(s), dtype=torch.float32).reshape(s) + r).to(torch.bfloat16)
                 for s in SHAPES]
        shards = [torch.full(s, -1.0) for s in layout.shard_shapes(r, padded=True)]
        return tt.prepare_reduce_scatter(grads, shards, group=g, op="sum"), grads, shards, ("grads", "shards")
    shards = [torch.full(s, float(r + 1), dtype=torch.bfloat16) for s in layout.shard_shapes(r, padded=True)]
    params = [torch.zeros(s, dtype=torch.bfloat16) for s in layout.padded_shapes]
    return tt.prepare_all_gather(shards, params, group=g), params, shards, ("params", "shards")


# every change of each list of both collectives on the run after the first, checked by torch's
# C++ tensor guard; runs that would replay the recording made at the second run (run graphs are
# on by default on the host); and a few with the Python passes a torch without the guard uses
CASES = [(how, kind, which, 1, "guard") for how in ("t_", "set_", "resize_", "dtype") for kind in ("rs", "ag")
         for which in ("full", "shards")] + [("t_", "rs", "full", 3, "guard"), ("resize_", "ag", "shards", 3, "guard")]
CASES += [("t_", "ag", "full", 1, "python"), ("set_", "rs", "shards", 3, "python"),
          ("resize_", "rs", "full", 1, "python"), ("dtype", "ag", "shards", 1, "python")]


def _checked_by(how: str, monkeypatch: pytest.MonkeyPatch) -> None:

    if how == "python":
        monkeypatch.setattr(prepared_held, "_guards_work", lambda: False)
    else:
        assert prepared_held._guards_work(), "torch's TensorGuards is not usable with this torch"


@pytest.mark.parametrize("how,kind,which,runs_before,checker", CASES)
def test_a_tensor_changed_at_its_address_is_refused_on_every_rank(how: str, kind: str, which: str, runs_before: int,
                                                                  checker: str, monkeypatch) -> None:
    _checked_by(checker, monkeypatch)
    layout = ShardLayout(SHAPES, W)
    groups = tt.local_groups(W, timeout_s=TIMEOUT_S, ring_bytes=128 * W)

    def body(r: int):
        prep, full, shards, names = _prepare(kind, groups[r], r, layout)
        for _ in range(runs_before):
            prep.run()
        now = _change((full if which == "full" else shards)[0], how) if r == 0 else ""
        t0 = time.monotonic()
        try:
            prep.run()
            return "ok", time.monotonic() - t0, names, now
        except Exception as e:  # noqa: BLE001 - the outcome is the test's subject
            return e, time.monotonic() - t0, names, now

    try:
        out = run_threads(body, W, timeout=60)
    finally:
        for g in groups:
            g.close()
    (e0, _, names, now), (e1, s1, _, _) = out
    name = names[0 if which == "full" else 1]
    pattern = rf"on rank 0: {name}\[0\] changed in place at its address \(prepared: .*; now: .*{re.escape(now)}"
    assert isinstance(e0, ValueError), out
    assert isinstance(e1, PeerAbortedError) and e1.rank == 0, out
    for e in (e0, e1):
        assert re.search(pattern, str(e)), (pattern, str(e))
    assert s1 < PROMPT_S, out


@pytest.mark.parametrize("checker", ["guard", "python"])
def test_what_leaves_the_layout_as_prepared_is_not_refused(checker: str, monkeypatch) -> None:
    """Changes that keep every tensor's address, shape, contiguity and dtype -- ``requires_grad``
    set on a shard, a ``t_()`` undone, a run under ``torch.inference_mode`` (other dispatch
    keys: torch's guard refuses those, the run checks again and goes on) -- run exactly."""

    _checked_by(checker, monkeypatch)
    made = []
    real = prepared_held._layout_guard
    monkeypatch.setattr(prepared_held, "_layout_guard", lambda ts: made.append(len(ts)) or real(ts))
    layout = ShardLayout(SHAPES, W)
    groups = tt.local_groups(W, timeout_s=TIMEOUT_S, ring_bytes=128 * W)

    def body(r: int):
        prep, grads, shards, _ = _prepare("rs", groups[r], r, layout)
        out = []
        for step in range(5):
            with torch.no_grad():
                for x in shards:
                    x.fill_(-1.0)
            if step == 1:
                shards[0].requires_grad_(True)
            if step == 2:
                grads[0].t_()
                grads[0].t_()
            if step == 3:
                with torch.inference_mode():
                    prep.run()
            else:
                prep.run()
            out.append([x.detach().clone() for x in shards])
        return out

    try:
        out = run_threads(body, W, timeout=60)
    finally:
        for g in groups:
            g.close()
    for r, steps in enumerate(out):
        for p, s in enumerate(SHAPES):
            want = sum((torch.arange(math.prod(s), dtype=torch.float32).reshape(s) + q) for q in range(W))
            c, rows = layout.rows_per_rank[p], layout.shard_rows(r)[p]
            for step, shards in enumerate(steps):
                assert torch.equal(shards[p][:rows], want[r * c: r * c + rows]), (r, p, step)
    # the guard, made for each list at preparation, was made again where it refused (inference mode)
    assert len(made) > 2 * W if checker == "guard" else len(made) == 2 * W, made


def _late_body(r: int, groups, kind: str, gave_up: threading.Event):
    """Rank 0's second run raises at once (a moved tensor); rank 1 starts its second run only
    after that (a late peer)."""
    layout = ShardLayout(SHAPES, W)
    prep, full, _, names = _prepare(kind, groups[r], r, layout)
    prep.run()
    if r == 0:
        keep = full[1].data
        full[1].data = keep.clone()  # same values, new storage
    else:
        assert gave_up.wait(30)
    t0 = time.monotonic()
    try:
        prep.run()
        return "ok", time.monotonic() - t0, names
    except Exception as e:  # noqa: BLE001 - the outcome is the test's subject
        return e, time.monotonic() - t0, names
    finally:
        if r == 0:
            gave_up.set()


@pytest.mark.parametrize("kind", ["rs", "ag"])
@pytest.mark.parametrize("late", [False, True])
def test_a_peers_failed_run_ends_this_run_at_once_naming_it(kind: str, late: bool) -> None:
    groups = tt.local_groups(W, timeout_s=TIMEOUT_S, ring_bytes=128 * W)
    gave_up = threading.Event()
    if not late:
        gave_up.set()
    try:
        out = run_threads(lambda r: _late_body(r, groups, kind, gave_up), W, timeout=60)
    finally:
        for g in groups:
            g.close()
    (e0, s0, names), (e1, s1, _) = out
    assert isinstance(e0, ValueError) and f"{names[0]}[1] moved" in str(e0), out
    assert isinstance(e1, PeerAbortedError) and e1.rank == 0, out
    assert f"on rank 0: {names[0]}[1] moved" in str(e1), out  # the cause, not a wait for slots
    assert s0 < PROMPT_S and s1 < PROMPT_S, out


def _process_body(rank: int, world_size: int, kind: str) -> tuple:
    g = tt.init(timeout_s=TIMEOUT_S, ring_bytes=128 * W)
    try:
        prep, full, _, names = _prepare(kind, g, rank, ShardLayout(SHAPES, W))
        prep.run()
        if rank == 0:
            full[1].data = full[1].data.clone()
        t0 = time.monotonic()
        try:
            prep.run()
            return "ok", time.monotonic() - t0, ""
        except Exception as e:  # noqa: BLE001 - the outcome is the test's subject
            return type(e).__name__, time.monotonic() - t0, str(e)
    finally:
        g.close()


@pytest.mark.multiproc
def test_a_peers_failed_run_ends_this_run_at_once_across_processes() -> None:
    out = run_multiprocess(_process_body, W, "rs", timeout=120)
    (k0, _, m0), (k1, s1, m1) = out
    assert k0 == "ValueError" and "grads[1] moved" in m0, out
    assert k1 == "PeerAbortedError" and "rank 0 abandoned" in m1 and "grads[1] moved" in m1, out
    assert s1 < PROMPT_S, out


@pytest.mark.parametrize("kind,which,how", [("rs", "full", "moved"), ("rs", "shards", "transpose_"),
                                            ("ag", "full", "resize_"), ("ag", "shards", "moved")])
def test_a_shard_dims_collective_checks_the_tensors_as_passed(kind: str, which: str, how: str) -> None:
    """With ``shard_dims`` a prepared collective binds views of its own (each parameter's dim-0
    parts); its runs check the caller's tensors, named by the caller's indices."""
    groups = tt.local_groups(W, timeout_s=TIMEOUT_S, ring_bytes=128 * W)
    full_shapes, dims = [(5,), (3, 4, 6)], [0, 1]  # the second sharded on dim 1: 3 parts of (4, 6)

    def body(r: int):
        full = [torch.full(s, float(r + 1), dtype=torch.bfloat16) for s in full_shapes]
        shards = [torch.zeros(3), torch.zeros(3, 2, 6)]
        if kind == "rs":
            prep = tt.prepare_reduce_scatter(full, shards, group=groups[r], op="sum", shard_dims=dims)
        else:
            shards = [x.to(torch.bfloat16) for x in shards]
            prep = tt.prepare_all_gather(shards, full, group=groups[r], shard_dims=dims)
        prep.run()
        if r == 0:
            t = (full if which == "full" else shards)[1]
            if how == "moved":
                t.data = t.data.clone()
            elif how == "transpose_":
                t.transpose_(0, 2)
            else:
                t.resize_(3, 1, *t.shape[2:])
        try:
            prep.run()
            return "ok"
        except Exception as e:  # noqa: BLE001 - the outcome is the test's subject
            return e

    try:
        e0, e1 = run_threads(body, W, timeout=60)
    finally:
        for g in groups:
            g.close()
    name = ("grads" if kind == "rs" else "params") if which == "full" else "shards"
    said = f"on rank 0: {name}[1] " + ("moved" if how == "moved" else "changed in place")
    assert isinstance(e0, ValueError) and said in str(e0), (e0, e1)
    assert isinstance(e1, PeerAbortedError) and e1.rank == 0 and said in str(e1), (e0, e1)
