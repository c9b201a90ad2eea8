"""A prepared collective's run checks that its tensors are still the ones it was prepared for,
and its waits see a peer's published abort (host transport).

* A rank whose run raises at once: its peer's run ends in well under the deadline, also when
  the peer starts its run only after the rank gave up (it is told the rank's error, not a
  timeout waiting for slots).
"""
from __future__ import annotations

import math
import threading
import time

import pytest
import torch

try:
    from _dist import run_multiprocess, run_threads
except ImportError:  # pragma: no cover
    from tests._dist import run_multiprocess, run_threads

import tide_triton as tt
from tide_triton.errors import PeerAbortedError
from tide_triton.layout import ShardLayout

W = 2
SHAPES = [(4, 6), (5,), (6, 6)]  # the first, changed, parameter: 2-D, non-square, even rows
TIMEOUT_S = 15.0
PROMPT_S = 3.0
"""A peer's abort must end a run within this (the deadline is TIMEOUT_S)."""


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
    assert f"{names[0]}[1] moved" in str(e1), out  # the cause, not a wait for slots
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
