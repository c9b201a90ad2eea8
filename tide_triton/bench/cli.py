"""Console helpers for the command-line entry points (``python -m tide_triton.bench`` and the
scripts of ``bench/``); library code never imports this module.

Progress goes to stderr, so that stdout holds only the tables: a live bar (``tqdm``, from the
``bench`` extra) when stderr is a terminal and tqdm is installed, otherwise one plain line per
step with the time since the start.
"""
from __future__ import annotations

import os
import sys
import time

import torch

from .report import load_rows

class Progress:
    """``with Progress(total, "kernels") as p: ... p.step("llama W=8 placement")``.

    ``step(what)`` announces the piece of work about to start (the bar's description, or a
    plain line ``[  3/12  4.1 s] what``) and counts the previous one as done."""

    def __init__(self, total: int | None, desc: str, *, stream=None, force_plain: bool = False) -> None:
        self.total, self.desc = total, desc
        self.stream = stream if stream is not None else sys.stderr
        self.t0 = time.perf_counter()
        self.n = 0
        self._bar = None
        if not force_plain and getattr(self.stream, "isatty", lambda: False)():
            try:
                from tqdm import tqdm  # the optional bench extra
            except ImportError:
                tqdm = None
            if tqdm is not None:
                self._bar = tqdm(total=total, desc=desc, file=self.stream, leave=False, dynamic_ncols=True,
                                 bar_format="{desc}: {n_fmt}/{total_fmt} [{elapsed}] {postfix}")

    def step(self, what: str) -> None:
        if self._bar is not None:
            if self.n:
                self._bar.update(1)
            self._bar.set_postfix_str(what)
        else:
            of = f"/{self.total}" if self.total else ""
            print(f"[{self.desc} {self.n + 1}{of} {time.perf_counter() - self.t0:6.1f} s] {what}",
                  file=self.stream, flush=True)
        self.n += 1

    def close(self) -> None:
        if self._bar is not None:
            if self.n:
                self._bar.update(1)
            self._bar.close()
            self._bar = None

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def require_device(parser, option: str, value: str | None):
    """``torch.device`` for ``--device`` (``None``: CUDA if present, else CPU), with its index
    (:func:`with_index`); a missing GPU or an unknown name ends in ``parser.error`` naming the
    option and how to fix it."""
    if value is None:
        return with_index(torch.device("cuda")) if torch.cuda.is_available() else torch.device("cpu")
    try:
        dev = torch.device(value)
    except RuntimeError:
        parser.error(f"{option}: unknown device {value!r}; use cpu, cuda or cuda:N")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            parser.error(f"{option} {value}: no CUDA device is visible to torch (torch {torch.__version__}, "
                         f"CUDA build: {torch.version.cuda or 'none'}); run with {option} cpu, or on a machine "
                         "with a GPU and a CUDA build of torch")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            parser.error(f"{option} {value}: only {torch.cuda.device_count()} CUDA device(s) visible")
    elif dev.type != "cpu":
        parser.error(f"{option}: expected cpu or cuda[:N], got {value!r}")
    return with_index(dev)


def with_index(device):
    """``device`` with its index: ``cuda`` without one means this process's GPU --
    ``cuda:LOCAL_RANK`` (modulo the visible GPUs) under torchrun, else the current device --
    because ``torch.cuda.set_device`` and the timing events refuse a device without an index."""
    if device.type != "cuda" or device.index is not None:
        return device
    local = os.environ.get("LOCAL_RANK")
    if local is not None and local.strip().isdigit():
        return torch.device("cuda", int(local) % torch.cuda.device_count())
    return torch.device("cuda", torch.cuda.current_device())


def recorded_rows(parser, from_rows, plot):
    """The rows of ``--from ROWS.jsonl ...`` (which only goes with ``--plot FILE``), or a
    parser error saying what is wrong."""
    if not plot:
        parser.error("--from needs --plot FILE (it plots recorded rows without running anything)")
    try:
        return load_rows(from_rows)
    except (OSError, ValueError) as e:
        parser.error(f"--from: {e}")


def plot_or_exit(parser, path: str, plot, rows: list[dict]) -> None:
    """``plot(rows, path)`` for ``--plot PATH``, saying where it went; a plot that cannot be
    made (no matplotlib, no rows to plot) ends in the parser's exit status 2 naming why."""
    try:
        plot(rows, path)
    except (RuntimeError, ValueError) as e:
        parser.exit(2, f"{parser.prog}: error: --plot {path}: {e}\n")
    print(f"plot written to {path}")
