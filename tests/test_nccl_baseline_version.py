"""bench/nccl_baseline.py names the NCCL in effect: a library given in ``LD_PRELOAD`` (how
bench/gpu_env.sh loads NCCL >= 2.30 for several ranks per GPU) wins over torch's own, which
the process maps as well.  Before, the first libnccl in /proc/self/maps was taken, torch's
2.28.9, and the script skipped every several-ranks-per-GPU row although 2.32.3 was loaded."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

FAKE = r"""
int ncclGetVersion(int* v) { *v = VERSION; return 0; }
"""

SCRIPT = r"""
import ctypes, sys
ctypes.CDLL(sys.argv[1])                   # torch's own libnccl, loaded after the preloaded one
sys.path.insert(0, "bench")
import nccl_baseline
v = nccl_baseline.nccl_versions()
print(v["libnccl_path"], v["nccl_runtime"])
"""


def test_preloaded_nccl_is_the_one_reported(tmp_path: Path) -> None:
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler to build the stand-in library")
    libs = {}
    for name, version in (("preloaded", 23203), ("torch", 22809)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "fake.c").write_text(FAKE.replace("VERSION", str(version)))
        libs[name] = tmp_path / name / "libnccl.so.2"
        subprocess.run([cc, "-shared", "-fPIC", "-o", str(libs[name]), str(tmp_path / name / "fake.c")], check=True)
    lib = libs["preloaded"]
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, LD_PRELOAD=str(lib), PYTHONPATH=f"{root}:{os.environ.get('PYTHONPATH', '')}")
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(SCRIPT), str(libs["torch"])], cwd=root, env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[-2:] == [str(lib), "2.32.3"], out.stdout + out.stderr
