"""``python -m tide_triton.bench``: the README's main job as written, and the device it picks.

The README's command 1 runs the kernel benchmarks on the GPU when there is one and a smoke run
through the Triton interpreter otherwise; the same test runs it on both kinds of machine.
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tide_triton.bench.cli import require_device

ROOT = Path(__file__).resolve().parent.parent


def _readme_command_1() -> str:
    """The main job of the README's "Two commands" block: what follows the install's ``&&``."""
    text = (ROOT / "README.md").read_text()
    block = re.search(r"```bash\n(.*?)```", text[text.index("## Two commands"):], re.S)
    assert block is not None, "README.md: no bash block under '## Two commands'"
    line = next(ln for ln in block.group(1).splitlines() if ln.startswith("pip install"))
    return line.split("&&", 1)[1].strip()


def test_readme_command_1_runs_the_main_job_on_this_machine() -> None:
    cmd = _readme_command_1()
    assert cmd == "python -m tide_triton.bench", cmd
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)  # as a user's shell runs it: the package decides
    proc = subprocess.run([sys.executable, *cmd.split()[1:]], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=1800)
    assert proc.returncode == 0, f"{cmd} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    assert "tide_triton kernel benchmarks on" in proc.stdout and "device-copy ceiling:" in proc.stdout, proc.stdout
    if torch.cuda.is_available():
        assert re.search(r"\(cuda:\d+\)", proc.stdout), proc.stdout[:2000]
    else:
        assert "through the Triton interpreter" in proc.stdout, proc.stdout[:2000]


class _FakeCuda:
    """Two visible GPUs, the current one 1: what ``torch.cuda`` reports on a GPU machine."""

    @staticmethod
    def install(monkeypatch: pytest.MonkeyPatch, current: int = 1, count: int = 2) -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: current)


@pytest.mark.parametrize("value", [None, "cuda"])
def test_a_cuda_device_without_an_index_is_the_current_device(monkeypatch: pytest.MonkeyPatch, value) -> None:
    _FakeCuda.install(monkeypatch)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert require_device(argparse.ArgumentParser(), "--device", value) == torch.device("cuda", 1)


def test_a_cuda_device_without_an_index_is_the_local_ranks_under_torchrun(monkeypatch: pytest.MonkeyPatch) -> None:
    _FakeCuda.install(monkeypatch)
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert require_device(argparse.ArgumentParser(), "--device", "cuda") == torch.device("cuda", 1)  # 3 % 2
    monkeypatch.setenv("LOCAL_RANK", "2")
    assert require_device(argparse.ArgumentParser(), "--device", None) == torch.device("cuda", 0)


def test_a_device_with_an_index_or_the_cpu_is_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    _FakeCuda.install(monkeypatch)
    ap = argparse.ArgumentParser()
    assert require_device(ap, "--device", "cuda:0") == torch.device("cuda", 0)
    assert require_device(ap, "--device", "cpu") == torch.device("cpu")
    with pytest.raises(SystemExit):
        require_device(ap, "--device", "cuda:5")  # only 2 visible: a parser error naming the option
