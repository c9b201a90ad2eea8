"""The package's layers are code: ``lint-imports`` checks the contracts in ``.importlinter``
(DESIGN.md section 2), so a new import cycle or an import reaching up a layer fails the suite."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _lint_imports() -> list[str]:
    exe = shutil.which("lint-imports") or str(Path(sys.executable).with_name("lint-imports"))
    if not Path(exe).exists():
        pytest.skip("import-linter is not installed (pip install -e '.[test]')")
    return [exe, "--config", str(ROOT / ".importlinter"), "--no-cache"]


def test_import_contracts_are_kept() -> None:
    # Run from the repository root with it first on the path: the checked package is this
    # checkout's tide_triton, not another installed copy.
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    r = subprocess.run(_lint_imports(), cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert "0 broken" in r.stdout, r.stdout[-2000:]


def test_contracts_forbid_the_former_cycle() -> None:
    """The layers contracts name the modules that once imported each other in a loop in a
    one-way order (a config that stopped listing them would keep nothing): the API over the
    executors over the group (folders), the across-nodes executor over the shared executor
    parts, Group over its named heap regions."""
    import re

    cfg = (ROOT / ".importlinter").read_text()

    def layers_of(container: str) -> list[str]:
        block = cfg[cfg.index(f"containers =\n    {container}\n"):]
        block = block[block.index("layers =\n") + len("layers =\n"):]
        lines = block.splitlines()
        end = next(i for i, ln in enumerate(lines) if not ln.startswith("    "))
        return [ln.strip() for ln in lines[:end]]

    def order(container: str, *names: str) -> list[int]:
        lines = layers_of(container)
        return [next(i for i, ln in enumerate(lines) if m in re.split(r"\s*\|\s*", ln)) for m in names]

    for container, names in (("tide_triton", ("collectives", "executors", "group")),
                             ("tide_triton.executors", ("across_nodes", "work")),
                             ("tide_triton.group", ("core", "regions"))):
        got = order(container, *names)
        assert got == sorted(got) and len(set(got)) == len(got), (container, names, got)
