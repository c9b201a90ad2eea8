"""Shared test setup: where the Triton kernels run, the ``device`` fixture, exact-value
tensors and the real model layouts (scaled down for the interpreter).

On CPU tensors the package runs each kernel launch as plain torch by default
(``TIDE_TRITON_CPU_KERNELS=torch``).  The suite runs the Triton kernels themselves wherever
it can: without a CUDA device through Triton's CPU interpreter, so ``TRITON_INTERPRET=1`` is
set here, at conftest import, before any test module imports the package (Triton 3.6 reads it
when ``@triton.jit`` decorates a kernel), and CPU launches default to ``interpret``; on a GPU
machine (compiled Triton, which cannot take CPU tensors) the CPU tests run plain torch.  Tests
marked ``cpu_torch`` -- the FSDP2 end-to-end runs and the examples, whose subject is the
drop-in, not the kernels -- run the product's default, plain torch, in this process and in
their spawned ranks.  Values the user set are kept: ``TIDE_TRITON_CPU_KERNELS=torch`` runs
every CPU test on the torch path.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Iterator, Sequence

# The single-process multi-rank tests drive several ranks' streams from one process: they
# must not share hardware queues (tide_triton.group.single_process.hardware_queues; 2W+2 for W <= 7).
# Read when CUDA initialises, so set before torch is imported.  Not 32: each queue costs the
# GPU's context capacity (H200: 62 contexts at 8, 9 at 32; docs/constraints.md), and the
# tests' spawned ranks (one each, _dist.run_multiprocess: 8) share the GPU with the workers.
os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "16")
# Eager module loading for the same tests: a kernel's first lazy load synchronizes the context,
# which deadlocks ranks of one process waiting on each other's streams (tide_triton.
# single_process._lazy_loading_problem; docs/constraints.md#lazy-module-loading).  The tests' spawned ranks
# keep lazy loading (one rank per process: cheaper contexts; _dist.run_multiprocess).
os.environ.setdefault("CUDA_MODULE_LOADING", "EAGER")

import pytest  # noqa: E402
import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
CPU_KERNELS = "TIDE_TRITON_CPU_KERNELS"  # tide_triton.runtime.envs.CPU_KERNELS (not imported before the above)

HAS_CUDA = torch.cuda.is_available()

__all__ = [
    "HAS_CUDA",
    "N_GPUS",
    "interpreting",
    "int_tensor",
    "scaled_shape",
    "workload_shapes",
    "workload_layouts",
    "WORKLOADS",
]


def interpreting() -> bool:
    """True when the kernels run through Triton's interpreter (same rule as the package)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


# CPU tensors' kernels: through the interpreter where it runs, else (compiled Triton, a GPU
# machine) as plain torch, so the CPU tests run on both kinds of machine.
os.environ.setdefault(CPU_KERNELS, "interpret" if interpreting() else "torch")


# ---------------------------------------------------------------------------------------
# Markers and the device fixture
# ---------------------------------------------------------------------------------------
def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--share-gpu", action="store_true", default=False,
                     help="put every rank of the CUDA tests on cuda:0 (default: rank r on "
                          "cuda:(r % device_count), the torchrun convention)")


def pytest_configure(config: pytest.Config) -> None:
    for line in (
        "gpu: needs a CUDA device (skipped without one)",
        "multi_gpu: needs two or more CUDA devices (skipped with fewer)",
        "interpreter: launches Triton kernels on CPU tensors in this process: needs "
        "TRITON_INTERPRET=1 (skipped when compiled Triton runs, i.e. on a GPU machine "
        "without it)",
        "multiproc: spawns several processes",
        "cpu_torch: kernels on CPU tensors run as plain torch (TIDE_TRITON_CPU_KERNELS=torch), in "
        "this process and its spawned ranks, instead of the suite's default, Triton's interpreter",
    ):
        config.addinivalue_line("markers", line)
    if config.getoption("--share-gpu", default=False):
        os.environ["TIDE_TESTS_SHARE_GPU"] = "1"
    # Triton 3.6's interpreter turns 1-element arrays into ints the way numpy >= 1.25
    # deprecates, once per loop bound: thousands of lines of someone else's warning.
    config.addinivalue_line(
        "filterwarnings",
        "ignore:Conversion of an array with ndim > 0 to a scalar:DeprecationWarning:triton",
    )


N_GPUS = torch.cuda.device_count() if HAS_CUDA else 0


def _numpy_version() -> tuple[int, int]:
    import numpy

    return tuple(int(x) for x in numpy.__version__.split(".")[:2])  # type: ignore[return-value]


INTERPRETER_WORKS = _numpy_version() < (2, 4)
"""Triton 3.6's interpreter converts 1-element arrays to ints, which numpy >= 2.4 refuses:
the CPU tests' spawned ranks can run the kernels through it only with an older numpy (the
CPU pins; a GPU machine's image may carry a newer one)."""
_NUMPY_REASON = (f"spawns CPU ranks that run the kernels through Triton 3.6's interpreter, which needs "
                 f"numpy < 2.4 (numpy {'.'.join(map(str, _numpy_version()))} here); the same test runs on "
                 "the CPU pins")

_NEEDS_INTERPRETER = "(or the CPU under TRITON_INTERPRET=1), got cpu"
"""The kernels' error for CPU tensors under compiled Triton (kernels/segments.py)."""
_INTERPRETER_REASON = ("launches Triton kernels on CPU tensors in this process: needs the interpreter "
                       "(TRITON_INTERPRET=1); compiled Triton runs here because a GPU is present")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """One command for every machine: ``gpu`` tests skip without a GPU, ``multi_gpu`` tests
    with fewer than two, ``interpreter`` tests when the kernels are compiled."""
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    skip_multi = pytest.mark.skip(reason=f"needs >= 2 CUDA devices, {N_GPUS} visible")
    skip_interp = pytest.mark.skip(reason=_INTERPRETER_REASON)
    for item in items:
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(skip_gpu)
        if "multi_gpu" in item.keywords and N_GPUS < 2:
            item.add_marker(skip_multi)
        if "interpreter" in item.keywords and not interpreting():
            item.add_marker(skip_interp)


# ---------------------------------------------------------------------------------------
# Reports for bounded runs (bench/gpu_tests.sh): a run stopped at its time limit never
# reaches pytest's summary, so failures are written as they happen, and a test still running
# after N seconds leaves the stacks of all its threads.
#   TIDE_TRITON_TEST_FAILURES=FILE        every failed phase: node id, phase, duration, report
#   TIDE_TRITON_TEST_STACKS=PREFIX:SECONDS  PREFIX.<xdist worker>: the threads' stacks of a test
#                                         still running after SECONDS (faulthandler)
# ---------------------------------------------------------------------------------------
def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    path = os.environ.get("TIDE_TRITON_TEST_FAILURES")
    # Written once, where the test ran: under xdist the controller's copy is forwarded
    # (it carries ``node``) and skipped.
    if path and report.failed and getattr(report, "node", None) is None:
        text = report.longreprtext
        with open(path, "a") as f:
            f.write(f"==== FAILED {report.nodeid} ({report.when}, {report.duration:.1f} s)\n{text}\n\n")
            if "out of memory" in text:
                f.write(_gpu_memory_owners() + "\n\n")


def _gpu_memory_owners() -> str:
    """Who held the GPUs' memory when a test ran out of it: every compute process (as
    nvidia-smi lists them) with its memory and the test that started it (its inherited
    ``PYTEST_CURRENT_TEST``), where this process can read that."""
    import subprocess

    lines = ["---- GPU memory at the failure"]
    try:
        lines.append(subprocess.run(["nvidia-smi", "--query-gpu=index,memory.used,memory.total",
                                     "--format=csv,noheader"], capture_output=True, text=True,
                                    timeout=30).stdout.strip())
        apps = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,gpu_bus_id,used_memory",
                               "--format=csv,noheader"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as e:
        return f"---- GPU memory at the failure: nvidia-smi failed ({e})"
    for row in apps.strip().splitlines():
        pid = row.split(",")[0].strip()
        owner = "?"
        try:
            with open(f"/proc/{pid}/environ", "rb") as env:
                for kv in env.read().split(b"\0"):
                    if kv.startswith(b"PYTEST_CURRENT_TEST="):
                        owner = kv.split(b"=", 1)[1].decode(errors="replace")
        except OSError:
            pass
        lines.append(f"{row} | {owner}")
    return "\n".join(lines)


@pytest.fixture(autouse=True)
def _return_cached_gpu_memory(request: pytest.FixtureRequest) -> Iterator[None]:
    """A GPU test's tensors go back to the device when it ends: torch's caching allocator
    would otherwise keep them reserved for the rest of the (xdist worker) process, and the
    GPU's other tests' processes could not create a context (seen on two H200s: a worker
    keeping a real Llama layer's round trip, ~12 GB, while 8-process tests started)."""
    yield
    if "gpu" in request.node.keywords and HAS_CUDA and torch.cuda.is_initialized():
        import gc

        gc.collect()
        torch.cuda.empty_cache()


@pytest.fixture(autouse=True)
def _stacks_of_a_stuck_test(request: pytest.FixtureRequest) -> Iterator[None]:
    spec = os.environ.get("TIDE_TRITON_TEST_STACKS")
    if not spec:
        yield
        return
    import faulthandler
    import time

    prefix, _, seconds = spec.rpartition(":")
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    with open(f"{prefix}.{worker}", "a") as f:
        f.write(f"==== {time.strftime('%H:%M:%S')} {request.node.nodeid}\n")
        f.flush()
        faulthandler.dump_traceback_later(float(seconds), file=f)
        try:
            yield
        finally:
            faulthandler.cancel_dump_traceback_later()


@pytest.fixture(autouse=True)
def _children_interpret(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A CPU test's spawned ranks run the kernels as this test asks: through the interpreter
    (the suite's default), also where this process runs compiled Triton (a GPU machine) --
    they are fresh processes, so the CPU tests of the multi-process kind run on every machine
    -- or, marked ``cpu_torch``, as plain torch (here and in the children).  GPU tests'
    children inherit."""
    try:
        import _dist
    except ImportError:  # pragma: no cover
        from tests import _dist
    cpu_test = "gpu" not in request.node.keywords
    torch_path = "cpu_torch" in request.node.keywords
    saved = dict(_dist.CHILD_ENV)
    if torch_path:
        monkeypatch.setenv(CPU_KERNELS, "torch")
        _dist.CHILD_ENV[CPU_KERNELS] = "torch"
    elif (cpu_test and "multiproc" in request.node.keywords and not interpreting() and not INTERPRETER_WORKS
          and os.environ.get(CPU_KERNELS) == "interpret"):
        pytest.skip(_NUMPY_REASON)
    if cpu_test and not torch_path:
        _dist.CHILD_ENV["TRITON_INTERPRET"] = "1"
        _dist.CHILD_ENV[CPU_KERNELS] = os.environ.get(CPU_KERNELS, "interpret")
    try:
        yield
    finally:
        _dist.CHILD_ENV.clear()
        _dist.CHILD_ENV.update(saved)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Iterator[None]:
    """Without the interpreter, a CPU test (not marked ``gpu``) that launches kernels on CPU
    tensors in this process selects itself out: the kernels' own error for exactly that
    case becomes a skip naming the reason.  The same test runs, and can fail, on every
    machine where the interpreter is on (CPU CI, or ``TRITON_INTERPRET=1`` on a GPU)."""
    outcome = yield
    rep = outcome.get_result()
    if (rep.failed and call.excinfo is not None and not interpreting()
            and "gpu" not in item.keywords and _NEEDS_INTERPRETER in str(call.excinfo.value)):
        rep.outcome = "skipped"
        rep.longrepr = (str(item.path), item.location[1] or 0, f"Skipped: {_INTERPRETER_REASON}")


_DEVICES = [
    pytest.param("cpu", id="cpu"),
    pytest.param("cpu_torch", id="cpu_torch"),
    pytest.param("cuda", id="cuda", marks=pytest.mark.gpu),
]


@pytest.fixture(params=_DEVICES)
def device(request: pytest.FixtureRequest) -> torch.device:
    """Where the kernels' tensors live: "cpu" runs the Triton kernels through the interpreter
    (compiled Triton cannot take CPU tensors), "cpu_torch" the same CPU tensors on the plain-torch
    path (``TIDE_TRITON_CPU_KERNELS=torch``, every machine), "cuda" whenever a GPU is there
    (skipped otherwise)."""
    name = request.param
    if name == "cpu" and not interpreting():
        pytest.skip("CPU tensors need the Triton interpreter (TRITON_INTERPRET=1)")
    if name == "cuda" and not HAS_CUDA:
        pytest.skip("needs a CUDA device")
    if name == "cpu":
        request.getfixturevalue("monkeypatch").setenv(CPU_KERNELS, "interpret")
    if name == "cpu_torch":
        request.getfixturevalue("monkeypatch").setenv(CPU_KERNELS, "torch")
        return torch.device("cpu")
    return torch.device(name)


# ---------------------------------------------------------------------------------------
# Exact-value tensors
# ---------------------------------------------------------------------------------------
def int_tensor(
    shape: Sequence[int],
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    *,
    generator: torch.Generator | None = None,
    low: int = -8,
    high: int = 9,
) -> torch.Tensor:
    """Integer values in ``[low, high)`` stored as ``dtype``: every sum of a few of them
    (times 0.5 or 2) is exact in bf16/fp16/fp32, so reductions are bit-checkable.  With a
    CPU ``generator`` they are drawn on the CPU and moved, so a seed gives the same values
    on every device; without one they are drawn on ``device``."""
    if generator is None:  # large real-workload tensors: draw where they live
        return torch.randint(low, high, tuple(shape), device=device).to(dtype)
    t = torch.randint(low, high, tuple(shape), generator=generator, dtype=torch.int64)
    return t.to(dtype).to(device)


# ---------------------------------------------------------------------------------------
# Real model layouts
# ---------------------------------------------------------------------------------------
_WORKLOADS_JSON = Path(__file__).resolve().parent.parent / "tide_triton" / "workloads.json"
WORKLOADS = ("llama-3.1-70b", "qwen3-30b-a3b", "wan2.2-14b")

# Interpreter-sized: 512 shrinks Llama's 28672 x 8192 MLP to 56 x 16 and keeps a layer a few
# thousand elements (~0.5 s a launch at W=8); Wan's [1, 6, 5120] modulation becomes
# [1, 1, 10], still 3-D with dim 0 = 1 < W.
CPU_SCALE = 512


def scaled_shape(shape: Sequence[int], factor: int) -> tuple[int, ...]:
    """Every dim divided by ``factor``, at least 1: same rank, dim 0 of 1 stays 1."""
    return tuple(max(1, int(d) // factor) for d in shape)


def workload_shapes(
    model: str, *, factor: int | None = None, max_params: int | None = None
) -> list[tuple[int, ...]]:
    """One layer's parameter shapes of ``model`` (a key of tide_triton/workloads.json).

    ``factor=None`` picks the real shapes on a compiled-Triton run and ``CPU_SCALE`` under
    the interpreter; ``max_params`` keeps the first parameters only (Qwen3's layer has 393,
    one interpreter launch per tile makes that slow on CPU)."""
    data = json.loads(_WORKLOADS_JSON.read_text())
    if model not in WORKLOADS:
        raise ValueError(f"model must be one of {WORKLOADS}, got {model!r}")
    if factor is None:
        factor = CPU_SCALE if interpreting() else 1
    shapes = [scaled_shape(s, factor) for _, s in data[model]["params"]]
    return shapes[:max_params] if max_params is not None else shapes


def workload_layouts(
    world_size: int, *, factor: int | None = None, max_params: int | None = None
) -> dict:
    """``{model: ShardLayout}`` for every model of workloads.json at ``world_size``."""
    from tide_triton.plan.layout import ShardLayout  # after TRITON_INTERPRET is settled

    return {
        m: ShardLayout(workload_shapes(m, factor=factor, max_params=max_params), world_size)
        for m in WORKLOADS
    }
