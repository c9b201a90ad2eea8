"""pytest-benchmark suite for the kernels (GPU; skipped without one), and CPU checks of the
``python -m tide_triton.bench`` command line (what it prints, its errors, its plots).

    python -m pytest bench/test_bench_kernels.py --benchmark-only --benchmark-json=out.json

Each benchmark records bytes moved, GB/s, the fraction of the device-copy ceiling measured
in the same session, and the environment (GPU, versions, git SHA, date) in ``extra_info``.
The CLI (``python -m tide_triton.bench``) prints the same comparisons as one table.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from tide_triton import ShardLayout, bind_accumulate_shards, bind_place_shards
from tide_triton.bench.__main__ import main
from tide_triton.bench.measure import copy_ceiling, env_info
from tide_triton.plan.workloads import MODELS, layer_shapes

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="kernel benchmarks need a GPU")
WORLD_SIZES = (8, 64)
RECORDED = Path(__file__).resolve().parent / "results" / "2026-11-29-h200-kernels.jsonl"


# --------------------------------------------------------------------------- the CLI (CPU)
@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU smoke run")
def test_cli_cpu_prints_truthful_tables(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    rows = tmp_path / "rows.jsonl"
    assert main(["--models", "wan2.2-14b", "--skip", "cast", "accumulate", "--json", str(rows)]) == 0
    cap = capsys.readouterr()
    head = cap.out.splitlines()[0]
    assert head.startswith("tide_triton kernel benchmarks on CPU (") and "kernels as plain torch" in head
    assert " on none" not in cap.out and "launches: -1" not in cap.out and "0.00x" not in cap.out
    assert "speed-up vs FSDP2" not in cap.out  # interpreter vs torch: no ratio column on the CPU
    assert "256 MiB ring" in cap.out and "64 MiB ring" not in cap.out  # the ring the table uses
    assert "| wan2.2-14b | 8 | placement bf16 | tide place_shards |" in cap.out
    # progress on stderr (plain lines: not a terminal), one per piece of work
    assert "[bench 1/2" in cap.err and "wan2.2-14b W=8 placement" in cap.err
    recorded = [json.loads(line) for line in rows.read_text().splitlines()]
    assert recorded[0]["op"] == "copy ceiling" and len(recorded) == 3
    assert all("git_sha" in r and "date" in r and "torch" in r for r in recorded)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error without a GPU")
def test_cli_device_cuda_without_gpu_is_an_argparse_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(["--device", "cuda"])
    assert e.value.code == 2
    assert "--device cuda: no CUDA device is visible to torch" in capsys.readouterr().err


def test_cli_from_needs_plot(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(["--from", str(RECORDED)])
    assert e.value.code == 2 and "--from needs --plot FILE" in capsys.readouterr().err


def test_cli_plot_without_matplotlib_says_how_to_install(tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    with pytest.raises(SystemExit) as e:
        main(["--plot", str(tmp_path / "k.png"), "--from", str(RECORDED)])
    assert e.value.code == 2
    assert "pip install 'tide_triton[bench]'" in capsys.readouterr().err


def test_cli_plots_recorded_rows(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib")
    out = tmp_path / "k.png"
    assert main(["--plot", str(out), "--from", str(RECORDED)]) == 0
    assert out.stat().st_size > 10_000 and out.read_bytes()[:4] == b"\x89PNG"


def test_collective_plot_reads_tide_and_nccl_rows(tmp_path) -> None:
    pytest.importorskip("matplotlib")
    from script_tools import plot_collective_rows
    from tide_triton.bench.report import load_rows

    res = RECORDED.parent
    rows = load_rows([res / "2026-11-29-h200-s3-collectives.jsonl", res / "2026-11-29-h200-nccl-2.32.3-baseline.jsonl"])
    out = tmp_path / "c.png"
    plot_collective_rows(rows, str(out))
    assert out.read_bytes()[:4] == b"\x89PNG"
    with pytest.raises(ValueError, match="no collective rows to plot"):
        plot_collective_rows(load_rows([RECORDED]), str(tmp_path / "none.png"))


# --------------------------------------------------------------------------- GPU benchmarks


@pytest.fixture(scope="session")
def ceiling_gbps() -> float:
    return copy_ceiling(torch.device("cuda"), 2 << 30).gbps()


def _run(benchmark, fn, nbytes: int, ceiling_gbps: float) -> None:
    def timed() -> None:
        fn()
        torch.cuda.synchronize()

    fn()
    torch.cuda.synchronize()
    benchmark.pedantic(timed, rounds=50, iterations=1, warmup_rounds=5)
    median_s = benchmark.stats.stats.median
    gbps = nbytes / median_s / 1e9
    benchmark.extra_info.update(env_info(torch.device("cuda")))
    benchmark.extra_info.update(bytes=nbytes, gbps=gbps, pct_of_copy_ceiling=100 * gbps / ceiling_gbps,
                                note="host-timed with a sync per call: includes launch latency")


@gpu
@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("impl", ["tide", "fsdp2"])
def test_placement(benchmark, model: str, world_size: int, impl: str, ceiling_gbps: float) -> None:
    layout = ShardLayout(layer_shapes(model), world_size)
    W, F = world_size, layout.flat_shard_numel
    ag = torch.randn(W * F, device="cuda").to(torch.bfloat16)
    params = [torch.empty(s, dtype=torch.bfloat16, device="cuda") for s in layout.padded_shapes]
    if impl == "tide":
        fn = bind_place_shards(list(ag.view(W, F).unbind(0)), params, layout).launch
        nbytes = 2 * 2 * sum(layout.numels)
    else:
        outs, split = [p.view(W, -1) for p in params], list(layout.padded_shard_numels)
        fn = lambda: torch.split_with_sizes_copy(ag.view(W, F), split, dim=1, out=outs)  # noqa: E731
        nbytes = 2 * 2 * W * F
    _run(benchmark, fn, nbytes, ceiling_gbps)


@gpu
@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("impl", ["tide", "fsdp2"])
def test_accumulation_k8(benchmark, model: str, world_size: int, impl: str, ceiling_gbps: float) -> None:
    k = 8
    layout = ShardLayout(layer_shapes(model), world_size)
    F = layout.flat_shard_numel
    if impl == "tide":
        slots = [torch.randn(F, device="cuda").to(torch.bfloat16) for _ in range(k)]
        shards = [torch.empty(s, dtype=torch.float32, device="cuda") for s in layout.shard_shapes(0)]
        binding = bind_accumulate_shards(slots, shards, layout, 0)
        fn = lambda: binding.launch(scale=1.0 / k)  # noqa: E731
        nbytes = (2 * k + 4) * sum(layout.shard_numels(0))
    else:
        grads = [torch.randn((k * c, *s[1:]), device="cuda").to(torch.bfloat16)
                 for c, s in zip(layout.rows_per_rank, layout.shapes)]
        cat = torch.empty(k, F, dtype=torch.float32, device="cuda")
        red = torch.empty(F, dtype=torch.float32, device="cuda")

        def fn() -> None:
            torch._chunk_cat(grads, dim=0, num_chunks=k, out=cat)
            torch.sum(cat, dim=0, out=red)

        nbytes = (2 + 4) * k * F + (4 * k + 4) * F
    _run(benchmark, fn, nbytes, ceiling_gbps)
