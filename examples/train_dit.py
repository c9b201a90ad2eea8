"""Wan2.2-style diffusion-transformer (DiT) blocks trained with FSDP2 on tide_triton's collectives.

    torchrun --nproc-per-node 2 examples/train_dit.py                  # CPU, tiny (a few seconds a step)
    torchrun --nproc-per-node 2 examples/train_dit.py --device cuda    # rank r on cuda:LOCAL_RANK

What makes a DiT block different for the collectives: beside its large matrices (Wan2.2-14B:
[5120, 5120] attention projections, a [13824, 5120] feed-forward) it carries a bias for almost
every matrix, per-layer norms and a [1, 6, dim] modulation table, 27 parameters of three ranks
and very different sizes; the modulation's single row leaves every rank but the first an empty
(padded) shard.  The block follows Wan2.2's parameter names and shapes
(``tide_triton/workloads.json``, ``wan2.2-14b``; :func:`DiTConfig.wan22_14b`): adaptive
LayerNorm modulation (shift, scale, gate) of self-attention and the feed-forward from the
time embedding plus the block's own ``modulation``, RMSNorm on queries and keys, cross-attention
to a text context.  The video latents, the text encoder and the flow-matching target are
stand-ins: tokens embedded twice (latents and context), a timestep per sequence, and
next-token cross-entropy as the loss -- the blocks' parameters and matrix shapes are the
model's, the data is not.  Every block is one ``fully_shard`` unit, the root another.
"""
from __future__ import annotations

import argparse
import math
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
class DiTConfig:
    vocab: int = 64
    dim: int = 32
    n_layers: int = 1
    n_heads: int = 4
    ffn: int = 88
    """Feed-forward inner width (Wan2.2-14B: 13824 for dim 5120)."""
    context: int = 8
    """Text-context tokens the cross-attention reads (stand-in: the first ones of each sequence)."""
    freq_dim: int = 32
    """Sinusoidal timestep features before the time embedding (Wan2.2: 256)."""
    norm_eps: float = 1e-6

    def __post_init__(self) -> None:
        if self.dim % self.n_heads or (self.dim // self.n_heads) % 2:
            raise ValueError(f"dim must be n_heads * an even head_dim, got dim={self.dim}, n_heads={self.n_heads}")
        if self.freq_dim % 2:
            raise ValueError(f"freq_dim must be even, got {self.freq_dim}")

    @classmethod
    def wan22_14b(cls, n_layers: int, vocab: int = 4096) -> "DiTConfig":
        """Wan2.2-14B's block: dim 5120, 40 heads, feed-forward 13824."""
        return cls(vocab=vocab, dim=5120, n_layers=n_layers, n_heads=40, ffn=13824, context=512, freq_dim=256)


class DiTAttention(nn.Module):
    """Multi-head attention with biases and RMSNorm over the full query / key width (Wan's
    ``norm_q`` / ``norm_k``); cross-attention when given a context."""

    def __init__(self, cfg: DiTConfig) -> None:
        super().__init__()
        self.h, self.hd = cfg.n_heads, cfg.dim // cfg.n_heads
        self.q, self.k, self.v, self.o = (nn.Linear(cfg.dim, cfg.dim) for _ in range(4))
        self.norm_q = RMSNorm(cfg.dim, cfg.norm_eps)
        self.norm_k = RMSNorm(cfg.dim, cfg.norm_eps)

    def forward(self, x: torch.Tensor, context: torch.Tensor | None = None) -> torch.Tensor:
        B, T, D = x.shape
        src = x if context is None else context

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.view(B, -1, self.h, self.hd).transpose(1, 2)

        q, k, v = heads(self.norm_q(self.q(x))), heads(self.norm_k(self.k(src))), heads(self.v(src))
        if context is None:  # positions within the latent sequence
            q, k = _rope(q), _rope(k)
        y = F.scaled_dot_product_attention(q, k, v)
        return self.o(y.transpose(1, 2).reshape(B, T, D))


class DiTBlock(nn.Module):
    """Wan2.2's block: self-attention and feed-forward under the time embedding's
    shift / scale / gate (plus the block's ``modulation``), cross-attention to the context."""

    def __init__(self, cfg: DiTConfig) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.dim, eps=cfg.norm_eps, elementwise_affine=False)
        self.self_attn = DiTAttention(cfg)
        self.cross_attn = DiTAttention(cfg)
        self.norm3 = nn.LayerNorm(cfg.dim, eps=cfg.norm_eps)
        self.norm2 = nn.LayerNorm(cfg.dim, eps=cfg.norm_eps, elementwise_affine=False)
        self.ffn = nn.Sequential(nn.Linear(cfg.dim, cfg.ffn), nn.GELU(approximate="tanh"), nn.Linear(cfg.ffn, cfg.dim))
        self.modulation = nn.Parameter(torch.randn(1, 6, cfg.dim) / cfg.dim ** 0.5)

    def forward(self, x: torch.Tensor, e: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        shift1, scale1, gate1, shift2, scale2, gate2 = (self.modulation + e).chunk(6, dim=1)
        x = x + gate1 * self.self_attn(self.norm1(x) * (1 + scale1) + shift1)
        x = x + self.cross_attn(self.norm3(x), context)
        return x + gate2 * self.ffn(self.norm2(x) * (1 + scale2) + shift2)


def timestep_features(t: torch.Tensor, dim: int) -> torch.Tensor:
    """Sinusoidal features of timesteps ``t`` (batch,) -> (batch, dim)."""
    half = dim // 2
    freqs = torch.exp(-math.log(10000.0) * torch.arange(half, device=t.device, dtype=torch.float32) / half)
    ang = t.float()[:, None] * freqs[None, :]
    return torch.cat((ang.cos(), ang.sin()), dim=-1)


class DiT(nn.Module):
    def __init__(self, cfg: DiTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.latent_emb = nn.Embedding(cfg.vocab, cfg.dim)  # stand-in: the patch embedding of video latents
        self.text_emb = nn.Embedding(cfg.vocab, cfg.dim)  # stand-in: the text encoder, projected
        self.time_embedding = nn.Sequential(nn.Linear(cfg.freq_dim, cfg.dim), nn.SiLU(), nn.Linear(cfg.dim, cfg.dim))
        self.time_projection = nn.Sequential(nn.SiLU(), nn.Linear(cfg.dim, 6 * cfg.dim))
        self.layers = nn.ModuleList(DiTBlock(cfg) for _ in range(cfg.n_layers))
        self.norm = nn.LayerNorm(cfg.dim, eps=cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """``tokens`` (batch, seq): latents from all of them, the context from the first
        ``cfg.context``, the timestep from the first one."""
        cfg = self.cfg
        x = self.latent_emb(tokens)
        context = self.text_emb(tokens[:, :cfg.context])
        t = self.time_embedding(timestep_features(tokens[:, 0] % 1000, cfg.freq_dim).to(x.dtype))
        e = self.time_projection(t).view(-1, 6, cfg.dim)
        for layer in self.layers:
            x = layer(x, e, context)
        return self.output(self.norm(x))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--share-gpu", action="store_true", help="with --device cuda: every rank on cuda:0")
    ap.add_argument("--no-tide", action="store_true", help="stock FSDP2 collectives")
    ap.add_argument("--dim", type=int, default=32)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--ffn", type=int, default=88)
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--batch", type=int, default=2, help="sequences per rank")
    ap.add_argument("--seq", type=int, default=16)
    args = ap.parse_args()
    if args.steps < 1:
        ap.error(f"--steps must be >= 1, got {args.steps}")
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device is visible to torch; leave --device out to train on the CPU")
    try:
        cfg = DiTConfig(dim=args.dim, n_heads=args.heads, ffn=args.ffn, n_layers=args.layers,
                        context=min(8, args.seq))
    except ValueError as e:
        ap.error(str(e))

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = rank_device(args.device, rank, args.share_gpu)
    torch.manual_seed(0)
    model = DiT(cfg).to(device)
    n_params = sum(1 for _ in model.layers[0].parameters())
    shard(model, init_device_mesh(device.type, (world,)), bf16_policy())
    if rank == 0:
        print(f"{world} ranks on {device}: {cfg.n_layers} DiT block(s), {n_params} parameters per block, "
              f"dim {cfg.dim}; {'stock FSDP2' if args.no_tide else 'tide_triton'}", flush=True)
    if not args.no_tide:
        enable_tide(model, rank)
    train(model, cfg, args.steps, rank, args.batch, args.seq, device)


if __name__ == "__main__":
    main()
