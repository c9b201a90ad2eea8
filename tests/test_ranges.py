"""tide_triton's named host ranges (tide_triton.runtime.profiling): in a torch.profiler trace while a
profiler records -- the stretches the profiler cannot see otherwise (preparation, host waits,
copy graphs) -- and nothing at all otherwise."""
from __future__ import annotations

import contextlib

import pytest
import torch

from tide_triton.plan.layout import ShardLayout
from tide_triton.runtime.profiling import host_range, in_host_range

try:
    from _dist import run_threads
except ImportError:  # pragma: no cover
    from tests._dist import run_threads


def test_a_range_opens_only_while_a_profiler_records() -> None:
    assert isinstance(host_range("tide_triton::x"), contextlib.nullcontext)
    calls = []

    @in_host_range("tide_triton::decorated")
    def work(a, *, b):
        calls.append((a, b))
        return a + b

    assert work(1, b=2) == 3 and work.__name__ == "work"
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        assert not isinstance(host_range("tide_triton::x"), contextlib.nullcontext)
        assert work(3, b=4) == 7
    names = [e.name for e in prof.events()]
    assert names.count("tide_triton::decorated") == 1 and calls == [(1, 2), (3, 4)]


@pytest.mark.interpreter
def test_a_collective_s_preparation_is_named_in_a_trace(monkeypatch) -> None:
    # The eager calls prepare (tables, kernels, copy lists) on new addresses: a trace names it,
    # once per rank and collective, and not again on the same tensors.  (The single-process
    # mode's rank threads are not recorded by a profiler opened in the main thread, so the
    # profiler's switch and range are stood in for here.)
    import tide_triton as tt

    opened: list[str] = []

    @contextlib.contextmanager
    def record_function(name):
        opened.append(name)
        yield

    monkeypatch.setattr(torch.autograd, "_profiler_enabled", lambda: True)
    monkeypatch.setattr(torch.profiler, "record_function", record_function)
    W, shapes = 2, [(6, 4), (5,), (3, 3)]
    layout = ShardLayout(shapes, W)
    groups = tt.local_groups(W, timeout_s=60)
    grads = [[torch.full(s, float(r + 1), dtype=torch.bfloat16) for s in shapes] for r in range(W)]
    shards = [[torch.zeros(s, dtype=torch.float32) for s in layout.shard_shapes(r)] for r in range(W)]
    params = [[torch.empty(s, dtype=torch.bfloat16) for s in shapes] for r in range(W)]

    def body(r: int) -> None:
        for _ in range(2):
            tt.reduce_scatter(grads[r], shards[r], group=groups[r], op="sum")
            tt.all_gather(shards[r], params[r], group=groups[r])

    try:
        run_threads(body, W, timeout=120)
    finally:
        for g in groups:
            g.close()
    assert all(bool((p == 3).all()) for r in range(W) for p in params[r])
    assert opened.count("tide_triton::prepare_reduce_scatter") == W, opened
    assert opened.count("tide_triton::prepare_all_gather") == W, opened



@pytest.mark.interpreter
@pytest.mark.parametrize("rs_push, launches", [("copy_engine", 0), ("kernel", 2)])
def test_kernel_pushes_are_named_in_a_trace(monkeypatch, rs_push: str, launches: int) -> None:
    # The push kernel has the reductions' name (segmented_reduce_kernel): a range around each
    # launch tells transport from sums in a trace -- one per round pushed by the kernel (two
    # calls of one round each, per rank), none where the copy engines push.  (Profiler stood
    # in for, as above.)
    import tide_triton as tt

    opened: list[str] = []

    @contextlib.contextmanager
    def record_function(name):
        opened.append(name)
        yield

    monkeypatch.setattr(torch.autograd, "_profiler_enabled", lambda: True)
    monkeypatch.setattr(torch.profiler, "record_function", record_function)
    W, shapes = 2, [(6, 4), (5,), (3, 3)]
    layout = ShardLayout(shapes, W)
    grads = [[torch.full(s, float(r + 1), dtype=torch.bfloat16) for s in shapes] for r in range(W)]
    shards = [[torch.zeros(s, dtype=torch.float32) for s in layout.shard_shapes(r)] for r in range(W)]
    groups = tt.local_groups(W, timeout_s=60, rs_push=rs_push)

    def body(r: int) -> None:
        for _ in range(2):
            tt.reduce_scatter(grads[r], shards[r], group=groups[r], op="sum")

    try:
        run_threads(body, W, timeout=120)
    finally:
        for g in groups:
            g.close()
    assert all(bool((x == 3).all()) for r in range(W) for x in shards[r])
    assert opened.count("tide_triton::kernel_push") == launches * W, opened
