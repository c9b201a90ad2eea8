"""Schedule simulator: ``python bench/simulate.py``.

Runs the cross-node all-gather / reduce-scatter schedules of a real layer without data,
checks them element range by element range (:mod:`tide_triton.plan.check`), and prints
bytes per rank, rounds and staging next to NCCL's ring and FSDP2's buffers.

    python bench/simulate.py --model llama-3.1-70b --ranks 16 32 64 128 1024 --local-size 8
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable, Sequence

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:  # run from a checkout: this tree's tide_triton
    sys.path.insert(0, _ROOT)

from tide_triton.bench.cli import Progress  # noqa: E402
from tide_triton.plan.across_nodes import AllGatherPlan, ReduceScatterPlan  # noqa: E402
from tide_triton.plan.layout import ShardLayout  # noqa: E402
from tide_triton.plan.check import (  # noqa: E402
    fixed_shard_shapes,
    nccl_ring_bytes,
    simulate_all_gather,
    simulate_reduce_scatter,
)
from tide_triton.plan.topology import Topology  # noqa: E402
from tide_triton.plan.workloads import MODELS, layer_shapes  # noqa: E402

MIB = 2 ** 20


def _estimate_runs(ag, rs) -> int:
    W, L = ag.topology.world_size, ag.topology.local_size
    P = len(ag.layout)
    ag_runs = sum(ag.chunk_counts()) * 2 + W * (L - 1) * P * 2
    rs_runs = W * (L - 1 + len(rs.node_rounds)) * (len(rs.windows) + P)
    return ag_runs + rs_runs


def simulation_rows(model: str, ranks: Sequence[int], local_size: int, chunk_bytes: int, ring_bytes: int,
                    elem_bytes: int, fixed_ref: int | None, check_limit: int,
                    on_step: Callable[[str], None] | None = None) -> list[dict]:
    """One row per (mode, world size): the cross-node schedules of ``model``'s layer checked
    element by element by :mod:`tide_triton.plan.check` (or, above ``check_limit``
    estimated runs, counted from the node-level rounds), next to NCCL's ring and FSDP2's
    buffers.  ``on_step(what)`` is called before each piece of work (for progress)."""
    step = on_step or (lambda what: None)
    base = layer_shapes(model)
    rows = []
    for mode in ("layer", "fixed-shard"):
        if mode == "fixed-shard" and fixed_ref is None:
            continue
        for W in ranks:
            shapes = base if mode == "layer" else fixed_shard_shapes(base, W, fixed_ref)
            layout = ShardLayout(shapes, W)
            topo = Topology(W, min(local_size, W) if W % local_size else local_size)
            ag = AllGatherPlan(layout, topo, elem_bytes=elem_bytes, chunk_bytes=chunk_bytes)
            rs = {wb: ReduceScatterPlan(layout, topo, ring_bytes=ring_bytes, grad_bytes=elem_bytes,
                                        wire_bytes=wb) for wb in (4, 2)}
            est = _estimate_runs(ag, rs[4])
            row: dict = {"model": model, "mode": mode, "world_size": W, "topology": str(topo),
                         "shard_bytes": layout.flat_shard_numel * elem_bytes}
            checked = est <= check_limit
            what = f"{mode} W={W} ({topo})"
            t0 = time.perf_counter()
            if checked:
                step(f"{what}: checking the all-gather")
                rag = simulate_all_gather(ag)
                step(f"{what}: checking the reduce-scatter")
                rrs = simulate_reduce_scatter(rs[4])
                rrs2 = simulate_reduce_scatter(rs[2], check=False)
                errors = rag.errors + rrs.errors + rrs2.errors
                ag_sent, rs_sent = rag.sent, rrs.sent
                rs2_sent = rrs2.sent
                ag_chunks = rag.chunks
            else:
                step(f"{what}: counting (too big to check)")
                errors = []
                ag_sent, rs_sent, rs2_sent = ag.sent_bytes(), rs[4].sent_bytes(), rs[2].sent_bytes()
                ag_chunks = ag.chunk_counts()

            def net(sent: dict[str, list[int]], prefix: str) -> int:
                rws = [v for k, v in sent.items() if k.startswith(prefix)]
                return max((sum(c) for c in zip(*rws)), default=0)

            nag = nccl_ring_bytes(layout, topo.local_size, elem_bytes)
            nrs = nccl_ring_bytes(layout, topo.local_size, 4)
            row.update({
                "checked": checked, "errors": errors, "check_seconds": round(time.perf_counter() - t0, 2),
                "ag_scheme": ag.scheme, "ag_rounds_inter": len(ag.node_rounds), "ag_rounds": ag.rounds,
                "ag_inter_bytes": net(ag_sent, "ag inter"), "ag_intra_bytes": net(ag_sent, "ag intra"),
                "ag_chunks": max(ag_chunks), "ag_inflight_bytes": ag.inflight_bytes,
                "ag_staging_bytes": ag.staging_bytes,
                "nccl_ag_bus_bytes": nag["bus"], "nccl_ag_per_nic_bytes": nag["per_nic"],
                "fsdp2_ag_buffer_bytes": nag["total"],
                "rs_scheme": rs[4].scheme, "rs_rounds_per_window": rs[4].rounds,
                "rs_windows": len(rs[4].windows), "rs_windows_bf16": len(rs[2].windows),
                "rs_inter_bytes_fp32": net(rs_sent, "rs inter"), "rs_inter_bytes_bf16": net(rs2_sent, "rs inter"),
                "rs_intra_bytes": net(rs_sent, "rs intra"),
                "rs_staging_bytes_fp32": rs[4].staging_bytes, "rs_staging_bytes_bf16": rs[2].staging_bytes,
                "nccl_rs_bus_bytes": nrs["bus"], "nccl_rs_per_nic_bytes": nrs["per_nic"],
                "fsdp2_rs_input_bytes": nrs["total"],
                "ag_round_bytes": {k: max(v) for k, v in ag_sent.items()},
                "rs_round_bytes_fp32": {k: max(v) for k, v in rs_sent.items()},
                "rs_round_bytes_bf16": {k: max(v) for k, v in rs2_sent.items()},
            })
            rows.append(row)
    return rows


def _mib(b: float, digits: int = 1) -> str:
    return f"{b / MIB:,.{digits}f}"


def _ok(r: dict) -> str:
    if not r["checked"]:
        return "counted (too big to check)"
    return f"exact ({r['check_seconds']} s)" if not r["errors"] else f"FAILED: {r['errors'][0]}"


def simulation_table(rows: Sequence[dict]) -> str:
    """Markdown tables (one all-gather and one reduce-scatter table per mode) of
    :func:`simulation_rows`' rows."""
    out = []
    for mode in dict.fromkeys(r["mode"] for r in rows):
        rs_ = [r for r in rows if r["mode"] == mode]
        out.append(f"\n## {rs_[0]['model']}, {mode} (per-rank shard: "
                   + ", ".join(sorted({_mib(r['shard_bytes']) for r in rs_}, key=lambda s: float(s.replace(",", ""))))
                   + " MiB); MiB per rank\n")
        out.append("| W | nodes x L | AG rounds (net+node) | AG net sent | NCCL ring AG bus / per NIC | "
                   "AG chunks | AG in-flight cap | AG staging | FSDP2 AG buffer | checked |")
        out.append("|---|---|---|---|---|---|---|---|---|---|")
        for r in rs_:
            out.append(
                f"| {r['world_size']} | {r['topology']} | "
                f"{r['ag_rounds_inter']}+{r['ag_rounds'] - r['ag_rounds_inter']}"
                f" ({r['ag_scheme']}) | {_mib(r['ag_inter_bytes'])} | {_mib(r['nccl_ag_bus_bytes'])} / "
                f"{_mib(r['nccl_ag_per_nic_bytes'])} | {r['ag_chunks']} | {_mib(r['ag_inflight_bytes'])} | "
                f"{_mib(r['ag_staging_bytes'])} | {_mib(r['fsdp2_ag_buffer_bytes'])} | {_ok(r)} |")
        out.append("")
        out.append("| W | nodes x L | RS rounds/window x windows | RS net sent fp32 / bf16 wire | "
                   "NCCL ring RS fp32 bus / per NIC | RS node-local sent | RS staging (fp32 / bf16 wire) | "
                   "FSDP2 fp32 RS input | checked |")
        out.append("|---|---|---|---|---|---|---|---|---|")
        for r in rs_:
            out.append(
                f"| {r['world_size']} | {r['topology']} | {r['rs_rounds_per_window']} x {r['rs_windows']} "
                f"({r['rs_scheme']}) | {_mib(r['rs_inter_bytes_fp32'])} / {_mib(r['rs_inter_bytes_bf16'])} | "
                f"{_mib(r['nccl_rs_bus_bytes'])} / {_mib(r['nccl_rs_per_nic_bytes'])} | "
                f"{_mib(r['rs_intra_bytes'])} | {_mib(r['rs_staging_bytes_fp32'], 2)} / "
                f"{_mib(r['rs_staging_bytes_bf16'], 2)} | {_mib(r['fsdp2_rs_input_bytes'])} | {_ok(r)} |")
    return "\n".join(out)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python bench/simulate.py", description=(
        "Simulate and check the cross-node all-gather / reduce-scatter schedules; "
        "print bytes per rank, rounds and staging next to NCCL's ring and FSDP2's buffers."))
    ap.add_argument("--model", default="llama-3.1-70b", choices=list(MODELS))
    ap.add_argument("--ranks", type=int, nargs="+", default=[16, 32, 64, 128, 1024])
    ap.add_argument("--local-size", type=int, default=8)
    ap.add_argument("--chunk-bytes", type=int, default=4 << 20, help="all-gather chunk cap")
    ap.add_argument("--ring-bytes", type=int, default=64 << 20, help="reduce-scatter staging per rank")
    ap.add_argument("--elem-bytes", type=int, default=2, help="parameter / gradient element bytes (bf16: 2)")
    ap.add_argument("--fixed-ref", type=int, default=None,
                    help="also a fixed-per-rank-shard variant: each rank's shard is the one it has at this "
                         "world size (default: the smallest of --ranks); 0 to skip")
    ap.add_argument("--check-limit", type=int, default=3_000_000,
                    help="check element by element when the plans have at most this many runs (estimate); "
                         "larger ones are counted from the node-level rounds only")
    ap.add_argument("--json", action="store_true", help="print JSON rows instead of tables")
    args = ap.parse_args(argv)
    if args.local_size < 1:
        ap.error(f"--local-size must be >= 1, got {args.local_size}")
    for W in args.ranks:
        if W < 1 or W % args.local_size and W > args.local_size:
            ap.error(f"--ranks: {W} is not a multiple of --local-size {args.local_size}")
    ref = min(args.ranks) if args.fixed_ref is None else (args.fixed_ref or None)
    print(f"{args.model}: ranks {' '.join(map(str, args.ranks))}, {args.local_size} per node, "
          f"all-gather chunks of {args.chunk_bytes / 2**20:g} MiB, reduce-scatter staging "
          f"{args.ring_bytes / 2**20:g} MiB per rank, {args.elem_bytes}-byte elements",
          file=sys.stderr if args.json else sys.stdout, flush=True)
    with Progress(None, "simulate") as progress:
        rows = simulation_rows(args.model, args.ranks, args.local_size, args.chunk_bytes, args.ring_bytes,
                               args.elem_bytes, ref, args.check_limit, on_step=progress.step)
    if args.json:
        print(json.dumps(rows, indent=1))
    else:
        print(simulation_table(rows))
    return 1 if any(r["errors"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
