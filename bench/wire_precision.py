"""Accuracy side of the cross-node reduce-scatter's wire dtype (issue 5: "choose fp32 or bf16
for the wire by measurement and state the accuracy/bytes trade-off").  CPU only, no data
movement: the summation of one shard is replayed in the exact order and precision each
scheme uses, against an fp64 reference.

    python bench/wire_precision.py [--numel 1048576] [--local-size 8] [--nodes 2 4 8 16 64 128]

Schemes, for W = nodes x local ranks, bf16 gradients (the autograd grads):

* ``tide fp32 wire``: node-local fp32 sum of the L bf16 contributions (local rank order), then
  recursive halving along the rail: every round the partner's fp32 partial sum is added
  (``held + received``) -- the order ``tide_triton.executors.across_nodes`` uses, rounding only in fp32;
* ``tide bf16 wire``: the same, but every partial sum is rounded to bf16 when it is sent
  (half the inter-node bytes);
* ``NCCL ring bf16``: the classic bf16 ring reduce-scatter -- W-1 hops, each adding the next
  rank's bf16 value to the running partial sum and storing it in bf16;
* ``NCCL ring fp32`` (FSDP2 with reduce_dtype=fp32): the same ring in fp32 after chunk_cat's
  up-cast.

Printed: the relative error of the result (norm of the error / norm of the exact sum) and the
largest error in bf16 ulps of the element's magnitude (sum over ranks of |g|: the exact sum
itself can cancel to ~0), per scheme and node count.  Gradients are
drawn per rank as N(0, 1) times a per-element scale that varies over six decades (gradient
magnitudes differ widely across a layer), with a fixed seed.
"""
from __future__ import annotations

import argparse

import torch


def _bf16(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.bfloat16).to(torch.float32)


def _grads(W: int, n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    scale = torch.exp(torch.empty(n).uniform_(-7.0, 7.0, generator=g))  # ~6 decades
    return (torch.randn(W, n, generator=g) * scale).to(torch.bfloat16)


def _halving(node_sums: torch.Tensor, wire_bf16: bool) -> torch.Tensor:
    """Recursive halving over ``nodes`` (a power of two) of fp32 node sums: each round, the
    partner's partial sum (rounded to bf16 on the wire if asked) is added to the held one.
    Every element's tree has the same shape, so replaying it on all elements at once is exact
    for the order; which node keeps which half only relabels leaves."""
    held = node_sums.clone()
    while held.shape[0] > 1:
        half = held.shape[0] // 2
        sent = held[half:]
        held = held[:half] + (_bf16(sent) if wire_bf16 else sent)
    return held[0]


def _ring(grads: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    acc = grads[0].to(dtype)
    for r in range(1, grads.shape[0]):
        acc = (acc.to(torch.float32) + grads[r].to(torch.float32)).to(dtype)
    return acc.to(torch.float32)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--numel", type=int, default=1 << 18)
    ap.add_argument("--local-size", type=int, default=8)
    ap.add_argument("--nodes", type=int, nargs="+", default=[2, 4, 8, 16, 64, 128])
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    L, n = args.local_size, args.numel
    print(f"shard of {n} elements, {L} ranks per node, bf16 gradients; relative error / max error in bf16 ulps of sum|g|")
    print("| W (nodes x L) | tide fp32 wire | tide bf16 wire | NCCL ring bf16 | NCCL ring fp32 | inter-node bytes bf16 / fp32 wire |")
    print("|---|---|---|---|---|---|")
    for N in args.nodes:
        if N & (N - 1):
            raise SystemExit(f"--nodes must be powers of two here (got {N})")
        W = N * L
        grads = _grads(W, n, args.seed + N)
        exact = grads.to(torch.float64).sum(0)
        node_sums = torch.zeros(N, n)
        for m in range(N):  # node-local fp32 sums, local rank order
            acc = grads[m * L].to(torch.float32)
            for l in range(1, L):
                acc = acc + grads[m * L + l].to(torch.float32)
            node_sums[m] = acc
        # bf16 ulp of the element's magnitude scale, sum over ranks of |g| (the exact sum itself
        # can cancel to ~0, which would make any error look infinite)
        ulp = grads.to(torch.float64).abs().sum(0) * 2.0 ** -8
        cells = []
        for out in (_halving(node_sums, False), _halving(node_sums, True), _ring(grads, torch.bfloat16),
                    _ring(grads, torch.float32)):
            err = out.double() - exact
            rel = (err.norm() / exact.norm()).item()
            cells.append(f"{rel:.2e} / {(err.abs() / ulp).max().item():.1f}")
        print(f"| {W} ({N} x {L}) | " + " | ".join(cells) + " | 1/2 |", flush=True)


if __name__ == "__main__":
    main()
