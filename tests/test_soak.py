"""A short soak of the FSDP2 drop-in (bench/soak.py): after warm-up no mode grows its open
file descriptors, threads, /dev/shm entries or files held, or tide_triton's heap, and every
mode's losses and final parameters equal stock FSDP2's bit for bit (W=2 on the CPU).

The long run is ``python bench/soak.py`` (docs/benchmarks.md, "Soak: 2,000 FSDP2 steps");
this one trains each mode 30 steps in one pair of processes, then a stock run that leaks one
/dev/shm file, one descriptor and one thread per step, which the summary must catch.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

try:
    from _dist import run_multiprocess
except ImportError:  # pragma: no cover
    from tests._dist import run_multiprocess

import soak  # noqa: E402

pytestmark = [pytest.mark.multiproc, pytest.mark.cpu_torch]

STEPS, EVERY, WARMUP = 30, 2, 0.2
RUNS = (("stock", "stock", None), ("eager", "eager", None), ("prepared", "prepared", None),
        ("slot_reuse", "slot_reuse", None), ("leaky", "stock", "shm,fd,thread"))
"""(label, mode, injected leaks), in this order in each rank's process."""
COUNTS = ("fds", "threads", "shm_named", "shm_held", "shm_held_bytes", "heap_bytes")


def _child(rank: int, world: int, runs: tuple) -> list[dict]:
    records: list[dict] = []
    for label, mode, leak in runs:
        cfg = soak.SoakConfig(steps=STEPS, every=EVERY, warmup=WARMUP, leak=leak)
        soak.train(rank, world, mode, cfg, records.append, label=label)
    return records


@pytest.fixture(scope="module")
def summary() -> dict:
    # module-scoped, so before conftest's per-test cpu_torch setting: the product's CPU path, set here
    out = run_multiprocess(_child, 2, RUNS, timeout=400, env={"TIDE_TRITON_CPU_KERNELS": "torch"})
    s = soak.summarize([r for recs in out for r in recs], WARMUP)
    print(soak.format_summary(s))
    return s


@pytest.mark.parametrize("mode", ["eager", "prepared", "slot_reuse"])
def test_the_drop_in_keeps_its_resources_flat_and_trains_as_stock(summary: dict, mode: str) -> None:
    for rank, row in summary["modes"][mode].items():
        grown = {k: row["series"][k] for k in COUNTS if k in row["series"] and not row["series"][k]["flat"]}
        assert not grown, f"{mode}, rank {rank}: grew after warm-up: {grown}"
        assert "heap_bytes" in row["series"], row
        assert row["losses_vs_stock"]["equal"], f"{mode}, rank {rank}: {row['losses_vs_stock']}"
        assert row["params_equal_stock"], f"{mode}, rank {rank}: parameters differ from stock's"
        st = row["stats_total"]
        assert st["all_gathers"] >= STEPS and st["reduce_scatters"] >= STEPS, st  # served, not fallen back
        if mode == "prepared":
            assert st["prepared_runs"] > 0, st
        if mode == "slot_reuse":
            assert st["slot_all_gathers"] > 0, st


def test_stock_is_flat_too(summary: dict) -> None:
    for rank, row in summary["modes"]["stock"].items():
        assert all(row["series"][k]["flat"] for k in ("fds", "threads", "shm_named", "shm_held")), (rank, row)


def test_a_leak_of_a_shm_file_a_descriptor_and_a_thread_per_step_is_caught(summary: dict) -> None:
    for rank, row in summary["modes"]["leaky"].items():
        s = row["series"]
        judged = STEPS - int(WARMUP * STEPS) - EVERY  # steps between the first and last judged sample
        assert not row["flat"]
        for k in ("shm_named", "fds", "threads"):
            assert not s[k]["flat"] and s[k]["max_drift"] == judged, (rank, k, s[k])
        assert row["losses_vs_stock"]["equal"], row["losses_vs_stock"]


def test_summary_flatness_rules() -> None:
    samples = [{"step": st, "fds": 10 + (st >= 60), "rss": 100 * soak.MIB + st * 1024} for st in range(0, 101, 10)]
    fds = soak.series_summary(samples, "fds", 10)
    assert (fds["first"], fds["last"], fds["max_drift"], fds["at_step"], fds["flat"]) == (10, 11, 1, 60, False)
    rss = soak.series_summary(samples, "rss", 10)  # 80 KiB of drift: within 8 MiB
    assert rss["flat"] and rss["max_drift"] == 80 * 1024 and rss["per_1000_steps"] == 1024 * 1000
    assert soak.series_summary(samples, "threads", 10) is None
    assert soak.compare_losses([1.0, 2.0, 3.0], [1.0, 2.5, 3.0]) == {
        "steps": 3, "equal": False, "first_diff_step": 2, "steps_differing": 1, "max_abs_diff": 0.5}
