"""``tide_triton.fsdp.enable`` between ranks: its waits keep the group's deadline, the options
that change what ranks do are agreed before anything is made, and ``stats`` counts a group
that several modules share once.  CPU: gloo, the host transport, the Triton interpreter."""
from __future__ import annotations

import time

import pytest
import torch
from torch import nn

try:
    from _dist import run_multiprocess
except ImportError:  # pragma: no cover
    from tests._dist import run_multiprocess

pytestmark = pytest.mark.multiproc
W = 2


class _Net(nn.Module):
    def __init__(self, n: int = 2, d: int = 8) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(d, d, bias=False) for _ in range(n)])
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return self.head(self.norm(x)).sum()


def _build(**shard_kw):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    m = _Net()
    mesh = init_device_mesh("cpu", (W,))
    for layer in m.layers:
        fully_shard(layer, mesh=mesh, **shard_kw)
    fully_shard([m.norm, m.head], mesh=mesh, **shard_kw)  # one group, two modules
    fully_shard(m, mesh=mesh, **shard_kw)
    return m


def _store():
    from torch.distributed import distributed_c10d as c10d

    return c10d._get_default_store()


# --------------------------------------------------------------------------- deadline
def _enable_on_rank_0_only(rank: int, world: int) -> dict:
    import tide_triton as tt

    m = _build()
    g = tt.init(timeout_s=5)
    out: dict = {}
    if rank == 0:
        t0 = time.monotonic()
        try:
            tt.fsdp.enable(m, group=g)
            out["outcome"] = "enabled"
        except tt.PeerTimeoutError as e:
            out["outcome"] = f"PeerTimeoutError peer={e.peer}: {e}"
        out["seconds"] = time.monotonic() - t0
        _store().set("enable-test/done", "1")
    else:  # never calls enable; stays alive until rank 0 has its outcome
        _store().wait(["enable-test/done"])
    return out


def test_enable_on_one_rank_waits_for_the_peer_with_the_groups_deadline() -> None:
    out = run_multiprocess(_enable_on_rank_0_only, W, timeout=150)[0]
    assert out["outcome"].startswith("PeerTimeoutError peer=1: timed out after 5.0 s waiting for rank 1"), out
    assert "enable" in out["outcome"], out
    assert out["seconds"] < 60, out  # the group's 5 s (a loaded machine's slack), not the default 300 s


# --------------------------------------------------------------------------- options
_SCENARIOS = {  # option -> (rank 0's enable keywords, rank 1's)
    "slot_reuse": ({"slot_reuse": True}, {}),
    "prepared": ({"prepared": True}, {}),
    "release_slots": ({"slot_reuse": True}, {"slot_reuse": True, "release_slots": False}),
    "tide_triton.fsdp.SLOT_POOL": ({"slot_reuse": True}, {"slot_reuse": True, "pool": 3}),
    "group": ({}, {"group": None}),  # rank 1 would set up a new group that rank 0 never joins
}


def _options_differing(rank: int, world: int) -> dict:
    import tide_triton as tt

    import torch.distributed as dist

    g = tt.init(dist.new_group(list(range(world))), timeout_s=20)  # FSDP2's ranks, not the world group's
    out = {}
    for option, kws in _SCENARIOS.items():
        kw = dict(kws[rank])
        pool = kw.pop("pool", 2)
        kw.setdefault("group", g)
        m = _build()
        t0 = time.monotonic()
        saved, tt.fsdp.SLOT_POOL = tt.fsdp.SLOT_POOL, pool
        try:
            tt.fsdp.enable(m, **kw)
            outcome = "enabled"
        except tt.TideTritonError as e:
            outcome = f"{type(e).__name__}: {e}"
        finally:
            tt.fsdp.SLOT_POOL = saved
        out[option] = (outcome, time.monotonic() - t0, tt.fsdp.is_enabled(m))
    # the same group named on one rank and found on the other (the world group's, FSDP2's ranks): agreed
    world_g = tt.init(timeout_s=20)
    m = _build()
    tt.fsdp.enable(m, group=world_g if rank == 0 else None)
    same = tt.fsdp.is_enabled(m) and {st.group for st in tt.fsdp.install._state.GROUPS.values()} == {world_g}
    tt.fsdp.disable(m)
    return out, same


def test_enable_options_that_differ_between_ranks_raise_on_every_rank_naming_both_values() -> None:
    for rank, (out, same_group_enabled) in enumerate(run_multiprocess(_options_differing, W, timeout=300)):
        assert same_group_enabled, rank
        for option, (outcome, seconds, enabled) in out.items():
            first, second = (repr(v) for v in _values(option))
            assert outcome.startswith(f"ArgumentMismatchError: ranks disagree on tide_triton.fsdp.enable's {option}: "
                                      f"rank 0: {first}; rank 1: {second}"), (rank, option, outcome)
            assert seconds < 15, (rank, option, seconds)  # at once: before the group's 20 s deadline
            assert not enabled, (rank, option)  # nothing switched


def _values(option: str) -> tuple:
    return {"slot_reuse": (True, False), "prepared": (True, False), "release_slots": (True, False),
            "tide_triton.fsdp.SLOT_POOL": (2, 3),
            "group": ("an open tide_triton group", "a new tide_triton group of FSDP2's process group")}[option]


# --------------------------------------------------------------------------- stats
def _shared_group_stats(rank: int, world: int, slot_reuse: bool) -> dict:
    import tide_triton as tt

    m = _build()
    report = tt.fsdp.enable(m, slot_reuse=slot_reuse)
    for _ in range(2):
        m(torch.ones(2, 8) * (rank + 1)).backward()
    return {"report": report, "stats": tt.fsdp.stats(m)}


@pytest.mark.parametrize("slot_reuse", [False, True])
def test_stats_counts_a_group_shared_by_two_modules_once(slot_reuse: bool) -> None:
    for rank, out in enumerate(run_multiprocess(_shared_group_stats, W, slot_reuse, timeout=300)):
        assert out["report"] == {"layers.0": None, "layers.1": None, "norm": None, "head": None}, out
        stats = out["stats"]  # the root holds no parameter: no group
        assert sorted(stats) == ["layers.0", "layers.1", "norm+head"], (rank, stats)
        # two steps: one all-gather in forward, one in backward (resharded after forward), one reduce-scatter
        assert stats["norm+head"]["reduce_scatters"] == 2, (rank, stats)
        assert sum(s["reduce_scatters"] for s in stats.values()) == 2 * 3, (rank, stats)
