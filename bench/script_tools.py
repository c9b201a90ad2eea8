"""What the benchmark scripts of ``bench/`` share beyond ``python -m tide_triton.bench``: their
entry point (:func:`script_main`), the bytes and plots of the node-local collectives, and the
memory table of Slot-Reuse from the layout.  Scripts run from ``bench/`` import it as ``script_tools``.
"""
from __future__ import annotations

import math
import os
import sys
from collections.abc import Sequence

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:  # run from a checkout: this tree's tide_triton
    sys.path.insert(0, _ROOT)

from tide_triton.bench.report import curves, finish_plot, pyplot  # noqa: E402
from tide_triton.plan.layout import ShardLayout  # noqa: E402
from tide_triton.plan.schedule import ring_plan  # noqa: E402
from tide_triton.plan.workloads import layer_shapes  # noqa: E402

__all__ = ["script_main", "collective_bytes", "plot_collective_rows", "slot_reuse_table"]

MIB = 2 ** 20


def script_main(main, header: str, argv: list[str] | None = None) -> int:
    """A benchmark script's entry point: ``--header`` prints its table header (for the
    device scripts, before their rows), anything else runs ``main``."""
    if "--header" in (sys.argv[1:] if argv is None else argv):
        print(header)
        return 0
    return main()


def collective_bytes(layer_numel: int, world_size: int) -> dict[str, int]:
    """Bytes the node-local collectives of one layer must read + write, all ranks together
    (``bench/collectives_gpu.py``'s ranks share one GPU, so this is what the GPU's memory moves):

    * ``rs`` (bf16 grads -> fp32 shards): every rank's (W-1)/W of its bf16 gradient to its
      peers (read + write), then the reduction reads W bf16 contributions of the shard and
      writes it in fp32;
    * ``ag`` (bf16): every rank's shard into its block (read + write), then every rank's rows
      into every parameter (read + write).

    The same bytes are charged to NCCL's FSDP2 path, so both bandwidths are "useful bytes
    per second" and comparable to the device-copy ceiling."""
    W, n = world_size, layer_numel
    return {"rs": W * (2 * (W - 1) * 2 * n // W + 2 * n + 4 * n // W),
            "ag": W * (2 * 2 * n // W + 2 * 2 * n)}


def plot_collective_rows(rows: Sequence[dict], path: str, *, title: str | None = None) -> str:
    """Time and bandwidth against world size of the node-local collectives of one layer:
    tide_triton's rows (``bench/collectives_gpu.py --json``: ``rs_ms`` / ``ag_ms``) and, where
    the rows have them, NCCL on FSDP2's path (``bench/nccl_baseline.py --json``: ops
    ``rs32.total`` = chunk_cat + fp32 reduce_scatter_tensor, ``ag.total`` = copy-in +
    all_gather_into_tensor + copy-out).  Bandwidth charges both the bytes of
    :func:`collective_bytes`; a ``ceiling_gbps`` recorded in the rows (measured in the same
    run) is drawn as a horizontal line.  Returns ``path``."""
    plt = pyplot()
    numel_cache: dict[str, int] = {}

    def numel(model: str, row: dict) -> int:
        if row.get("layer_numel"):
            return int(row["layer_numel"])
        if model not in numel_cache:
            numel_cache[model] = sum(math.prod(s) for s in layer_shapes(model))
        return numel_cache[model]

    points: list[tuple[str, str, str, int, float, int, dict]] = []  # kind, impl, model, W, ms, bytes, row
    for r in rows:
        if "rs_ms" in r and "ag_ms" in r:
            ring = f", {r['staging_bytes'] >> 20} MiB ring" if r.get("staging_bytes") else ""
            for kind in ("rs", "ag"):
                b = collective_bytes(numel(r["model"], r), r["world_size"])[kind]
                points.append((kind, f"tide_triton{ring}", r["model"], r["world_size"], r[f"{kind}_ms"], b, r))
        elif r.get("script") == "nccl_baseline" and r.get("op") in ("rs32.total", "ag.total") and r.get("max_ms"):
            kind = "rs" if r["op"].startswith("rs") else "ag"
            b = collective_bytes(numel(r["model"], r), r["world_size"])[kind]
            nccl = r.get("nccl_runtime") or r.get("nccl", "?")
            points.append((kind, f"NCCL {nccl} on FSDP2's path", r["model"], r["world_size"], r["max_ms"], b, r))
    if not points:
        raise ValueError("no collective rows to plot (expected rows of bench/collectives_gpu.py --json with "
                         "'rs_ms'/'ag_ms', or of bench/nccl_baseline.py --json with ops rs32.total/ag.total)")
    titles = {"rs": "reduce_scatter: bf16 grads -> fp32 shards (avg)", "ag": "all_gather: bf16 shards -> bf16 params"}
    models = list(dict.fromkeys(p[2] for p in points))
    impls = list(dict.fromkeys(p[1] for p in points))
    fig, axes = plt.subplots(2, 2, figsize=(10, 7.8), squeeze=False)
    for j, kind in enumerate(("rs", "ag")):
        at, ab = axes[0][j], axes[1][j]
        at.set_title(titles[kind], fontsize=10)
        curves(at, ab, models, impls, "NCCL", lambda model, impl, kind=kind: sorted(
            (p[3], p[4], p[5]) for p in points if p[0] == kind and p[1] == impl and p[2] == model))
        at.set_ylabel("time per collective (ms)")
        ab.set_ylabel("GB/s (bytes the collective must move / time)")
        ceils = sorted({round(r["ceiling_gbps"]) for r in rows if r.get("ceiling_gbps")})
        for c in ceils:
            ab.axhline(c, color="black", lw=1, ls=":")
            ab.annotate(f"copy ceiling {c} GB/s", (0.02, c), xycoords=("axes fraction", "data"), va="bottom",
                        fontsize=7)
        ab.set_ylim(0, max(ceils + [ab.get_ylim()[1]]) * 1.08)
    gpu = next((r.get("gpu") for r in rows if r.get("gpu")), "?")
    # rows written before bench/collectives_gpu.py spread ranks over GPUs ran them all on one
    gpus = sorted({int(p[6].get("gpus_used", 1)) for p in points})
    where = "all ranks on one GPU" if gpus == [1] else f"ranks on {'/'.join(map(str, gpus))} GPUs"
    finish_plot(fig, axes[0], axes[1], [p[6] for p in points], path,
            title or f"One layer's collectives against world size ({gpu}, {where})", models,
            [(impl, "--" if impl.startswith("NCCL") else "-", "s" if impl.startswith("NCCL") else "o")
             for impl in impls])
    plt.close(fig)
    return path


def slot_reuse_table(models: Sequence[str], world_sizes: Sequence[int], ring_bytes: int = 256 << 20,
                     pool: int = 2) -> str:
    """Per rank, backward of a stack of identical layers (bf16 params, fp32 reduce, one
    layer prefetched): the unsharded-parameter and reduce-scatter staging bytes, from the
    layout -- stock FSDP2 (2 unsharded layers + the fp32 RS input), tide_triton with its ring,
    tide_triton with Slot-Reuse (``pool`` heap slots of one unsharded layer, no staging of its
    own; the 4 MiB fallback ring counted).  No GPU needed."""
    lines = ["| model | W | unsharded layer (bf16) | stock FSDP2: 2 layers + fp32 RS input | "
             f"tide ring: 2 layers + {ring_bytes / MIB:g} MiB ring | tide Slot-Reuse: slots + 4 MiB ring | "
             "chunks per staged RS |",
             "|---|---|---|---|---|---|---|"]
    for model in models:
        for W in world_sizes:
            layout = ShardLayout(layer_shapes(model), W)
            layer = 2 * sum(layout.padded_numels)
            stock = 2 * layer + 2 * layer
            ring = 2 * layer + ring_bytes
            slot = pool * layer + (4 << 20)
            plan = ring_plan(layout, layer, 2, 2)
            lines.append(f"| {model} | {W} | {layer / MIB:.0f} MiB | {stock / MIB:.0f} MiB | {ring / MIB:.0f} MiB | "
                         f"{slot / MIB:.0f} MiB | {plan.rounds} |")
    return "\n".join(lines)
