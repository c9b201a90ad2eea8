"""Every real layer of the workloads (:data:`tide_triton.plan.workloads.MODELS`: Llama-3.1-70B's
decoder layer, Qwen3-30B-A3B's MoE block, Wan2.2-14B's DiT block, the synthetic 256-expert
layer) through the public collectives, exact: ``reduce_scatter`` and ``all_gather`` eagerly,
then ``prepare_reduce_scatter`` / ``prepare_all_gather`` run twice, bit-identical to the eager
calls.  Ranks are threads of this process (``local_groups``).

Wan2.2's block is the layer with the most shapes of its own: 1-D biases and norms beside
[13824, 5120] matrices, and a [1, 6, 5120] modulation whose one row leaves every rank but
the first an empty shard (FSDP2 pads it).  On the CPU the layers are scaled down
(:func:`~tide_triton.plan.workloads.scaled_shapes`, the same structure) and the MoE layers keep a
prefix of their experts; on a GPU every parameter at its real size.

Every gradient is an integer-valued bf16 (|x| <= 8), so every sum is exact in fp32 and the
checks are bit for bit."""
from __future__ import annotations

import pytest
import torch

try:
    from _dist import run_threads
except ImportError:  # pragma: no cover
    from tests._dist import run_threads

from tide_triton.plan.layout import ShardLayout
from tide_triton.plan.workloads import MODELS, layer_shapes, scaled_shapes

CPU_FACTOR = 512
"""Every dim divided by this on the CPU (Llama's [28672, 8192] MLP becomes [56, 16]; Wan's
modulation stays [1, 1, 10]: dim 0 of 1, under the world size)."""

CPU_EXPERT_PARAMS = 12
"""On the CPU the MoE layers keep their first parameters up to this many experts' matrices,
and their last two: the attention, runs of equal expert shapes, the tail (one interpreter
launch per tile makes all 393 / 771 slow there)."""


def _shapes(model: str, device: torch.device) -> list[tuple[int, ...]]:
    if device.type == "cuda":
        return list(layer_shapes(model))
    shapes = list(scaled_shapes(model, CPU_FACTOR))
    if len(shapes) > 100:  # the MoE layers
        shapes = shapes[:1 + CPU_EXPERT_PARAMS] + shapes[-2:]
    return shapes


def _layer_exact(model: str, W: int, device: torch.device) -> None:
    import tide_triton as tt

    shapes = _shapes(model, device)
    layout = ShardLayout(shapes, W)
    gen = torch.Generator().manual_seed(W)
    grads = [[torch.randint(-8, 9, s, generator=gen).to(torch.bfloat16).to(device) for s in shapes]
             for _ in range(W)]
    total = [sum(grads[r][p].float() for r in range(W)) for p in range(len(shapes))]
    cuda = device.type == "cuda"
    groups = tt.local_groups(W, timeout_s=60, devices=[device] * W if cuda else None)

    def ranked(r: int) -> str:
        g = groups[r]
        rows, c = layout.shard_rows(r), layout.rows_per_rank
        shards = [torch.full(s, -1.0, device=device) for s in layout.shard_shapes(r, padded=True)]
        tt.reduce_scatter(grads[r], shards, group=g, op="sum")
        mine = [x[:n].to(torch.bfloat16) for x, n in zip(shards, rows)]
        params = [torch.full(s, -3.0, dtype=torch.bfloat16, device=device) for s in shapes]
        tt.all_gather(mine, params, group=g)
        if cuda:
            tt.synchronize(g, timeout_s=60)
        for p in range(len(shapes)):
            want = total[p][r * c[p]: r * c[p] + rows[p]]
            assert torch.equal(shards[p][:rows[p]], want), f"{model} W={W} rank {r}: shard {p} {shapes[p]}"
            assert bool((shards[p][rows[p]:] == 0).all()), f"{model} W={W} rank {r}: shard {p}'s padding"
            assert torch.equal(params[p], total[p].to(torch.bfloat16)), f"{model} W={W} rank {r}: param {p}"
        eager_shards = [x.clone() for x in shards]

        # Prepared, as FSDP2 runs them: padded shards, padded parameters, the same tensors each run.
        rs = tt.prepare_reduce_scatter(grads[r], shards, group=g, op="sum")
        padded = [torch.full(s, -3.0, dtype=torch.bfloat16, device=device) for s in layout.padded_shapes]
        sent = [x.to(torch.bfloat16) for x in eager_shards]
        ag = tt.prepare_all_gather(sent, padded, group=g)
        for run in range(2):
            for x in shards:
                x.fill_(-1.0)
            for x in padded:
                x.fill_(-3.0)
            rs.run()
            ag.run()
            if cuda:
                tt.synchronize(g, timeout_s=60)
            for p in range(len(shapes)):
                assert torch.equal(shards[p], eager_shards[p]), f"{model} W={W} rank {r} run {run}: shard {p}"
                n = shapes[p][0] if shapes[p] else 1
                assert torch.equal(padded[p][:n], params[p]), f"{model} W={W} rank {r} run {run}: param {p}"
        return "ok"

    def body(r: int) -> str:
        if cuda:  # every rank its own compute stream, as on its own GPU
            with torch.cuda.stream(torch.cuda.Stream(device)):
                return ranked(r)
        return ranked(r)

    try:
        assert run_threads(body, W, timeout=300) == ["ok"] * W
    finally:
        for g in groups:
            g.close()


@pytest.mark.parametrize("W", [2, 3])
@pytest.mark.parametrize("model", MODELS)
def test_every_workload_layer_exact_on_the_cpu(model: str, W: int) -> None:
    _layer_exact(model, W, torch.device("cpu"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("W", [2, 4])
@pytest.mark.parametrize("model", MODELS)
def test_every_workload_layer_exact_at_its_real_size(model: str, W: int) -> None:
    _layer_exact(model, W, torch.device("cuda", torch.cuda.current_device()))
