"""torchtitan's own trainer on CPU (gloo), stock FSDP2 or with ``tide_triton.fsdp.enable``.

Runs torchtitan's ``Trainer`` -- its model registry, its parallelize step (TP, HSDP, EP, its
FSDP placements and ``set_gradient_divide_factor(1.0)``), its loss, optimizer and grad-norm
clipping -- for a few steps on synthetic tokens, and writes every step's loss and grad norm.
With ``--tide`` the drop-in is applied to the model parts after torchtitan's parallelize step,
as a user would add it.  Compare two runs' files with ``--compare A B``.

    torchrun --nproc-per-node 4 bench/torchtitan_cpu.py --model llama3 --fsdp 2 --tp 2 --out stock.json
    torchrun --nproc-per-node 4 bench/torchtitan_cpu.py --model llama3 --fsdp 2 --tp 2 --tide --out tide.json
    python bench/torchtitan_cpu.py --compare stock.json tide.json

torchtitan 0.3.0 targets GPUs; each patch below lets one piece run on CPU and says why.  None
changes what FSDP2 does with the parameters and gradients.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch._utils

# Patch 1 -- device detection: torchtitan picks "cuda" when no accelerator is found
# (tools/utils.py reads this at import), so it must answer "cpu" before torchtitan is imported.
torch._utils._get_available_device_type = lambda: "cpu"


def _synthetic_inputs():
    """Patch 4 -- data: torchtitan's debug configs read a tokenizer and the c4_test set from its
    source tree's tests/assets, which its wheel does not ship.  Random tokens, a stream per data
    rank (the same stream in every run, so stock and tide_triton runs see the same batches)."""
    from dataclasses import dataclass

    from torchtitan.components.dataloader import BaseDataLoader
    from torchtitan.components.tokenizer import BaseTokenizer

    class NoTokenizer(BaseTokenizer):
        @dataclass(kw_only=True, slots=True)
        class Config(BaseTokenizer.Config):
            pass

        def __init__(self, config=None, **kwargs):
            super().__init__()

        def encode(self, *args, **kwargs) -> list[int]:
            raise NotImplementedError("synthetic tokens only")

        def decode(self, *args, **kwargs) -> str:
            raise NotImplementedError("synthetic tokens only")

        def get_vocab_size(self) -> int:
            return 0

    class RandomTokens(BaseDataLoader):
        @dataclass(kw_only=True, slots=True)
        class Config(BaseDataLoader.Config):
            vocab_size: int = 2048

        def __init__(self, config, *, dp_world_size, dp_rank, tokenizer, seq_len, local_batch_size, **kwargs):
            self.vocab, self.rank, self.seq, self.batch = config.vocab_size, dp_rank, seq_len, local_batch_size

        def __iter__(self):
            g = torch.Generator().manual_seed(1000 + self.rank)
            while True:
                toks = torch.randint(0, self.vocab, (self.batch, self.seq + 1), generator=g)
                yield {"input": toks[:, :-1]}, toks[:, 1:]

        def state_dict(self):
            return {}

        def load_state_dict(self, state_dict) -> None:
            pass

    return NoTokenizer.Config(), RandomTokens.Config()


def _patch_torchtitan() -> None:
    import torchtitan.components.metrics as metrics
    import torchtitan.models.common.attention as attention
    import torchtitan.tools.utils as tt_utils

    class _NoDeviceMemory:
        """Patch 2 -- the device memory monitor reads CUDA memory statistics (torch.cpu has none)."""
        device_name = "cpu"

        def get_peak_stats(self):
            return metrics.DeviceMemStats(0, 0.0, 0, 0.0, 0, 0)

        def reset_peak_stats(self) -> None:
            pass

    metrics.build_device_memory_monitor = lambda: _NoDeviceMemory()

    def causal_attention(self, q_BLNH, k_BLNH, v_BLNH, *, attention_masks=None, score_mod=None, scale=None,
                         enable_gqa=False, out_transform=None, **kwargs):
        """Patch 5 -- attention: FlexAttention has no CPU backward in torch 2.13.  With one document
        per sequence (synthetic tokens, no positions given) its mask is plain causal: SDPA computes
        the same attention."""
        if score_mod is not None or out_transform is not None:
            raise NotImplementedError("the CPU attention patch covers causal attention only")
        out = torch.nn.functional.scaled_dot_product_attention(
            q_BLNH.transpose(1, 2), k_BLNH.transpose(1, 2), v_BLNH.transpose(1, 2), is_causal=True, scale=scale,
            enable_gqa=enable_gqa)
        return out.transpose(1, 2)

    attention.FlexAttention.forward = causal_attention

    # Patch 6 -- gloo has no PREMUL_SUM, and torchtitan always sets a gradient divide factor of
    # 1.0, which FSDP2 turns into PREMUL_SUM(1.0) on the stock path: run it as a SUM and scale
    # the output by the factor (1.0: the same bits).  tide_triton's path runs its own reduction.
    dist = torch.distributed
    reduce_scatter_single = dist.reduce_scatter_single

    def premul_as_sum(output, input, op=dist.ReduceOp.SUM, group=None, async_op=False):
        factor = getattr(op, "factor", None) if getattr(op, "op", None) == dist.ReduceOp.PREMUL_SUM else None
        if factor is None:
            return reduce_scatter_single(output, input, op=op, group=group, async_op=async_op)
        work = reduce_scatter_single(output, input, op=dist.ReduceOp.SUM, group=group, async_op=async_op)
        if work is not None:
            work.wait()
        if factor != 1.0:
            output.mul_(factor)
        return work

    dist.reduce_scatter_single = premul_as_sum

    # Patch 7 -- after the first step torchtitan barriers with device_ids=[current CUDA device]
    # (torch.cpu answers a string) and shortens every process group's timeout: a barrier only,
    # keeping the first timeout, which slow CPU steps need.
    import torchtitan.distributed.utils as dist_utils

    dist_utils.set_pg_timeouts = lambda timeout, parallel_dims: dist.barrier()
    # Patch 3 -- LOCAL_RANK picks a device index; on CPU every rank has the one CPU device.
    tt_utils.get_local_device = lambda: torch.device("cpu")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="llama3", choices=["llama3", "qwen3"])
    ap.add_argument("--backend", default="spmd_types", choices=["spmd_types", "full_dtensor", "partial_dtensor"])
    ap.add_argument("--fsdp", type=int, default=-1, help="data_parallel_shard_degree")
    ap.add_argument("--replicate", type=int, default=1, help="data_parallel_replicate_degree (HSDP)")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--ep", type=int, default=1)
    ap.add_argument("--experts", type=int, default=0, help="MoE: experts per layer (default: the model's)")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--tide", action="store_true", help="tide_triton.fsdp.enable on the model parts")
    ap.add_argument("--out", default=None)
    ap.add_argument("--compare", nargs=2, default=None)
    args = ap.parse_args()
    if args.compare:
        sys.exit(_compare(*args.compare))
    _patch_torchtitan()
    trainer = _build(args)
    report = None
    if args.tide:
        import tide_triton

        report = {}
        for m in trainer.model_parts:
            report.update(tide_triton.fsdp.enable(m))
    rows = []
    log = trainer.metrics_processor.log

    def record(step, global_avg_loss, global_max_loss, grad_norm, extra_metrics=None):
        rows.append({"step": step, "loss": float(global_avg_loss), "max_loss": float(global_max_loss),
                     "grad_norm": float(grad_norm)})
        return log(step, global_avg_loss, global_max_loss, grad_norm, extra_metrics=extra_metrics)

    trainer.metrics_processor.log = record
    trainer.train()
    served = None
    if report is not None:
        served = {name: why for name, why in report.items()}
    trainer.close()
    if torch.distributed.get_rank() == 0 and args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "steps": rows, "enable": served}, f, indent=1)
    torch.distributed.destroy_process_group()


def _build(args):
    from torchtitan.components.checkpoint import CheckpointManager
    from torchtitan.components.validate import Validator

    if args.model == "llama3":
        from torchtitan.models.llama3.config_registry import llama3_debugmodel as make
    else:
        from torchtitan.models.qwen3.config_registry import qwen3_moe_debug as make
    cfg = make()
    cfg.training.steps = args.steps
    cfg.training.seq_len = args.seq_len
    cfg.training.local_batch_size = args.batch
    cfg.training.disable_cuda_graphs = True
    cfg.parallelism.spmd_backend = args.backend
    cfg.parallelism.data_parallel_shard_degree = args.fsdp
    cfg.parallelism.data_parallel_replicate_degree = args.replicate
    cfg.parallelism.tensor_parallel_degree = args.tp
    cfg.parallelism.expert_parallel_degree = args.ep
    cfg.checkpoint = CheckpointManager.Config(enable=False)
    cfg.validator = Validator.Config(enable=False)
    if args.experts:
        cfg.model_spec = _with_experts(args.experts)
    cfg.debug.seed = 0  # the same initial weights in every run
    cfg.tokenizer, cfg.dataloader = _synthetic_inputs()
    cfg.dump_folder = os.environ.get("TMPDIR", "/tmp") + "/torchtitan_cpu"
    return cfg.build()


def _with_experts(n: int):
    """qwen3's debug MoE with ``n`` experts a layer (``top_k`` at most ``n``), built by its own
    registry: with fewer experts than FSDP ranks torchtitan shards the experts on dim 1."""
    import torchtitan.models.qwen3 as qwen3

    build = qwen3._build_qwen3_moe_layers

    def fewer_experts(*a, **kw):
        kw["num_experts"], kw["top_k"] = n, min(kw["top_k"], n)
        return build(*a, **kw)

    qwen3._build_qwen3_moe_layers = fewer_experts
    try:
        return qwen3.model_registry("debugmodel_moe")
    finally:
        qwen3._build_qwen3_moe_layers = build


def _compare(a: str, b: str) -> int:
    ra, rb = json.load(open(a)), json.load(open(b))
    worst = 0.0
    for x, y in zip(ra["steps"], rb["steps"]):
        d = max(abs(x[k] - y[k]) for k in ("loss", "grad_norm"))
        worst = max(worst, d)
        print(f"step {x['step']}: loss {x['loss']:.9g} vs {y['loss']:.9g}, grad_norm {x['grad_norm']:.9g} vs "
              f"{y['grad_norm']:.9g}")
    print(f"largest difference {worst:.3g}; served: {rb.get('enable')}")
    return 0


if __name__ == "__main__":
    main()
