"""A Qwen3-style mixture-of-experts block trained with FSDP2 on tide_triton's collectives.

    torchrun --nproc-per-node 2 examples/train_moe.py                     # CPU, tiny (a few seconds a step)
    torchrun --nproc-per-node 2 examples/train_moe.py --device cuda       # rank r on cuda:LOCAL_RANK
    torchrun --nproc-per-node 2 examples/train_moe.py --experts 128 --top-k 8 --dim 256 --device cuda

What makes an MoE layer different for the collectives: many small expert matrices (Qwen3-30B-A3B
has 128 experts of three 768 x 2048 matrices per layer: 393 parameters in one FSDP unit), so a
stock reduce-scatter pays a copy per parameter into one flat buffer, where tide_triton's kernels
read each parameter in place.  The block: RMSNorm, attention (grouped-query, rotary, q/k norms
as in Qwen3), RMSNorm, a softmax router choosing ``--top-k`` of ``--experts`` SwiGLU experts
per token (weights renormalised over the chosen ones), each expert its own three ``nn.Linear``.
Every block is one ``fully_shard`` unit, the root another; ``tide_triton.fsdp.enable`` then
routes their all-gathers and reduce-scatters through tide_triton.  Rank 0 prints a line per
step.  The process group is gloo (tide_triton only bootstraps over it).
"""
from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_llama import (  # noqa: E402 - the Llama example's pieces
    RMSNorm, _rope, bf16_policy, enable_tide, rank_device, shard, train)


@dataclass(frozen=True)
class MoEConfig:
    vocab: int = 128
    dim: int = 32
    n_layers: int = 1
    n_heads: int = 4
    n_kv_heads: int = 2
    experts: int = 8
    """Experts per block (Qwen3-30B-A3B: 128)."""
    top_k: int = 2
    """Experts each token is routed to (Qwen3-30B-A3B: 8)."""
    expert_hidden: int = 24
    """SwiGLU inner width of one expert (Qwen3-30B-A3B: 768 for dim 2048)."""
    norm_eps: float = 1e-6
    fixed_routing: bool = False
    """Benchmarks: token ``i`` goes to experts ``i, i+1, ..., i+top_k-1`` (mod experts) with equal
    weights, whatever the router says -- the same tokens per expert every step (so the same
    allocation sizes in backward); the router still runs, so its weight keeps a gradient."""

    def __post_init__(self) -> None:
        if self.dim % self.n_heads or (self.dim // self.n_heads) % 2:
            raise ValueError(f"dim must be n_heads * an even head_dim, got dim={self.dim}, n_heads={self.n_heads}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_kv_heads must divide n_heads={self.n_heads}, got {self.n_kv_heads}")
        if not 1 <= self.top_k <= self.experts:
            raise ValueError(f"top_k must be in [1, experts={self.experts}], got {self.top_k}")


class Attention(nn.Module):
    """Grouped-query attention with Qwen3's RMSNorm on queries and keys (per head)."""

    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        self.h, self.kv, self.hd = cfg.n_heads, cfg.n_kv_heads, cfg.dim // cfg.n_heads
        self.wq = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wk = nn.Linear(cfg.dim, self.kv * self.hd, bias=False)
        self.wv = nn.Linear(cfg.dim, self.kv * self.hd, bias=False)
        self.wo = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.q_norm = RMSNorm(self.hd, cfg.norm_eps)
        self.k_norm = RMSNorm(self.hd, cfg.norm_eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, D = x.shape
        q = self.q_norm(self.wq(x).view(B, T, self.h, self.hd)).transpose(1, 2)
        k = self.k_norm(self.wk(x).view(B, T, self.kv, self.hd)).transpose(1, 2)
        v = self.wv(x).view(B, T, self.kv, self.hd).transpose(1, 2)
        k, v = (t.repeat_interleave(self.h // self.kv, dim=1) for t in (k, v))
        y = F.scaled_dot_product_attention(_rope(q), _rope(k), v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(B, T, D))


class Expert(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.gate = nn.Linear(dim, hidden, bias=False)
        self.up = nn.Linear(dim, hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class SparseMoE(nn.Module):
    """Softmax router, top-k experts per token, weights renormalised over the chosen k."""

    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        self.top_k = cfg.top_k
        self.fixed_routing = cfg.fixed_routing
        self.router = nn.Linear(cfg.dim, cfg.experts, bias=False)
        self.experts = nn.ModuleList(Expert(cfg.dim, cfg.expert_hidden) for _ in range(cfg.experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        probs = F.softmax(self.router(x).float(), dim=-1)
        weight, chosen = probs.topk(self.top_k, dim=-1)
        weight = (weight / weight.sum(-1, keepdim=True)).to(x.dtype)
        if self.fixed_routing:  # see MoEConfig.fixed_routing
            E = len(self.experts)
            chosen = (torch.arange(x.shape[0], device=x.device)[:, None]
                      + torch.arange(self.top_k, device=x.device)) % E
            weight = weight * 0 + 1.0 / self.top_k  # the router's graph kept: its weight gets a (zero) gradient
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            tok, slot = (chosen == e).nonzero(as_tuple=True)
            # every expert runs (on no tokens if none chose it), so every expert parameter has a
            # gradient on every rank and FSDP2's reduce-scatter covers all of them
            out.index_add_(0, tok, expert(x[tok]) * weight[tok, slot, None])
        return out.view(shape)


class Block(nn.Module):
    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.moe_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.moe = SparseMoE(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.moe(self.moe_norm(x))


class MoEModel(nn.Module):
    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        self.tok_emb = nn.Embedding(cfg.vocab, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok_emb(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.output(self.norm(x))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--share-gpu", action="store_true", help="with --device cuda: every rank on cuda:0")
    ap.add_argument("--no-tide", action="store_true", help="stock FSDP2 collectives")
    ap.add_argument("--dim", type=int, default=32)
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--expert-hidden", type=int, default=24)
    ap.add_argument("--batch", type=int, default=2, help="sequences per rank")
    ap.add_argument("--seq", type=int, default=16)
    args = ap.parse_args()
    if args.steps < 1:
        ap.error(f"--steps must be >= 1, got {args.steps}")
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device is visible to torch; leave --device out to train on the CPU")
    try:
        cfg = MoEConfig(dim=args.dim, n_layers=args.layers, experts=args.experts, top_k=args.top_k,
                        expert_hidden=args.expert_hidden)
    except ValueError as e:
        ap.error(str(e))

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = rank_device(args.device, rank, args.share_gpu)
    torch.manual_seed(0)
    model = MoEModel(cfg).to(device)
    n_params = sum(1 for _ in model.layers[0].parameters())
    shard(model, init_device_mesh(device.type, (world,)), bf16_policy())
    if rank == 0:
        print(f"{world} ranks on {device}: {cfg.n_layers} MoE block(s) of {cfg.experts} experts (top {cfg.top_k}), "
              f"{n_params} parameters per block, dim {cfg.dim}; "
              f"{'stock FSDP2' if args.no_tide else 'tide_triton'}", flush=True)
    if not args.no_tide:
        enable_tide(model, rank)
    train(model, cfg, args.steps, rank, args.batch, args.seq, device)


if __name__ == "__main__":
    main()
