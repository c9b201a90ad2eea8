"""Tables and plots of the kernel benchmarks' rows (no printing: ``python -m tide_triton.bench``
and the scripts in ``bench/`` own the console).

Tables are Markdown strings; plots are files written by matplotlib (the ``bench`` extra,
imported only when a plot is asked for).  Rows are the dictionaries the benchmarks append to
their JSON-lines files, so recorded runs can be plotted again without re-running them.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import asdict
from typing import Callable, Iterable, Sequence

from ..plan.layout import ShardLayout
from ..plan.schedule import ring_plan
from ..plan.workloads import layer_shapes

MIB = 2 ** 20


def _sig(x: float, digits: int = 3) -> str:
    """``x`` with ``digits`` significant digits (``0.000412``, ``3.12``, ``4250``)."""
    if x == 0 or not math.isfinite(x):
        return f"{x:g}"
    decimals = max(0, digits - 1 - int(math.floor(math.log10(abs(x)))))
    return f"{x:.{decimals}f}"


# --------------------------------------------------------------------------- kernel tables
def kernel_table(rows: Sequence, ceiling, *, speedups: bool = True) -> str:
    """Markdown table of :class:`~tide_triton.bench.measure.BenchRow` results.

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
    lines = ["| model | W | FSDP2 fp32 RS input / rank | tide RS staging / rank | chunks per RS |",
             "|---|---|---|---|---|"]
    for model in models:
        for W in world_sizes:
            layout = ShardLayout(layer_shapes(model), W)
            plan = ring_plan(layout, ring_bytes, 2)
            lines.append(f"| {model} | {W} | {4 * sum(layout.padded_numels) / MIB:.0f} MiB | "
                         f"{plan.staging_elems() * 2 / MIB:.1f} MiB | {plan.rounds} |")
    return "\n".join(lines)


# --------------------------------------------------------------------------- rows and plots
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


def pyplot():
    """matplotlib's pyplot on the Agg backend; matplotlib is the optional ``bench`` extra,
    imported only when a plot is asked for."""
    try:  # matplotlib is optional (the bench extra): imported only when a plot is asked for
        import matplotlib
    except ImportError:
        raise RuntimeError("plots need matplotlib, which is not installed: pip install 'tide_triton[bench]' "
                           "(or pip install matplotlib)") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # after use("Agg"): pyplot picks its backend at import

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


COLORS = ["tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown"]


def finish_plot(fig, axes_time, axes_bw, rows: Sequence[dict], path: str, title: str, models: Sequence[str],
            styles: Sequence[tuple[str, str, str]]) -> None:
    """Axes, one legend (colour = model, line style = implementation, dotted = ceiling),
    the provenance of every source in small print, and the file."""
    # matplotlib is optional (the bench extra): imported only when a plot is drawn
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
    handles = [Line2D([], [], color=COLORS[i % len(COLORS)], lw=3, label=m) for i, m in enumerate(models)]
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



def curve(at, ab, pts, *, baseline: bool, color: str, label: str) -> None:
    """One implementation's points ``(W, ms, bytes)``: time on ``at``, bandwidth on ``ab``
    (dashed squares for the baseline a user would otherwise run, solid circles for tide_triton)."""
    style, marker = ("--", "s") if baseline else ("-", "o")
    xs = [p[0] for p in pts]
    at.plot(xs, [p[1] for p in pts], style, marker=marker, color=color, label=label)
    ab.plot(xs, [p[2] / (p[1] * 1e-3) / 1e9 for p in pts], style, marker=marker, color=color, label=label)

def curves(at, ab, models: Sequence[str], impls: Iterable[str], baseline: str,
           points: Callable[[str, str], list]) -> None:
    """:func:`curve` of every (model, implementation) with points (``points(model, impl)``):
    one colour per model, the implementations whose names start with ``baseline`` dashed."""
    impls = list(impls)
    for mi, model in enumerate(models):
        for impl in impls:
            pts = points(model, impl)
            if pts:
                curve(at, ab, pts, baseline=impl.startswith(baseline), color=COLORS[mi % len(COLORS)],
                      label=f"{model}: {impl}")


def plot_kernel_rows(rows: Sequence[dict], path: str, *, title: str | None = None) -> str:
    """Time and bandwidth against world size of ``python -m tide_triton.bench``'s JSON rows:
    one column per operation (placement, cast, accumulation), FSDP2's kernels dashed and
    tide_triton's solid, one colour per model; the device-copy ceiling of the same run as a
    horizontal line.  Host-overhead rows (no bytes) are left out.  Returns ``path``."""
    plt = pyplot()
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
        curves(at, ab, models, dict.fromkeys(r["impl"] for r in data if r["op"] == op), "FSDP2",
               lambda model, impl, op=op: sorted(
                   (r["world_size"], r["time_ms"], r["bytes"]) for r in data
                   if r["op"] == op and r["impl"] == impl and r["model"].split(" (")[0] == model))
        at.set_ylabel("time per call (ms)")
        ab.set_ylabel("GB/s (bytes read + written / time)")
        for c in ceilings:
            ab.axhline(c["gbps"], color="black", lw=1, ls=":")
            ab.annotate(f"copy ceiling {c['gbps']:.0f} GB/s", (0.02, c["gbps"]), xycoords=("axes fraction", "data"),
                        va="bottom", fontsize=7)
        ab.set_ylim(0, max([c["gbps"] for c in ceilings] + [ab.get_ylim()[1]]) * 1.08)
    gpu = data[0].get("gpu", "?")
    finish_plot(fig, axes[0], axes[1], ceilings + data, path,
            title or f"Kernels: tide_triton vs FSDP2's own, one layer per call ({gpu})", models,
            [("tide_triton", "-", "o"), ("FSDP2 (torch)", "--", "s")])
    plt.close(fig)
    return path


