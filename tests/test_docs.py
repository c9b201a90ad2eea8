"""The README and docs stay true: every link and anchor resolves, every results file they
name exists, and every ```python block of the README runs as pasted (a ``torchrun`` block
under two processes) -- on the CPU here, compiled on a GPU machine."""
from __future__ import annotations

import glob
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ["README.md", *sorted(str(Path(p).relative_to(ROOT)) for p in glob.glob(str(ROOT / "docs" / "*.md")))]


def _slug(heading: str) -> str:
    h = re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", ""))
    return h.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    return {_slug(m) for m in re.findall(r"^#+ (.*)$", text, re.M)}


@pytest.mark.parametrize("doc", DOCS)
def test_links_anchors_and_results_files_resolve(doc: str) -> None:
    f = ROOT / doc
    text = re.sub(r"```.*?```", "", f.read_text(), flags=re.S)
    bad = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"https?://", target):
            continue
        path, _, anchor = target.partition("#")
        full = (f.parent / path).resolve() if path else f
        if not full.exists():
            bad.append(f"{target}: no file {full}")
        elif anchor and anchor not in _anchors(full):
            bad.append(f"{target}: no heading #{anchor}")
    for name in re.findall(r"`((?:bench/results/|\.\.\.-)[^`*{ ]+)`", f.read_text()):
        base = name.replace("bench/results/", "").replace("...-", "2026-11-29-h200-")
        if not glob.glob(str(ROOT / "bench" / "results" / base.rstrip(".*")) + "*"):
            bad.append(f"results file {name}: none matches")
    assert not bad, bad


_BLOCKS = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)


@pytest.mark.multiproc
@pytest.mark.cpu_torch  # as pasted by a user: CPU kernels as plain torch, the default
@pytest.mark.parametrize("i", range(len(_BLOCKS)))
def test_readme_snippet_runs_as_pasted(i: int, tmp_path: Path) -> None:
    code = _BLOCKS[i]
    path = tmp_path / f"snippet{i}.py"
    path.write_text(code)
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    cmd = ([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(path)]
           if "init_process_group" in code else [sys.executable, str(path)])
    r = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, (f"README python block {i} failed:\n{code}\n--- output ---\n"
                               f"{r.stdout[-2000:]}{r.stderr[-3000:]}")
