"""How kernel launches on CPU tensors run: plain torch by default, Triton's interpreter on
request (``TIDE_TRITON_CPU_KERNELS``), with the same bits either way.

The kernels' own suite (tests/test_kernels.py) runs every case on both CPU paths (the
``device`` fixture's ``cpu`` and ``cpu_torch``) against the ``*_ref`` functions; here the two
paths are compared with each other on values where the order and the rounding of the
arithmetic show (random fp32 values, 1/3 scales, ties of the bf16 rounding, NaN, infinities,
-0.0, denormals), the switch is checked, and what ``import tide_triton`` sets.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tide_triton import ShardLayout, accumulate_shards, pack_shards, place_shards
from tide_triton.kernels import segments

ROOT = Path(__file__).resolve().parents[1]
BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
PAIRS = [(BF16, FP32), (FP32, BF16), (BF16, BF16), (FP32, FP32), (FP16, FP32), (FP32, FP16), (FP16, BF16)]
LAYOUT = ShardLayout([(13, 4), (7,), (1, 2, 4), (30, 3)], 3)


def _specials(n: int, g: torch.Generator) -> torch.Tensor:
    """``n`` fp32 values: random magnitudes, bf16 rounding ties (low half 0x8000, even and odd
    kept bits), NaN, +-inf, -0.0, fp32 and bf16-range denormals."""
    x = torch.randn(n, generator=g) * torch.exp2(torch.randint(-20, 20, (n,), generator=g).float())
    bits = x.view(torch.int32)
    ties = (bits & ~0xFFFF) | 0x8000
    x = torch.where(torch.arange(n) % 5 == 1, ties.view(FP32), x)
    special = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, 1e-40, -3e-39, 2.0 ** -133])
    x[: min(n, len(special))] = special[: min(n, len(special))]
    return x


def _cases(mode: str, monkeypatch: pytest.MonkeyPatch) -> list[torch.Tensor]:
    """Every launcher's results on one fixed set of inputs, run on the ``mode`` path."""
    monkeypatch.setenv("TIDE_TRITON_CPU_KERNELS", mode)
    out: list[torch.Tensor] = []
    for sdt, ddt in PAIRS:
        g = torch.Generator().manual_seed(7)
        srcs = [_specials(LAYOUT.flat_shard_numel, g).to(sdt) for _ in range(3)]
        params = [torch.full(s, -77.0, dtype=ddt) for s in LAYOUT.shapes]
        place_shards(srcs, params, LAYOUT)
        out += params
        for scale, acc in ((None, False), (1 / 3, True), (0.1, False)):
            shards = [_specials(torch.Size(s).numel(), g).reshape(s).to(ddt)
                      for s in LAYOUT.shard_shapes(1, padded=True)]
            accumulate_shards(srcs, shards, LAYOUT, 1, scale=scale, accumulate=acc)
            out += shards
        grads = [_specials(torch.Size(s).numel(), g).reshape(s).to(sdt) for s in LAYOUT.shapes]
        buf = torch.full((2 * LAYOUT.flat_shard_numel,), -77.0, dtype=ddt)
        pack_shards(grads, buf, LAYOUT, [2, 0])
        out.append(buf)
    return out


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The values' bits, every NaN as one NaN: which NaN an fp32 sum of NaNs gives is the
    hardware's choice (numpy under the interpreter, torch on the CPU, the GPU each pick their
    own payload and sign); NaN stays NaN on every path."""
    t = t.contiguous().view(-1)
    t = torch.where(t.isnan(), torch.full_like(t, float("nan")), t)
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


@pytest.mark.interpreter
def test_torch_path_equals_the_interpreted_kernels_bit_for_bit(monkeypatch: pytest.MonkeyPatch) -> None:
    got = _cases("torch", monkeypatch)
    want = _cases("interpret", monkeypatch)
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want)):
        assert a.dtype == b.dtype and a.shape == b.shape
        bad = (_bits(a) != _bits(b)).nonzero().view(-1)[:4].tolist()
        assert not bad, f"result {i} ({a.dtype}) at {bad}: torch {a.view(-1)[bad]} vs kernel {b.view(-1)[bad]}"


class _Recorder:
    """Stands in for the Triton kernel: counts the launches that reach it."""

    def __init__(self) -> None:
        self.launches = 0

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launches += 1
        return launch


def _place_once() -> list[torch.Tensor]:
    layout = ShardLayout([(5, 2)], 2)
    srcs = [torch.arange(layout.flat_shard_numel, dtype=FP32) + 10 * r for r in range(2)]
    params = [torch.zeros(5, 2)]
    place_shards(srcs, params, layout)
    return params


def test_cpu_launches_run_as_torch_by_default_without_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    rec = _Recorder()
    monkeypatch.setattr(segments, "segmented_reduce_kernel", rec)
    monkeypatch.delenv("TIDE_TRITON_CPU_KERNELS", raising=False)
    monkeypatch.setattr(segments, "interpreting", lambda: False)  # Triton compiled: no interpreter needed
    params = _place_once()
    assert rec.launches == 0
    assert params[0].view(-1).tolist() == [0, 1, 2, 3, 4, 5, 10, 11, 12, 13]


@pytest.mark.interpreter
def test_interpret_switch_launches_the_triton_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    rec = _Recorder()
    monkeypatch.setattr(segments, "segmented_reduce_kernel", rec)
    monkeypatch.setenv("TIDE_TRITON_CPU_KERNELS", "interpret")
    _place_once()
    assert rec.launches == 1


def test_interpret_switch_without_the_interpreter_names_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TIDE_TRITON_CPU_KERNELS", "interpret")
    monkeypatch.setattr(segments, "interpreting", lambda: False)  # Triton compiled, as on a GPU machine
    with pytest.raises(ValueError, match=r"params: \$TIDE_TRITON_CPU_KERNELS=interpret .* \(set TRITON_INTERPRET=1 "
                                         r"before tide_triton is imported, or unset \$TIDE_TRITON_CPU_KERNELS"):
        _place_once()


def test_unknown_cpu_kernels_value_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TIDE_TRITON_CPU_KERNELS", "fast")
    with pytest.raises(ValueError, match=r"\$TIDE_TRITON_CPU_KERNELS must be one of \('torch', 'interpret'\), "
                                         r"got 'fast'; unset it for 'torch'"):
        _place_once()


def test_torch_plan_merges_continuing_runs_into_one_op() -> None:
    from tide_triton.kernels.segments import SegmentProgram, Span

    prog = SegmentProgram((Span(0, 0, 0, 4, 3), Span(0, 3, 0, 7, 2), Span(0, 9, 0, 9, 1), Span(1, 0, 0, 0, 0),
                           Span(1, 2, 1, 0, 5)), n_dst=2, n_src=2)
    plan = prog.torch_plan()
    assert plan.runs == ((0, 0, 0, 4, 5), (0, 9, 0, 9, 1), (1, 2, 1, 0, 5))
    assert plan.dst_extent == (10, 7) and plan.src_extent == (10, 5)
    assert prog.torch_plan() is plan


def _import_in_child(extra_env: dict[str, str]) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "TIDE_TRITON_CPU_KERNELS")}
    env.update(CUDA_VISIBLE_DEVICES="", PYTHONPATH=str(ROOT), **extra_env)
    code = ("import logging, os; logging.basicConfig(level=logging.INFO, format='%(message)s'); import tide_triton; "
            "print('TRITON_INTERPRET=' + repr(os.environ.get('TRITON_INTERPRET')))")
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("mode,interpret", [("", None), ("interpret", "'1'")], ids=["default", "interpret"])
def test_import_without_cuda_sets_the_interpreter_only_when_asked(mode: str, interpret: str | None) -> None:
    out = _import_in_child({"TIDE_TRITON_CPU_KERNELS": mode} if mode else {})
    assert out.returncode == 0, out.stderr
    assert f"TRITON_INTERPRET={interpret}" in out.stdout
    said = "through Triton's interpreter" if mode else "as plain torch"
    lines = [ln for ln in out.stderr.splitlines() if ln.startswith("no CUDA device: kernels on CPU tensors run")]
    assert lines == [f"no CUDA device: kernels on CPU tensors run {said} ($TIDE_TRITON_CPU_KERNELS="
                     f"{mode or 'torch'})"], out.stderr


def test_a_launched_binding_rebound_to_new_addresses_writes_there(monkeypatch: pytest.MonkeyPatch) -> None:
    """The torch path keeps views of the bound addresses after a launch; a copy rebound to
    other addresses (a reduce-scatter's chunks on new gradients) reads and writes those."""
    from tide_triton import accumulate_shards_ref, bind_accumulate_shards
    from tide_triton.kernels.segments import Binding, upload_table_pairs

    monkeypatch.setenv("TIDE_TRITON_CPU_KERNELS", "torch")
    layout = ShardLayout([(6, 40), (5, 24), (64,)], 2)
    g = torch.Generator().manual_seed(3)

    def operands() -> tuple[list[torch.Tensor], list[torch.Tensor], tuple, tuple]:
        shards = [torch.zeros(s) for s in layout.shard_shapes(1, padded=True)]
        srcs = [torch.randn(layout.flat_shard_numel, generator=g).to(BF16) for _ in range(3)]
        return shards, srcs, tuple(t.data_ptr() for t in shards), tuple(t.data_ptr() for t in srcs)

    shards0, srcs0, d0, s0 = operands()
    own = bind_accumulate_shards(srcs0, shards0, layout, 1)
    first = Binding(own.program, own.dsts, own.srcs, own.k, own.max_ctas, known_ptrs=(d0, s0),
                    shared=upload_table_pairs(torch.device("cpu"), [(d0, s0)])[0])
    first.launch(scale=0.5)
    shards1, srcs1, d1, s1 = operands()
    first.rebound((d1, s1), upload_table_pairs(torch.device("cpu"), [(d1, s1)])[0]).launch(
        scale=0.5, check_addresses=False)
    for srcs, shards in ((srcs0, shards0), (srcs1, shards1)):
        want = [torch.zeros_like(s) for s in shards]
        accumulate_shards_ref(srcs, want, layout, 1, scale=0.5)
        for got, exp in zip(shards, want):
            assert torch.equal(got, exp)
