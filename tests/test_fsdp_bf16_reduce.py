"""``MixedPrecisionPolicy(reduce_dtype=torch.bfloat16)`` on tide_triton against stock FSDP2.

tide_triton sums the gradients in fp32 and rounds each sum once to bf16; the sharded gradients
keep stock's dtype (the parameters' fp32: FSDP2 casts its bf16 sums to ``orig_dtype``).  Stock
FSDP2 sums in bf16 on the wire, rounding at each of its W - 1 additions (a ring).  Per element,
with the op's scale ``s`` (1/W for the default average) and the ranks' gradients ``g_r``:

* tide_triton is the exact sum, rounded once: ``|tide - s*sum(g)| <= 2^-8 |s*sum(g)|`` (bf16's
  unit roundoff) plus fp32's ``W 2^-24 s sum|g|``;
* stock is within ``(W - 1) 2^-8 s sum|g|`` of it, so the two differ by at most
  ``(W + 1) 2^-8 s sum|g|`` -- the bound docs/fsdp.md states;
* at W = 2 one bf16 addition rounds once too (halving is exact): bit for bit equal to stock.

CPU: gloo, the host transport, the kernels as plain torch (``cpu_torch``: the product's CPU path).
"""
from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

try:
    from _dist import run_multiprocess
except ImportError:  # pragma: no cover
    from tests._dist import run_multiprocess

pytestmark = [pytest.mark.multiproc, pytest.mark.cpu_torch]
U = 2.0 ** -8  # bf16's unit roundoff


class _Net(nn.Module):
    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(d, d) for _ in range(2)])
        self.head = nn.Linear(d, 13)  # 13 rows: uneven shards

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return (self.head(x) ** 2).sum()


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _full(t: torch.Tensor) -> torch.Tensor:
    import torch.distributed as dist

    parts: list = [None] * dist.get_world_size()
    dist.all_gather_object(parts, t.to_local().detach().contiguous())
    return torch.cat(parts)[: t.shape[0]].reshape(t.shape).clone()


def _run(rank: int, W: int) -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group as fpg

    import tide_triton as tt

    lines = _Lines()
    logger = logging.getLogger("tide_triton")
    logger.addHandler(lines)
    logger.setLevel(logging.INFO)
    out: dict = {}
    for name in ("stock", "tide"):
        torch.manual_seed(0)
        m = _Net()
        mesh = init_device_mesh("cpu", (W,))
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
        for layer in m.layers:
            fully_shard(layer, mesh=mesh, mp_policy=mp)
        fully_shard(m, mesh=mesh, mp_policy=mp)
        if name == "tide":
            tt.fsdp.enable(m)
        inputs: dict[str, list] = {}  # this rank's unsharded gradients, per parameter, per backward
        orig = fpg.foreach_reduce

        def spy(fsdp_params, unsharded_grads, *args, inputs=inputs, orig=orig, **kwargs):
            for fp, g in zip(fsdp_params, unsharded_grads):
                inputs.setdefault(fp._param_fqn, []).append(g.detach().double().clone())
            return orig(fsdp_params, unsharded_grads, *args, **kwargs)

        fpg.foreach_reduce = spy
        try:
            steps = []
            for i in range(2):  # the second backward accumulates into the existing .grad
                gen = torch.Generator().manual_seed(100 * i + rank)
                m(torch.randn(4, 16, generator=gen)).backward()
                steps.append({n: (p.grad.to_local().dtype, _full(p.grad)) for n, p in m.named_parameters()})
        finally:
            fpg.foreach_reduce = orig
        every: list = [None] * W
        dist.all_gather_object(every, inputs)
        out[name] = {"steps": steps, "inputs": every}
    out["logged"] = [ln for ln in lines.lines if "reduce_dtype=torch.bfloat16" in ln]
    return out


def _check(W: int) -> None:
    for rank, out in enumerate(run_multiprocess(_run, W, timeout=600)):
        stock, tide = out["stock"], out["tide"]
        for n in stock["steps"][0]:
            exact, spread = torch.zeros(()), torch.zeros(())
            for step in range(2):
                grads = [r[n][step] for r in tide["inputs"]]  # the gradients tide_triton reduced
                s_sum, s_abs = sum(grads) / W, sum(g.abs() for g in grads) / W
                exact, spread = exact + s_sum, spread + s_abs
                (want_dtype, want), (dtype, got) = stock["steps"][step][n], tide["steps"][step][n]
                where = f"rank {rank} W={W} backward {step} {n}"
                assert dtype == want_dtype == torch.float32, where  # stock's result dtype
                if step == 0:  # the sum rounded once: a bf16 value within half an ulp of the exact
                    assert torch.equal(got, got.bfloat16().float()), where
                    err = (got.double() - s_sum).abs()
                    assert bool((err <= U * s_sum.abs() + W * 2.0 ** -24 * s_abs + 1e-30).all()), \
                        (where, float(err.max()))
                if W == 2:
                    assert torch.equal(got, want), (where, float((got - want).abs().max()))
                else:
                    err = (got.double() - want.double()).abs()
                    assert bool((err <= (W + 1) * U * spread + 1e-30).all()), (where, float(err.max()))
            assert torch.equal(tide["inputs"][rank][n][0], stock["inputs"][rank][n][0]), n  # same inputs
        # said once per group (3: layers.0, layers.1, the root's head)
        assert len(out["logged"]) == 3 and all("rounded once to bf16" in ln for ln in out["logged"]), out["logged"]


def test_bf16_reduce_dtype_rounds_fp32_sums_once_bit_for_bit_stock_at_2_ranks() -> None:
    _check(2)


def test_bf16_reduce_dtype_stays_within_the_stated_bound_of_stock_at_4_ranks() -> None:
    _check(4)
