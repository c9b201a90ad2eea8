"""Train a small Llama-style model with FSDP2 (``fully_shard``) on tide_triton's collectives.

    torchrun --nproc-per-node 2 examples/train_llama.py                    # CPU: gloo + host transport
    torchrun --nproc-per-node 2 examples/train_llama.py --device cuda      # rank r on cuda:LOCAL_RANK
    torchrun --nproc-per-node 2 examples/train_llama.py --device cuda --share-gpu   # both on cuda:0
    torchrun --nproc-per-node 2 examples/train_llama.py --no-tide          # stock FSDP2, for comparison
    torchrun --nproc-per-node 2 examples/train_llama.py --dim 64 --layers 2 --steps 10   # larger

On the CPU the kernels run as plain torch (exact to the bit), so a step costs about what a stock
FSDP2 step (``--no-tide``) costs; ``bench/cpu_fsdp_step.py`` measures the two in turns.

The process group is gloo in every case: tide_triton only needs it for its bootstrap -- the
data moves through its own transport (CPU shared memory, or VMM heaps + copy engines on the
GPU) -- and gloo also allows several processes on one GPU (``--share-gpu``), which the NCCL
that torch pins refuses (``Duplicate GPU detected``).  Rank 0 prints the loss and the time of
every step.

The model (:class:`Llama`) is also the one ``tests/test_fsdp.py`` trains: token embedding,
RMSNorm, attention with q/k/v/o projections (optional biases) and rotary embeddings, a SwiGLU
MLP, an output projection tied to the embedding (or not), plus an optional per-head query gain
of shape ``(1, n_heads, head_dim)`` -- a 3-D parameter whose dim 0 is smaller than any world
size, which FSDP2 pads on every rank but one.
"""
from __future__ import annotations

import argparse
import os
import time
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True)
class LlamaConfig:
    vocab: int = 256
    dim: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int | None = None
    """Key/value heads (grouped-query attention, Llama-3-style); None: as many as query heads."""
    hidden: int = 172
    """SwiGLU inner width (Llama's 8/3 * dim, not a multiple of anything)."""
    tied: bool = True
    """Output projection shares the embedding's weight."""
    bias: bool = False
    """Biases on the attention projections (Qwen-style) -- FSDP2 shards them like any 1-D param."""
    head_gain: bool = False
    """A (1, n_heads, head_dim) query gain per block: dim 0 = 1 < world size."""
    norm_eps: float = 1e-5

    def __post_init__(self) -> None:
        if self.dim % self.n_heads or (self.dim // self.n_heads) % 2:
            raise ValueError(f"dim must be n_heads * an even head_dim, got dim={self.dim}, n_heads={self.n_heads}")
        if self.n_kv_heads is not None and (self.n_kv_heads < 1 or self.n_heads % self.n_kv_heads):
            raise ValueError(f"n_kv_heads must divide n_heads={self.n_heads}, got {self.n_kv_heads}")


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight


def _rope(x: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding over (batch, heads, seq, head_dim), computed on the fly."""
    _, _, T, hd = x.shape
    inv = 1.0 / (10000.0 ** (torch.arange(0, hd, 2, device=x.device, dtype=torch.float32) / hd))
    ang = torch.arange(T, device=x.device, dtype=torch.float32)[:, None] * inv[None, :]
    cos, sin = ang.cos().to(x.dtype), ang.sin().to(x.dtype)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.n_heads, self.head_dim = cfg.n_heads, cfg.dim // cfg.n_heads
        self.n_kv = cfg.n_kv_heads or cfg.n_heads
        self.wq = nn.Linear(cfg.dim, cfg.dim, bias=cfg.bias)
        self.wk = nn.Linear(cfg.dim, self.n_kv * self.head_dim, bias=cfg.bias)
        self.wv = nn.Linear(cfg.dim, self.n_kv * self.head_dim, bias=cfg.bias)
        self.wo = nn.Linear(cfg.dim, cfg.dim, bias=cfg.bias)
        self.head_gain = nn.Parameter(torch.ones(1, cfg.n_heads, self.head_dim)) if cfg.head_gain else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, D = x.shape
        q = self.wq(x).view(B, T, self.n_heads, self.head_dim)
        k, v = (w(x).view(B, T, self.n_kv, self.head_dim) for w in (self.wk, self.wv))
        if self.head_gain is not None:
            q = q * self.head_gain  # broadcast (1, H, hd) over (B, T, H, hd)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        if self.n_kv != self.n_heads:  # grouped-query attention: each kv head serves n_heads / n_kv
            k, v = (t.repeat_interleave(self.n_heads // self.n_kv, dim=1) for t in (k, v))
        y = F.scaled_dot_product_attention(_rope(q), _rope(k), v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(B, T, D))


class FeedForward(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.hidden, bias=False)
        self.w3 = nn.Linear(cfg.dim, cfg.hidden, bias=False)
        self.w2 = nn.Linear(cfg.hidden, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.ffn = FeedForward(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.ffn(self.ffn_norm(x))


class Llama(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab, bias=False)
        if cfg.tied:
            self.output.weight = self.tok_emb.weight
        self.apply(self._init)

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.2)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.normal_(m.bias, std=0.1)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok_emb(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.output(self.norm(x))


def loss_fn(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy (fp32) of ``tokens`` (batch, seq + 1)."""
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), tokens[:, 1:].reshape(-1))


def shard(model: nn.Module, mesh, mp_policy=None, **kw) -> None:
    """torchtitan's wrapping: every block, then the root (embedding, final norm, output)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = mp_policy or MixedPrecisionPolicy()
    for layer in model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp, **kw)
    fully_shard(model, mesh=mesh, mp_policy=mp, **kw)


def batch(cfg: LlamaConfig, step: int, rank: int, batch_size: int, seq: int, device="cpu") -> torch.Tensor:
    """Rank ``rank``'s tokens at ``step``: a fixed function of (step, rank), so a
    single-process reference can rebuild the concatenated global batch."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(0, cfg.vocab, (batch_size, seq + 1), generator=g).to(device)


def rank_device(kind: str, rank: int, share_gpu: bool = False) -> torch.device:
    """The CPU, or on CUDA the torchrun convention: local rank r on cuda:r (modulo the GPUs),
    every rank on cuda:0 with ``share_gpu``; made the current device."""
    if kind != "cuda":
        return torch.device("cpu")
    local = int(os.environ.get("LOCAL_RANK", rank))
    device = torch.device("cuda", 0 if share_gpu else local % torch.cuda.device_count())
    torch.cuda.set_device(device)
    return device


def bf16_policy():
    """FSDP2's mixed precision the drop-in targets: bf16 parameters, fp32 gradient reduction."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def enable_tide(model: nn.Module, rank: int, group=None) -> None:
    """``tide_triton.fsdp.enable(model)``; rank 0 prints how many FSDP modules it serves and why
    any stays on stock FSDP2."""
    import tide_triton

    report = tide_triton.fsdp.enable(model, group=group)
    stock = {k: v for k, v in report.items() if v is not None}
    if rank == 0:
        print(f"tide_triton on {len(report) - len(stock)}/{len(report)} FSDP modules"
              + (f"; stock: {stock}" if stock else ""), flush=True)


def train(model: nn.Module, cfg, steps: int, rank: int, batch_size: int, seq: int, device: torch.device) -> None:
    """``steps`` AdamW steps on rank ``rank``'s batches (:func:`batch`, :func:`loss_fn`); rank 0
    prints each step's loss and time.  Then waits for tide_triton's work and ends the process group."""
    import torch.distributed as dist

    import tide_triton

    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for step in range(steps):
        tokens = batch(cfg, step, rank, batch_size, seq, device)
        sync()
        t0 = time.perf_counter()
        loss = loss_fn(model, tokens)
        loss.backward()
        opt.step()
        opt.zero_grad()
        sync()
        if rank == 0:
            print(f"step {step + 1}/{steps}  loss {loss.item():.4f}  {(time.perf_counter() - t0) * 1e3:8.1f} ms",
                  flush=True)
    if device.type == "cuda":
        tide_triton.synchronize()
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--share-gpu", action="store_true",
                    help="with --device cuda: every rank on cuda:0 (default: rank on cuda:LOCAL_RANK)")
    ap.add_argument("--no-tide", action="store_true", help="stock FSDP2 collectives")
    ap.add_argument("--agree-always", action="store_true",
                    help="agree every collective's arguments on every call (init(agree='always')); the drop-in's "
                         "own groups agree each signature once")
    ap.add_argument("--dim", type=int, default=32, help="model width (n_heads = 4)")
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--batch", type=int, default=2, help="sequences per rank")
    ap.add_argument("--seq", type=int, default=16)
    ap.add_argument("--fp32", action="store_true", help="no mixed precision (default: bf16 params, fp32 reduce)")
    args = ap.parse_args()
    if args.steps < 1:
        ap.error(f"--steps must be >= 1, got {args.steps}")
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device is visible to torch; leave --device out to train on the CPU")
    if args.dim < 8 or args.dim % 8:
        ap.error(f"--dim must be a multiple of 8 (4 heads of an even size), got {args.dim}")

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy

    import tide_triton

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = rank_device(args.device, rank, args.share_gpu)
    if rank == 0:
        print(f"{world} ranks on {device if args.device == 'cpu' else f'cuda (rank 0 on {device})'}: "
              f"dim {args.dim}, {args.layers} layer(s), {args.batch} x {args.seq} tokens per rank, "
              f"{'stock FSDP2' if args.no_tide else 'tide_triton'}", flush=True)
    cfg = LlamaConfig(dim=args.dim, n_layers=args.layers, hidden=(8 * args.dim) // 3 + 1, bias=True, head_gain=True)
    torch.manual_seed(0)
    model = Llama(cfg).to(device)
    mesh = init_device_mesh(device.type, (world,))
    shard(model, mesh, MixedPrecisionPolicy() if args.fp32 else bf16_policy())
    if not args.no_tide:
        enable_tide(model, rank, tide_triton.init(agree="always") if args.agree_always else None)
    train(model, cfg, args.steps, rank, args.batch, args.seq, device)


if __name__ == "__main__":
    main()
