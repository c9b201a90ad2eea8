"""Wall time per stage of the library's host work, without a profiler's per-call overhead:
chosen functions are wrapped (inclusive ``perf_counter`` timers, nesting allowed) while a
block runs, and their totals are reported per outer call.  Used by ``bench/collectives_gpu.py
--stage-times FILE``; a cProfile (``--host-profile``) inflates Python-heavy stages ~1.3-2x
against driver calls, these timers add ~0.3 us per wrapped call.

    with StageTimes(DEFAULT_STAGES) as st:
        for _ in range(n): fn()
    print(st.table(per=n))
"""
from __future__ import annotations

import importlib
import time
from typing import Sequence

DEFAULT_STAGES: tuple[str, ...] = (
    # the prepared collectives' new-address path (FSDP2's MoE reduce-scatter every step)
    "tide_triton.executors.prepared:_Prepared._run_on",
    "tide_triton.executors.prepared:_Prepared._key",
    "tide_triton.executors.prepared:_Prepared._check",
    "tide_triton.executors.prepared:same_shapes",
    "tide_triton.executors.prepared:check_uniform",
    "tide_triton.executors.prepared:check_shapes",
    "tide_triton.runtime.checks:CheckedLists.check_bound",
    "tide_triton.runtime.checks:check_apart",
    "tide_triton.runtime.checks:check_storage",
    "tide_triton.executors.prepared:PreparedReduceScatter._bind",
    "tide_triton.executors.prepare:push_plans",
    "tide_triton.executors.prepare:prepare_planned",
    "tide_triton.executors.prepare:upload_table_pairs",
    "tide_triton.executors.prepare:prepare_padding_zeros",
    "tide_triton.kernels.segments:Binding.__post_init__",
    "tide_triton.kernels.segments:Binding.prepare",
    "tide_triton.executors.prepared:_Prepared._launch",
    "tide_triton.executors.prepared:PreparedReduceScatter._run",
    "tide_triton.executors.prepared:PreparedAllGather._run",
    "tide_triton.transport.copy_graphs:CopyGraphs.warm_replays",
    "tide_triton.transport.cuda:CudaTransport.copy_prepared",
    "tide_triton.transport.cuda:CudaTransport.signal_all",
    "tide_triton.transport.cuda:CudaTransport.wait_all_equal",
    "tide_triton.kernels.segments:Binding.launch",
    "tide_triton.executors.work:Streams.finish",
    "tide_triton.group.parts:Pacer.before",
    "tide_triton.group.parts:Pacer.after",
    "tide_triton.transport.cuda:CudaTransport.host_wait_event",
    "torch.cuda:current_stream",
)


class StageTimes:
    """Inclusive wall time and call count of each named function (``module:qualname``) while
    the block runs; names that do not resolve are listed in ``missing``."""

    def __init__(self, names: Sequence[str] = DEFAULT_STAGES) -> None:
        self.names = list(names)
        self.total = {n: 0.0 for n in self.names}
        self.calls = {n: 0 for n in self.names}
        self.missing: list[str] = []
        self._undo: list[tuple[object, str, object]] = []

    def _wrap(self, name: str, fn):
        total, calls, clock = self.total, self.calls, time.perf_counter

        def timed(*a, **k):
            t0 = clock()
            try:
                return fn(*a, **k)
            finally:
                total[name] += clock() - t0
                calls[name] += 1

        timed.__wrapped__ = fn
        return timed

    def __enter__(self) -> "StageTimes":
        for name in self.names:
            mod_name, _, qual = name.partition(":")
            try:
                owner = importlib.import_module(mod_name)
                *path, attr = qual.split(".")
                for p in path:
                    owner = getattr(owner, p)
                fn = owner.__dict__[attr] if isinstance(owner, type) else getattr(owner, attr)
            except (ImportError, AttributeError, KeyError):
                self.missing.append(name)
                continue
            if isinstance(fn, classmethod):
                self.missing.append(name)
                continue
            if isinstance(fn, staticmethod):
                wrapped = staticmethod(self._wrap(name, fn.__func__))
            else:
                wrapped = self._wrap(name, fn)
            self._undo.append((owner, attr, fn))
            setattr(owner, attr, wrapped)
        return self

    def __exit__(self, *exc) -> None:
        for owner, attr, fn in reversed(self._undo):
            setattr(owner, attr, fn)
        self._undo.clear()

    def table(self, per: int, title: str = "") -> str:
        """Per outer call (``per`` calls): us and calls of every stage that ran."""
        rows = [f"==== {title} (per call, means of {per})", "| stage | us | calls |", "|---|---|---|"]
        for n in self.names:
            if self.calls[n]:
                rows.append(f"| {n.partition(':')[2]} | {self.total[n] / per * 1e6:.1f} | "
                            f"{self.calls[n] / per:g} |")
        if self.missing:
            rows.append(f"(not found: {', '.join(self.missing)})")
        return "\n".join(rows) + "\n"
