"""torchtitan's own trainer, stock FSDP2 against the drop-in (``bench/torchtitan_cpu.py``): runs
where torchtitan is installed (``pip install torchtitan==0.3.0`` beside the tested torch), skips
elsewhere.  Every FSDP module served, losses and grad norms bit for bit equal to stock's."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "torchtitan_cpu.py"

pytestmark = [
    pytest.mark.multiproc,
    pytest.mark.skipif(importlib.util.find_spec("torchtitan") is None, reason="torchtitan is not installed"),
    pytest.mark.skipif(torch.cuda.is_available(), reason="the script runs torchtitan on the CPU (gloo)"),
]


def _train(tmp_path: Path, nproc: int, tide: bool, args: list[str]) -> dict:
    out = tmp_path / f"{'tide' if tide else 'stock'}.json"
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           str(SCRIPT), *args, "--out", str(out)] + (["--tide"] if tide else [])
    res = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=1200)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-6000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize("nproc, args", [
    (2, ["--model", "llama3", "--backend", "full_dtensor"]),  # DTensor parameters, 1-D FSDP
    (2, ["--model", "qwen3", "--backend", "full_dtensor", "--experts", "1"]),  # experts on Shard(1)
], ids=["llama3-fsdp", "qwen3-shard1"])
def test_torchtitan_trains_equal_to_stock_with_every_module_served(tmp_path: Path, nproc: int,
                                                                    args: list[str]) -> None:
    args = [*args, "--steps", "2", "--seq-len", "64"]
    stock = _train(tmp_path, nproc, False, args)
    tide = _train(tmp_path, nproc, True, args)
    assert tide["enable"] and all(why is None for why in tide["enable"].values()), tide["enable"]
    assert [(s["loss"], s["grad_norm"]) for s in tide["steps"]] == \
        [(s["loss"], s["grad_norm"]) for s in stock["steps"]], (stock["steps"], tide["steps"])
