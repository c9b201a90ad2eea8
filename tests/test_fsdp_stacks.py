"""tide_triton.fsdp on FSDP2 as training stacks build it, against stock FSDP2 bit for bit.

Each configuration shards a tiny model the way torchtitan (0.3.0) does -- its meshes, its
placements, ``set_gradient_divide_factor(1.0)`` on every FSDP module -- and trains it a few
steps with stock FSDP2 and with ``tide_triton.fsdp.enable``; losses, last-step gradients and
parameters must be equal, and ``enable`` must report every module served:

* ``dtensor1d``: torchtitan's ``full_dtensor`` backend without TP -- every parameter a
  DTensor ``Replicate`` on the 1-D ``dp_shard`` mesh, ``fully_shard(dp_mesh_dims=...)``;
* ``dtensor_hsdp``: the same backend with a ``dp_replicate`` axis (HSDP on the SPMD mesh);
* ``hsdp``: a 2-D ``(dp_replicate, fsdp)`` mesh (reduce-scatter on the shard dim, FSDP2's
  all-reduce across replicas), two micro-batches a step, the first without the all-reduce;
* ``tp``: FSDP + TP on a ``(dp, tp)`` mesh, TP by ``parallelize_module`` (Colwise / Rowwise),
  FSDP on the ``dp`` sub-mesh: FSDP2's collectives on the TP-local tensors;
* ``ep``: a MoE block whose experts are DTensors ``Shard(0)`` on the ``ep`` mesh with their
  own FSDP group on the ``efsdp`` mesh (torchtitan's ``shard_placement_fn`` with a
  ``ShardPlacementResult``), beside the block's dense group on the ``dp`` mesh; at W=2 the
  expert groups have one rank (nothing to communicate) and stay stock, saying so.

gloo has no PREMUL_SUM, so stock FSDP2 cannot run torchtitan's divide factor 1.0 as it
would on NCCL; the stock runs use ``set_force_sum_reduction_for_comms(True)`` with the same
factor instead -- a SUM and a post-divide by 1.0 (skipped), the same numbers PREMUL_SUM(1.0)
gives -- while tide_triton runs the factor as FSDP2 hands it over (a pre-multiplied sum).

Sums of two are exact in any order, so the shard groups here have two ranks: bit for bit.
"""
from __future__ import annotations

import logging

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

try:
    from _dist import LogLines, assert_same, run_multiprocess, train
except ImportError:  # pragma: no cover
    from tests._dist import LogLines, assert_same, run_multiprocess, train

pytestmark = pytest.mark.multiproc

VOCAB, DIM, HIDDEN, EXPERTS = 11, 8, 12, 4
BS, SEQ, LR, STEPS = 2, 4, 1e-2, 2


# --------------------------------------------------------------------------- the model
class RMSNorm(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * self.weight


class FeedForward(nn.Module):
    """SwiGLU, torchtitan's names: w1 / w3 colwise, w2 rowwise under TP."""

    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Linear(DIM, HIDDEN, bias=False)
        self.w3 = nn.Linear(DIM, HIDDEN, bias=False)
        self.w2 = nn.Linear(HIDDEN, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Experts(nn.Module):
    """Grouped experts, torchtitan's layout: w1/w3 ``(E, hidden, dim)``, w2 ``(E, dim, hidden)``.
    Under EP the weights are DTensors ``Shard(0)`` on the ep mesh and each rank runs its own
    experts on every token of its ep group (gathered, then the outputs summed back): a
    dense soft-MoE, exact, with no token dropping to make stock and tide_triton differ."""

    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(EXPERTS, HIDDEN, DIM) / DIM ** 0.5)
        self.w3 = nn.Parameter(torch.randn(EXPERTS, HIDDEN, DIM) / DIM ** 0.5)
        self.w2 = nn.Parameter(torch.randn(EXPERTS, DIM, HIDDEN) / HIDDEN ** 0.5)
        self.ep_group = None

    def forward(self, x: torch.Tensor, gates: torch.Tensor) -> torch.Tensor:
        from torch.distributed.tensor import DTensor

        w1, w3, w2 = (w.to_local() if isinstance(w, DTensor) else w for w in (self.w1, self.w3, self.w2))
        g = self.ep_group
        if g is None:
            return self._local(x, gates, w1, w3, w2, 0)
        import torch.distributed as dist

        n, r = dist.get_world_size(g), dist.get_rank(g)
        xs, gs = _Gather.apply(x, g), _Gather.apply(gates, g)  # every token of the ep group
        return _Sum.apply(self._local(xs, gs, w1, w3, w2, r * w1.shape[0]), g).chunk(n)[r]

    @staticmethod
    def _local(x, gates, w1, w3, w2, first: int) -> torch.Tensor:
        h = F.silu(torch.einsum("td,ehd->eth", x, w1)) * torch.einsum("td,ehd->eth", x, w3)
        y = torch.einsum("eth,edh->etd", h, w2)
        return (y * gates[:, first:first + w1.shape[0]].T.unsqueeze(-1)).sum(0)


class _Gather(torch.autograd.Function):
    """All-gather along dim 0 over a sub-group; backward: the summed gradient of this rank's rows
    (torch.distributed.nn's all_gather backward scatters by global rank: wrong on a sub-group)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        import torch.distributed as dist

        ctx.group = group
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        import torch.distributed as dist

        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad.chunk(dist.get_world_size(ctx.group))[dist.get_rank(ctx.group)], None


class _Sum(torch.autograd.Function):
    """All-reduce (sum) over a sub-group; backward: the same of the gradients."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        import torch.distributed as dist

        ctx.group = group
        x = x.contiguous().clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        import torch.distributed as dist

        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class MoE(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(DIM, EXPERTS, bias=False)
        self.experts = Experts()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, DIM)
        return self.experts(x, torch.softmax(self.router(x), -1)).reshape(shape)


class Block(nn.Module):
    def __init__(self, moe: bool) -> None:
        super().__init__()
        self.norm = RMSNorm(DIM)
        self.proj = nn.Linear(DIM, DIM)  # a bias: a 1-D parameter beside the matrices
        self.ffn_norm = RMSNorm(DIM)
        self.ffn = MoE() if moe else FeedForward()
        self.moe_enabled = moe

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.proj(self.norm(x))
        return x + self.ffn(self.ffn_norm(x))


class Tiny(nn.Module):
    def __init__(self, n_layers: int = 1, moe: bool = False) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Block(moe) for _ in range(n_layers))
        self.norm = RMSNorm(DIM)
        self.lm_head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.lm_head(self.norm(h))


def _tokens(step: int, dp_rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + dp_rank)
    return torch.randint(0, VOCAB, (BS, SEQ + 1), generator=g)


def _loss(model, tokens: torch.Tensor, dtensor_mesh=None) -> torch.Tensor:
    inp, labels = tokens[:, :-1], tokens[:, 1:]
    if dtensor_mesh is not None:  # full_dtensor: the batch is a DTensor sharded over dp
        from torch.distributed.tensor import DTensor, Shard

        inp = DTensor.from_local(inp, dtensor_mesh, [Shard(0)] * dtensor_mesh.ndim)
    logits = model(inp)
    if dtensor_mesh is not None:
        logits = logits.to_local()
    # A sum over tokens, as torchtitan's loss with its global token count (the divide factor 1.0)
    return F.cross_entropy(logits.reshape(-1, VOCAB).float(), labels.reshape(-1), reduction="sum")


# --------------------------------------------------------------------------- sharding as torchtitan does
def _mp():
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, cast_forward_inputs=False)


def _fsdp_all(model: Tiny, block_kw, root_kw) -> None:
    """torchtitan's apply_fsdp_to_decoder for an untied model: the embedding, [norm, lm_head]
    (kept unsharded after forward), every block, the root; then the divide factor 1.0."""
    from torch.distributed.fsdp import FSDPModule, fully_shard

    fully_shard(model.tok_embeddings, **root_kw)
    fully_shard([model.norm, model.lm_head], **root_kw, reshard_after_forward=False)
    for i, layer in enumerate(model.layers):
        fully_shard(layer, **block_kw(i, layer))
    fully_shard(model, **root_kw)
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_gradient_divide_factor(1.0)


_MESHES: dict = {}


def init_device_mesh(device: str, shape: tuple, mesh_dim_names: tuple):
    """One mesh per shape and names in a process, as a training job makes them once (DTensor
    specs are interned by equality: a second equal mesh would not be the parameters' own)."""
    from torch.distributed.device_mesh import init_device_mesh as make

    key = (device, shape, mesh_dim_names)
    if key not in _MESHES:
        _MESHES[key] = make(device, shape, mesh_dim_names=mesh_dim_names)
    return _MESHES[key]


def _build(config: str, W: int, tide: bool):
    """(model, the mesh its batch is a DTensor on or None, data-parallel rank, enable's report)."""
    import torch.distributed as dist

    torch.manual_seed(0)
    model = Tiny(moe=config == "ep")
    dp_rank, batch_mesh = dist.get_rank(), None
    mp = _mp()
    if config in ("dtensor1d", "dtensor_hsdp"):
        from torch.distributed.fsdp import DataParallelMeshDims
        from torch.distributed.tensor import Replicate, distribute_tensor

        if config == "dtensor1d":
            mesh = init_device_mesh("cpu", (W,), mesh_dim_names=("dp_shard",))
            dims = DataParallelMeshDims(shard="dp_shard")
        else:  # the same backend with a replicate axis: HSDP on the SPMD mesh
            mesh = init_device_mesh("cpu", (2, W // 2), mesh_dim_names=("dp_replicate", "dp_shard"))
            dims = DataParallelMeshDims(shard="dp_shard", replicate="dp_replicate")
        for mod in model.modules():  # torchtitan's distribute: Replicate on every dp axis
            for name, p in list(mod.named_parameters(recurse=False)):
                mod.register_parameter(name, nn.Parameter(distribute_tensor(p.data, mesh,
                                                                            [Replicate()] * mesh.ndim)))
        kw = dict(mesh=mesh, mp_policy=mp, dp_mesh_dims=dims)
        _fsdp_all(model, lambda i, m: kw, kw)
        batch_mesh = mesh
    elif config == "hsdp":
        mesh = init_device_mesh("cpu", (2, W // 2), mesh_dim_names=("dp_replicate", "fsdp"))
        kw = dict(mesh=mesh, mp_policy=mp)
        _fsdp_all(model, lambda i, m: kw, kw)
    elif config == "tp":
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        mesh = init_device_mesh("cpu", (W // 2, 2), mesh_dim_names=("dp", "tp"))
        dp_rank = mesh.get_local_rank("dp")  # both TP ranks of a dp rank see the same batch
        for layer in model.layers:
            parallelize_module(layer.ffn, mesh["tp"], {"w1": ColwiseParallel(), "w3": ColwiseParallel(),
                                                       "w2": RowwiseParallel()})
        kw = dict(mesh=mesh["dp"], mp_policy=mp)
        _fsdp_all(model, lambda i, m: kw, kw)
    elif config == "ep":
        from torch.distributed.fsdp._fully_shard._fsdp_common import ShardPlacementResult
        from torch.distributed.fsdp._fully_shard._fsdp_init import _get_mesh_info
        from torch.distributed.tensor import Shard, distribute_tensor

        ep = 2
        dense = init_device_mesh("cpu", (W,), mesh_dim_names=("fsdp",))
        sparse = init_device_mesh("cpu", (W // ep, ep), mesh_dim_names=("efsdp", "ep"))
        for layer in model.layers:  # torchtitan's ExpertParallel: experts Shard(0) on ep
            ex = layer.ffn.experts
            for name in ("w1", "w3", "w2"):
                ex.register_parameter(name, nn.Parameter(distribute_tensor(getattr(ex, name).data, sparse["ep"],
                                                                           [Shard(0)])))
            ex.ep_group = sparse["ep"].get_group()
        dense_info, edp_info = _get_mesh_info(dense), _get_mesh_info(sparse["efsdp"])
        kw = dict(mesh=dense, mp_policy=mp)

        def block_kw(i, layer):
            experts = set(layer.ffn.experts.parameters())

            def placement(p, experts=experts):
                if p in experts:
                    return ShardPlacementResult(placement=Shard(0), mesh_info=edp_info)
                return ShardPlacementResult(placement=Shard(0), mesh_info=dense_info)
            return dict(kw, shard_placement_fn=placement)
        _fsdp_all(model, block_kw, kw)
    else:
        raise ValueError(config)
    from torch.distributed.fsdp import FSDPModule

    report = None
    if tide:
        import tide_triton as tt

        report = tt.fsdp.enable(model)
    for name, m in model.named_modules():  # what runs stock: gloo lacks PREMUL_SUM, so SUM + a post-divide
        if isinstance(m, FSDPModule) and (report is None or report.get(name or "<root>")):
            m.set_force_sum_reduction_for_comms(True)  # by 1.0 (skipped): the same numbers
    return model, batch_mesh, dp_rank, report


def _full(t) -> torch.Tensor:
    """The whole parameter (or gradient) on the CPU, gathered from its DTensor shards."""
    from torch.distributed.tensor import DTensor

    if not isinstance(t, DTensor):
        return t.detach().float().clone()
    return t.detach().full_tensor().float().clone()


def _train(config: str, W: int, tide: bool) -> dict:
    import tide_triton as tt

    model, batch_mesh, dp_rank, report = _build(config, W, tide)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    # HSDP: two micro-batches a step, the first without the all-reduce across replicas
    # (FSDP2 keeps the reduce-scattered partial sum and adds it before the second's all-reduce)
    micro = (False, True) if config in ("hsdp", "dtensor_hsdp") else (True,)
    losses, grads = train(model, opt, STEPS, lambda s, i: _loss(model, _tokens(10 * s + i, dp_rank), batch_mesh),
                          sync=model.set_requires_all_reduce, full=_full, micro=micro)
    return {"losses": losses, "grads": grads, "params": {n: _full(p) for n, p in model.named_parameters()},
            "report": report, "stats": tt.fsdp.stats(model) if tide else None}


def _child(rank: int, W: int, configs: tuple[str, ...]) -> dict:
    import time

    h = LogLines().attach()
    # _full's full_tensor() of TP/EP DTensors warns of its sequential all-gathers: not under test
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    out: dict = {"_times": {}}
    for c in configs:
        t0 = time.perf_counter()
        h.lines.clear()
        out[c] = {"stock": _train(c, W, False), "tide": _train(c, W, True)}
        out[c]["logged"] = list(h.lines)
        out[c]["_time"] = round(time.perf_counter() - t0, 2)
    return out


def _check(out: list[dict], config: str, one_rank: tuple[str, ...] = ()) -> None:
    """``one_rank``: the parameter groups whose FSDP group has one rank (nothing to
    communicate): stock, saying so; every other group served."""
    for rank, res in enumerate(out):
        r = res[config]
        tide, stock = r["tide"], r["stock"]
        for name, why in tide["report"].items():
            if any(g.partition("[")[0] == name for g in one_rank):
                assert why is not None and "world size 1" in why, (rank, name, why)
            else:
                assert why is None, (rank, name, why, r["logged"])
        assert len(r["logged"]) == len(one_rank), (rank, r["logged"])
        for name, st in tide["stats"].items():
            if name in one_rank:
                assert st is None, (rank, name, st)
                continue
            assert st is not None and st["all_gathers"] > 0 and st["reduce_scatters"] > 0, (rank, name, st)
        assert_same(tide["losses"], stock["losses"], f"{config} losses rank {rank}")
        assert_same(tide["grads"], stock["grads"], f"{config} last-step grads rank {rank}")
        assert_same(tide["params"], stock["params"], f"{config} params rank {rank}")


@pytest.mark.parametrize("world_size, config", [(2, "dtensor1d"), (4, "dtensor_hsdp"), (4, "hsdp"), (4, "tp"),
                                                 (4, "ep")])
def test_stack_configuration_served_and_equal_to_stock(world_size: int, config: str) -> None:
    out = run_multiprocess(_child, world_size, (config,), timeout=400)
    print(f"{config} W={world_size}: {out[0][config]['_time']} s (rank 0)")
    _check(out, config)


def test_ep_at_two_ranks_serves_the_dense_group_and_says_why_the_experts_stay_stock() -> None:
    """EP 2 on 2 ranks: the experts' FSDP group (efsdp) has one rank -- nothing to all-gather or
    reduce-scatter, so it stays stock with that reason; the block's dense group is served."""
    out = run_multiprocess(_child, 2, ("ep",), timeout=400)
    print(f"ep W=2: {out[0]['ep']['_time']} s (rank 0)")
    _check(out, "ep", one_rank=("layers.0[1]",))


def _fake_foreach_reduce(reduce_scatter_input, reduce_scatter_event, post_reduce_stream, post_reduce_event,
                         all_reduce_input, all_reduce_event, partial_reduce_output, all_reduce_grads):
    if not all_reduce_grads:  # the HSDP early return: its event made in place
        return (reduce_scatter_input, reduce_scatter_event, post_reduce_stream, post_reduce_stream.record_event(),
                all_reduce_input, all_reduce_event, partial_reduce_output)
    return (reduce_scatter_input, reduce_scatter_event, post_reduce_stream, post_reduce_event,
            all_reduce_input, all_reduce_event, None)


def _fake_reduce_without_partial(reduce_scatter_input, reduce_scatter_event):
    return (reduce_scatter_input, reduce_scatter_event, None)


def test_hsdp_partial_result_layout_read_from_source() -> None:
    """The HSDP accumulation's early return is read like the normal one: tide_triton hands its
    partial sum back where FSDP2's post_backward unpacks it."""
    from tide_triton.fsdp import _torch_adapter as ta

    names = ("reduce_scatter_input", "reduce_scatter_event", "post_reduce_stream", "post_reduce_event",
             "all_reduce_input", "all_reduce_event")
    assert ta.reduce_return_order(_fake_foreach_reduce) == (*names, None)
    assert ta.partial_return_order(_fake_foreach_reduce) == (*names, "partial_reduce_output")
    assert ta.partial_return_order(_fake_reduce_without_partial) is None
    api = ta.load_api()  # the installed torch (2.13 in CI) has one
    assert api.partial_order is not None and "partial_reduce_output" in api.partial_order, api.partial_order


def test_replicate_only_mesh_stays_stock_saying_why() -> None:
    """A DDP mesh (FSDP2 replicates, nothing sharded) is the one data-parallel mesh left stock,
    and the reason says so -- no "HSDP", no "TP/EP"."""
    from types import SimpleNamespace

    from torch.distributed.fsdp._fully_shard._fsdp_common import DDPMeshInfo

    from tide_triton.fsdp import _torch_adapter as ta

    pg = SimpleNamespace(mesh_info=object.__new__(DDPMeshInfo))
    why = ta.why_stock(pg, ta.load_api())
    assert why is not None and "replicate only" in why and "DDPMeshInfo" in why, why


def _split_decision_in_a_shard_group(rank: int, W: int) -> str:
    import tide_triton as tt
    from tide_triton.fsdp import _torch_adapter

    model = Tiny()
    mesh = init_device_mesh("cpu", (2, W // 2), mesh_dim_names=("dp_replicate", "fsdp"))
    _fsdp_all(model, lambda i, m: dict(mesh=mesh), dict(mesh=mesh))
    if rank == 3:  # this rank's torch is not served: it would run stock FSDP2 in the shard group [2, 3]
        _torch_adapter._API, _torch_adapter._API_ERROR = None, "torch build not served here"
    try:
        report = tt.fsdp.enable(model)
    except RuntimeError as e:
        return f"RuntimeError: {e}"
    return "served" if all(v is None for v in report.values()) else f"report {report}"


def test_hsdp_ranks_deciding_differently_raise_in_their_shard_group_naming_global_ranks() -> None:
    """The tide-or-stock decision is agreed per shard group: the group [2, 3], split, raises on
    both of its ranks naming them by their global ranks; the group [0, 1] agrees and is served."""
    out = run_multiprocess(_split_decision_in_a_shard_group, 4, timeout=300)
    assert out[:2] == ["served", "served"], out
    for rank in (2, 3):
        assert out[rank].startswith("RuntimeError: enable: ") and \
            "on rank 2 and stock FSDP2's on rank 3 of the shard group [2, 3]" in out[rank], (rank, out[rank])
        assert "torch build not served here" in out[rank], (rank, out[rank])
