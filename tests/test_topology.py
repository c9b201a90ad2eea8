"""Topology: rank <-> (node, local) arithmetic, rails, and every validation branch."""
from __future__ import annotations

import pytest

from tide_triton.plan.topology import Topology


# 1 x 8 (one node), 8 x 1 (one rank per node), odd shapes (3 x 2, 2 x 3) and 128 x 8.
@pytest.mark.parametrize("nodes,local", [(1, 8), (8, 1), (3, 2), (2, 3), (5, 4), (128, 8)])
def test_arithmetic(nodes: int, local: int) -> None:
    t = Topology(nodes * local, local)
    assert t.nodes == nodes
    seen = set()
    for n in range(nodes):
        assert t.node_ranks(n) == tuple(t.rank_of(n, l) for l in range(local))
        for r in t.node_ranks(n):
            assert t.node_of(r) == n
            seen.add(r)
    assert seen == set(range(nodes * local))
    for l in range(local):
        rail = t.rail(l)
        assert len(rail) == nodes
        assert all(t.local_rank(r) == l for r in rail)
        assert [t.node_of(r) for r in rail] == list(range(nodes))


def test_frozen_and_hashable() -> None:
    t = Topology(8, 4)
    with pytest.raises(AttributeError):
        t.local_size = 2  # type: ignore[misc]
    assert hash(t) == hash(Topology(8, 4)) and str(t) == "2 x 4"


@pytest.mark.parametrize("args,exc,match", [
    ((6, 4), ValueError, "world_size must be a multiple of local_size=4, got 6"),
    ((0, 1), ValueError, "world_size must be >= 1, got 0"),
    ((4, 0), ValueError, "local_size must be >= 1, got 0"),
    ((4, -2), ValueError, "local_size must be >= 1, got -2"),
    ((4.0, 2), TypeError, "world_size must be an int, got float"),
    ((4, "2"), TypeError, "local_size must be an int, got str"),
    ((True, 1), TypeError, "world_size must be an int, got bool"),
])
def test_rejects_bad_arguments(args, exc, match) -> None:
    with pytest.raises(exc, match=match):
        Topology(*args)


def test_rejects_bad_indices() -> None:
    t = Topology(6, 2)
    with pytest.raises(ValueError, match=r"rank must be in \[0, 6\), got 6"):
        t.node_of(6)
    with pytest.raises(TypeError, match="rank must be an int, got float"):
        t.local_rank(1.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"local must be in \[0, 2\), got 2"):
        t.rail(2)
    with pytest.raises(ValueError, match=r"node must be in \[0, 3\), got -1"):
        t.node_ranks(-1)


def test_from_env() -> None:
    assert Topology.from_env(16, env={"LOCAL_WORLD_SIZE": "8"}) == Topology(16, 8)
    assert Topology.from_env(16, env={"LOCAL_WORLD_SIZE": " 4 "}) == Topology(16, 4)
    assert Topology.from_env(16, env={}) == Topology(16, 16)  # no torchrun: one node
    assert Topology.from_env(16, env={"LOCAL_WORLD_SIZE": ""}) == Topology(16, 16)
    assert Topology.from_env(16, 2, env={"LOCAL_WORLD_SIZE": "8"}) == Topology(16, 2)  # explicit wins


def test_from_env_reads_os_environ(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert Topology.from_env(6) == Topology(6, 2)
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert Topology.from_env(6) == Topology(6, 6)


@pytest.mark.parametrize("raw,match", [
    ("eight", "LOCAL_WORLD_SIZE must be an int, got 'eight'"),
    ("2.5", "LOCAL_WORLD_SIZE must be an int, got '2.5'"),
    ("0", "LOCAL_WORLD_SIZE must be >= 1, got '0'"),
    ("-8", "LOCAL_WORLD_SIZE must be >= 1, got '-8'"),
    ("5", "world_size=16 must be a multiple of LOCAL_WORLD_SIZE, got '5'"),
])
def test_from_env_rejects_bad_env(raw: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        Topology.from_env(16, env={"LOCAL_WORLD_SIZE": raw})


def test_from_env_rejects_bad_arguments() -> None:
    with pytest.raises(TypeError, match="world_size must be an int, got str"):
        Topology.from_env("16")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="world_size must be a multiple of local_size=3, got 16"):
        Topology.from_env(16, 3)
