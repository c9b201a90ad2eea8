"""Report tables and plots built from benchmark and simulation rows (no printing: the
command-line entry points in :mod:`tide_triton.bench`, :mod:`tide_triton.simulate` and
``bench/*.py`` own the console).

Tables are Markdown strings; plots are files written by matplotlib (the ``bench`` extra,
imported only when a plot is asked for).  Rows are the dictionaries the benchmarks append to
their JSON-lines files, so recorded runs can be plotted again without re-running them.
"""
from __future__ import annotations

import json
import math
import os
import time
from dataclasses import asdict
from typing import Callable, Iterable, Sequence

from .layout import ShardLayout

__all__ = [
    "kernel_table", "staging_table", "slot_reuse_table", "kernel_json_rows",
    "simulation_rows", "simulation_table",
    "collective_bytes", "load_rows", "plot_kernel_rows", "plot_collective_rows",
]

MIB = 2 ** 20


def _sig(x: float, digits: int = 3) -> str:
    """``x`` with ``digits`` significant digits (``0.000412``, ``3.12``, ``4250``)."""
    if x == 0 or not math.isfinite(x):
        return f"{x:g}"
    decimals = max(0, digits - 1 - int(math.floor(math.log10(abs(x)))))
    return f"{x:.{decimals}f}"


# --------------------------------------------------------------------------- kernel tables
def kernel_table(rows: Sequence, ceiling, *, speedups: bool = True) -> str:
    """Markdown table of :class:`~tide_triton.measure.BenchRow` results.

    ``ceiling``: the device-copy :class:`BenchRow` of the same run (bandwidth is shown as a
    fraction of it).  ``speedups=False`` leaves the speed-up column out (on the CPU the
    Triton interpreter is timed, so a ratio against torch says nothing).  Host-overhead rows
    show host microseconds and, where counted (GPU), kernel launches per call."""
    cgbps = ceiling.gbps()
    head = "| model | W | op | implementation | time (ms) | GB/s | % of copy ceiling |"
    sep = "|---|---|---|---|---|---|---|"
    if speedups:
        head, sep = head + " speed-up vs FSDP2 |", sep + "---|"
    lines = [head, sep]
    base: dict[tuple, float] = {}
    for r in rows:
        key = (r.model, r.world_size, r.op)
        if r.impl.startswith("FSDP2"):
            base[key] = r.time_ms
        if r.op.startswith("host"):
            launches = r.extra.get("launches")
            note = f"{launches} launches / call" if launches is not None else ""
            lines.append(f"| {r.model} | {r.world_size} | {r.op} | {r.impl} | "
                         f"{r.extra['host_us']:.1f} µs host | | |" + (f" {note} |" if speedups else ""))
            continue
        cells = (f"| {r.model} | {r.world_size} | {r.op} | {r.impl} | {_sig(r.time_ms)} | "
                 f"{_sig(r.gbps())} | {_sig(100 * r.gbps() / cgbps)}% |")
        if speedups:
            su = f"{base[key] / r.time_ms:.2f}x" if key in base and not r.impl.startswith("FSDP2") else ""
            cells += f" {su} |"
        lines.append(cells)
    return "\n".join(lines)


def kernel_json_rows(rows: Sequence, ceiling, device: str, info: dict) -> list[dict]:
    """The JSON rows ``python -m tide_triton.bench --json`` appends: the ceiling first, then
    every result, each with its bandwidth, fraction of the ceiling, device and environment."""
    out = []
    for r in [ceiling, *rows]:
        d = asdict(r)
        d.update(gbps=r.gbps(), pct_ceiling=100 * r.gbps() / ceiling.gbps(), device=device, **info)
        out.append(d)
    return out


def staging_table(models: Sequence[str], world_sizes: Sequence[int], ring_bytes: int = 256 << 20) -> str:
    """Reduce-scatter buffer bytes per rank, from the layout: FSDP2's fp32 input (the whole
    layer, W padded shards) vs tide_triton's receive ring of ``ring_bytes`` -- no GPU needed."""
    from .schedule import ring_plan
    from .workloads import layer_shapes

    lines = ["| model | W | FSDP2 fp32 RS input / rank | tide RS staging / rank | chunks per RS |",
             "|---|---|---|---|---|"]
    for model in models:
        for W in world_sizes:
            layout = ShardLayout(layer_shapes(model), W)
            plan = ring_plan(layout, ring_bytes, 2)
            lines.append(f"| {model} | {W} | {4 * sum(layout.padded_numels) / MIB:.0f} MiB | "
                         f"{plan.staging_elems() * 2 / MIB:.1f} MiB | {plan.rounds} |")
    return "\n".join(lines)


def slot_reuse_table(models: Sequence[str], world_sizes: Sequence[int], ring_bytes: int = 256 << 20,
                     pool: int = 2) -> str:
    """Per rank, backward of a stack of identical layers (bf16 params, fp32 reduce, one
    layer prefetched): the unsharded-parameter and reduce-scatter staging bytes, from the
    layout -- stock FSDP2 (2 unsharded layers + the fp32 RS input), tide_triton with its ring,
    tide_triton with Slot-Reuse (``pool`` heap slots of one unsharded layer, no staging of its
    own; the 4 MiB fallback ring counted).  No GPU needed."""
    from .schedule import ring_plan
    from .workloads import layer_shapes

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


# --------------------------------------------------------------------------- simulation rows
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
    element by element by :mod:`tide_triton.schedule_check` (or, above ``check_limit``
    estimated runs, counted from the node-level rounds), next to NCCL's ring and FSDP2's
    buffers.  ``on_step(what)`` is called before each piece of work (for progress)."""
    from .hier_schedule import AllGatherPlan, ReduceScatterPlan
    from .schedule_check import fixed_shard_shapes, nccl_ring_bytes, simulate_all_gather, simulate_reduce_scatter
    from .topology import Topology
    from .workloads import layer_shapes

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


# --------------------------------------------------------------------------- rows and plots
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


def load_rows(paths: Iterable[str]) -> list[dict]:
    """Rows of JSON-lines files (blank lines skipped); each row gains ``_source`` (the file)."""
    rows = []
    for path in paths:
        with open(path) as f:
            for i, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{i} is not a JSON row ({e.msg}); pass the JSON-lines file the "
                                     "benchmark wrote with --json") from None
                row["_source"] = os.path.basename(path)
                rows.append(row)
    return rows


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise RuntimeError("plots need matplotlib, which is not installed: pip install 'tide_triton[bench]' "
                           "(or pip install matplotlib)") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _provenance(rows: Sequence[dict]) -> str:
    """One line per source: file, GPU, versions, git SHA and date (every plotted number keeps them)."""
    seen: dict[tuple, None] = {}
    for r in rows:
        nccl = r.get("nccl_runtime") or r.get("nccl")
        seen[(r.get("_source", "this run"), r.get("gpu", "?"), r.get("torch", "?"), r.get("triton", "?"),
              nccl or "n/a", r.get("git_sha", "?"), r.get("date", "?"))] = None
    return "\n".join(f"{src}: {gpu} | torch {t} | triton {tr} | NCCL {n} | git {sha} | {date}"
                     for src, gpu, t, tr, n, sha, date in seen)


_COLORS = ["tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown"]


def _finish(fig, axes_time, axes_bw, rows: Sequence[dict], path: str, title: str, models: Sequence[str],
            styles: Sequence[tuple[str, str, str]]) -> None:
    """Axes, one legend (colour = model, line style = implementation, dotted = ceiling),
    the provenance of every source in small print, and the file."""
    from matplotlib.lines import Line2D
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    for ax in list(axes_time) + list(axes_bw):
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.grid(True, which="both", alpha=0.3)
        ax.set_xlabel("world size W")
    for ax in axes_time:
        ax.set_yscale("log")
        ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 1.5, 2.0, 3.0, 5.0, 7.0)))
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.yaxis.set_minor_formatter(NullFormatter())
    handles = [Line2D([], [], color=_COLORS[i % len(_COLORS)], lw=3, label=m) for i, m in enumerate(models)]
    handles += [Line2D([], [], color="0.3", ls=ls, marker=mk, label=lab) for lab, ls, mk in styles]
    if any(line.get_linestyle() == ":" for ax in axes_bw for line in ax.get_lines()):
        handles.append(Line2D([], [], color="black", ls=":", lw=1,
                              label="device-copy ceiling (measured in the run that recorded it)"))
    fig.legend(handles=handles, loc="lower center", ncol=min(4, len(handles)), fontsize=8, frameon=False)
    prov = _provenance(rows)
    nprov = len(prov.splitlines())
    fig.suptitle(title, fontsize=11, y=0.985)
    fig.text(0.5, 0.985 - 0.03, prov, fontsize=6.5, va="top", ha="center", color="0.35", family="monospace")
    rows_legend = -(-len(handles) // 4)
    fig.tight_layout(rect=(0, 0.03 * rows_legend + 0.01, 1, 0.96 - 0.014 * nprov))
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=130)



def _curve(at, ab, pts, *, baseline: bool, color: str, label: str) -> None:
    """One implementation's points ``(W, ms, bytes)``: time on ``at``, bandwidth on ``ab``
    (dashed squares for the baseline a user would otherwise run, solid circles for tide_triton)."""
    style, marker = ("--", "s") if baseline else ("-", "o")
    xs = [p[0] for p in pts]
    at.plot(xs, [p[1] for p in pts], style, marker=marker, color=color, label=label)
    ab.plot(xs, [p[2] / (p[1] * 1e-3) / 1e9 for p in pts], style, marker=marker, color=color, label=label)

def plot_kernel_rows(rows: Sequence[dict], path: str, *, title: str | None = None) -> str:
    """Time and bandwidth against world size of ``python -m tide_triton.bench``'s JSON rows:
    one column per operation (placement, cast, accumulation), FSDP2's kernels dashed and
    tide_triton's solid, one colour per model; the device-copy ceiling of the same run as a
    horizontal line.  Host-overhead rows (no bytes) are left out.  Returns ``path``."""
    plt = _pyplot()
    ceilings = [r for r in rows if r.get("op") == "copy ceiling"]
    data = [r for r in rows if r.get("op") not in (None, "copy ceiling") and r.get("bytes", 0) > 0
            and r.get("time_ms", 0) > 0]
    if not data:
        raise ValueError("no kernel rows to plot (expected rows of python -m tide_triton.bench --json with "
                         "'op', 'impl', 'time_ms' and 'bytes')")
    ops = list(dict.fromkeys(r["op"] for r in data))
    models = list(dict.fromkeys(r["model"].split(" (")[0] for r in data))
    fig, axes = plt.subplots(2, len(ops), figsize=(4.2 * len(ops), 7.4), squeeze=False)
    for j, op in enumerate(ops):
        at, ab = axes[0][j], axes[1][j]
        at.set_title(op, fontsize=10)
        for mi, model in enumerate(models):
            for impl in dict.fromkeys(r["impl"] for r in data if r["op"] == op):
                pts = sorted((r["world_size"], r["time_ms"], r["bytes"]) for r in data
                             if r["op"] == op and r["impl"] == impl and r["model"].split(" (")[0] == model)
                if not pts:
                    continue
                _curve(at, ab, pts, baseline=impl.startswith("FSDP2"), color=_COLORS[mi % len(_COLORS)],
                       label=f"{model}: {impl}")
        at.set_ylabel("time per call (ms)")
        ab.set_ylabel("GB/s (bytes read + written / time)")
        for c in ceilings:
            ab.axhline(c["gbps"], color="black", lw=1, ls=":")
            ab.annotate(f"copy ceiling {c['gbps']:.0f} GB/s", (0.02, c["gbps"]), xycoords=("axes fraction", "data"),
                        va="bottom", fontsize=7)
        ab.set_ylim(0, max([c["gbps"] for c in ceilings] + [ab.get_ylim()[1]]) * 1.08)
    gpu = data[0].get("gpu", "?")
    _finish(fig, axes[0], axes[1], ceilings + data, path,
            title or f"Kernels: tide_triton vs FSDP2's own, one layer per call ({gpu})", models,
            [("tide_triton", "-", "o"), ("FSDP2 (torch)", "--", "s")])
    plt.close(fig)
    return path


def plot_collective_rows(rows: Sequence[dict], path: str, *, title: str | None = None) -> str:
    """Time and bandwidth against world size of the node-local collectives of one layer:
    tide_triton's rows (``bench/collectives_gpu.py --json``: ``rs_ms`` / ``ag_ms``) and, where
    the rows have them, NCCL on FSDP2's path (``bench/nccl_baseline.py --json``: ops
    ``rs32.total`` = chunk_cat + fp32 reduce_scatter_tensor, ``ag.total`` = copy-in +
    all_gather_into_tensor + copy-out).  Bandwidth charges both the bytes of
    :func:`collective_bytes`; a ``ceiling_gbps`` recorded in the rows (measured in the same
    run) is drawn as a horizontal line.  Returns ``path``."""
    from .workloads import layer_shapes

    plt = _pyplot()
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
        for mi, model in enumerate(models):
            for impl in impls:
                pts = sorted((p[3], p[4], p[5]) for p in points if p[0] == kind and p[1] == impl and p[2] == model)
                if not pts:
                    continue
                _curve(at, ab, pts, baseline=impl.startswith("NCCL"), color=_COLORS[mi % len(_COLORS)],
                       label=f"{model}: {impl}")
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
    _finish(fig, axes[0], axes[1], [p[6] for p in points], path,
            title or f"One layer's collectives against world size ({gpu}, {where})", models,
            [(impl, "--" if impl.startswith("NCCL") else "-", "s" if impl.startswith("NCCL") else "o")
             for impl in impls])
    plt.close(fig)
    return path
