"""pytest-benchmark suite for the kernels (GPU; skipped without one).

    python -m pytest bench/test_bench_kernels.py --benchmark-only --benchmark-json=out.json

Each benchmark records bytes moved, GB/s, the fraction of the device-copy ceiling measured
in the same session, and the environment (GPU, versions, git SHA, date) in ``extra_info``.
The CLI (``python -m tide_triton.bench``) prints the same comparisons as one table.
"""
from __future__ import annotations

import pytest
import torch

from tide_triton import ShardLayout, bind_accumulate_shards, bind_place_shards
from tide_triton.bench import copy_ceiling, env_info
from tide_triton.workloads import MODELS, layer_shapes

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="kernel benchmarks need a GPU")
WORLD_SIZES = (8, 64)


@pytest.fixture(scope="session")
def ceiling_gbps() -> float:
    return copy_ceiling(torch.device("cuda"), 2 << 30).gbps()


def _run(benchmark, fn, nbytes: int, ceiling_gbps: float) -> None:
    def timed() -> None:
        fn()
        torch.cuda.synchronize()

    fn()
    torch.cuda.synchronize()
    benchmark.pedantic(timed, rounds=50, iterations=1, warmup_rounds=5)
    median_s = benchmark.stats.stats.median
    gbps = nbytes / median_s / 1e9
    benchmark.extra_info.update(env_info(torch.device("cuda")))
    benchmark.extra_info.update(bytes=nbytes, gbps=gbps, pct_of_copy_ceiling=100 * gbps / ceiling_gbps,
                                note="host-timed with a sync per call: includes launch latency")


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("impl", ["tide", "fsdp2"])
def test_placement(benchmark, model: str, world_size: int, impl: str, ceiling_gbps: float) -> None:
    layout = ShardLayout(layer_shapes(model), world_size)
    W, F = world_size, layout.flat_shard_numel
    ag = torch.randn(W * F, device="cuda").to(torch.bfloat16)
    params = [torch.empty(s, dtype=torch.bfloat16, device="cuda") for s in layout.padded_shapes]
    if impl == "tide":
        fn = bind_place_shards(list(ag.view(W, F).unbind(0)), params, layout).launch
        nbytes = 2 * 2 * sum(layout.numels)
    else:
        outs, split = [p.view(W, -1) for p in params], list(layout.padded_shard_numels)
        fn = lambda: torch.split_with_sizes_copy(ag.view(W, F), split, dim=1, out=outs)  # noqa: E731
        nbytes = 2 * 2 * W * F
    _run(benchmark, fn, nbytes, ceiling_gbps)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("impl", ["tide", "fsdp2"])
def test_accumulation_k8(benchmark, model: str, world_size: int, impl: str, ceiling_gbps: float) -> None:
    k = 8
    layout = ShardLayout(layer_shapes(model), world_size)
    F = layout.flat_shard_numel
    if impl == "tide":
        slots = [torch.randn(F, device="cuda").to(torch.bfloat16) for _ in range(k)]
        shards = [torch.empty(s, dtype=torch.float32, device="cuda") for s in layout.shard_shapes(0)]
        binding = bind_accumulate_shards(slots, shards, layout, 0)
        fn = lambda: binding.launch(scale=1.0 / k)  # noqa: E731
        nbytes = (2 * k + 4) * sum(layout.shard_numels(0))
    else:
        grads = [torch.randn((k * c, *s[1:]), device="cuda").to(torch.bfloat16)
                 for c, s in zip(layout.rows_per_rank, layout.shapes)]
        cat = torch.empty(k, F, dtype=torch.float32, device="cuda")
        red = torch.empty(F, dtype=torch.float32, device="cuda")

        def fn() -> None:
            torch._chunk_cat(grads, dim=0, num_chunks=k, out=cat)
            torch.sum(cat, dim=0, out=red)

        nbytes = (2 + 4) * k * F + (4 * k + 4) * F
    _run(benchmark, fn, nbytes, ceiling_gbps)
