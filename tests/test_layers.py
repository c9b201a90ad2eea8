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
    """The layers contract names the modules that once imported each other in a loop in a
    one-way order (a config that stopped listing them would keep nothing)."""
    import re

    cfg = (ROOT / ".importlinter").read_text()
    lines = cfg[cfg.index("layers =\n"):].splitlines()

    def layer(m: str) -> int:  # the index of the layer line holding module m ("a | b" lines too)
        return next(i for i, ln in enumerate(lines) if m in re.split(r"\s*\|\s*", ln.strip()))

    order = [layer(m) for m in ("collectives", "hier_collectives", "work", "group", "regions")]
    assert order == sorted(order) and len(set(order)) == len(order), order
