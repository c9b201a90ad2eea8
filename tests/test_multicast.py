"""NVSwitch multicast on CPU: the guard, the object lifecycle against a fake driver (rollback
at every step, rank agreement), fallbacks, both collectives through the emulation, and that
no multicast call reaches the real driver with the default options or with "auto" here.

Nothing here creates a real multicast object (docs/multicast.md)."""
from __future__ import annotations

import logging
import threading

import pytest
import torch
from _dist import run_threads
from fake_multicast import EmulatedBuffers, FakeDriver, ThreadExchange

import tide_triton as tt
from tide_triton.runtime import envs
from tide_triton.group.core import GroupOptions
from tide_triton.plan.layout import ShardLayout
from tide_triton.executors.multicast import all_gather_node, chunk_plan, reduce_scatter_node
from tide_triton.transport import driver as drv
from tide_triton.transport import multicast as mc
from tide_triton.transport.multicast import (MulticastObject, RankFacts, device_supports_multicast,
                                             multicast_allowed, resolve_multicast)

KILL = [{"TIDE_TRITON_MULTICAST": "0"}, {"NCCL_NVLS_ENABLE": "0"}, {"TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}]


# ---------------------------------------------------------------------------------- guard
def test_group_options_multicast_default_off_and_checked():
    assert GroupOptions().multicast == "off"
    for m in ("off", "auto", "on"):
        assert GroupOptions(multicast=m).multicast == m
    with pytest.raises(ValueError, match='multicast must be "off", "auto" or "on", got \'yes\''):
        GroupOptions(multicast="yes")


def test_env_readers():
    assert envs.multicast_enabled({}) and not envs.multicast_enabled({"TIDE_TRITON_MULTICAST": "0"})
    assert envs.nccl_nvls_enabled({}) and not envs.nccl_nvls_enabled({"NCCL_NVLS_ENABLE": "0"})
    assert not envs.torch_symm_mem_multicast_disabled({})
    assert envs.torch_symm_mem_multicast_disabled({"TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"})
    assert mc.env_facts({}) is None
    for env in KILL:
        (k, v), = env.items()
        assert mc.env_facts(env) == f"{k}={v}"


@pytest.mark.parametrize("facts,allowed,why", [
    ([RankFacts("auto", True, None)] * 2, True, "every one of 2 ranks"),
    ([RankFacts("on", True, None)] * 4, True, "every one of 4 ranks"),
    ([RankFacts("off", True, None)] * 2, False, 'multicast="off"'),
    ([RankFacts("auto", True, None), RankFacts("off", True, None)], False, "disagree"),
    ([RankFacts("auto", True, None), RankFacts("on", True, None)], False, "disagree"),
    ([RankFacts("auto", True, None), RankFacts("auto", True, "NCCL_NVLS_ENABLE=0")], False,
     "rank 1: NCCL_NVLS_ENABLE=0"),
    ([RankFacts("auto", True, None), RankFacts("auto", False, None)], False,
     r"rank\(s\) \[1\]: CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED is 0"),
    ([RankFacts("auto", None, None)] * 2, False, "no CUDA device"),
    ([RankFacts("auto", True, None)], False, "one rank"),
    ([], False, "no ranks"),
])
def test_guard(facts, allowed, why):
    d = multicast_allowed(facts)
    assert d.allowed is allowed
    assert pytest.importorskip("re").search(why, d.reason), d.reason


def test_resolve_off_touches_nothing():
    def boom(*a):
        raise AssertionError("mode off must not query or exchange")
    assert resolve_multicast("off", rank=0, exchange=boom, query=boom).allowed is False
    with pytest.raises(ValueError, match="multicast must be one of"):
        resolve_multicast("maybe", rank=0, exchange=None, query=boom)


@pytest.mark.parametrize("env", KILL)
def test_auto_under_kill_switch_never_queries_and_falls_back(env, caplog):
    fake = FakeDriver()
    calls = []
    with caplog.at_level(logging.INFO, logger="tide_triton"):
        d = resolve_multicast("auto", rank=0, exchange=None, env=env,
                              query=lambda: calls.append(1) or device_supports_multicast(fake, 0))
    assert not d.allowed and "forbidden by the environment" in d.reason
    assert calls == [] and fake.calls == []
    with pytest.raises(RuntimeError, match=r'multicast="on"\) cannot be honoured on rank 0: forbidden'):
        resolve_multicast("on", rank=0, exchange=None, env=env, query=lambda: True)


def test_fallback_logged_once_and_on_raises_on_every_rank(caplog):
    fake = FakeDriver(supported=False)
    ex = ThreadExchange(3)
    with caplog.at_level(logging.INFO, logger="tide_triton"):
        out = run_threads(lambda r: resolve_multicast("auto", rank=r, exchange=ex.of(r), env={},
                                                      query=lambda: device_supports_multicast(fake, r)), 3)
    assert all(not d.allowed and "MULTICAST_SUPPORTED is 0" in d.reason for d in out)
    assert fake.multicast_calls() == []
    assert sum("copy-engine path" in m for m in caplog.messages) <= 1
    ex2 = ThreadExchange(3)
    errs: dict[int, str] = {}

    def on(r):
        try:
            resolve_multicast("on", rank=r, exchange=ex2.of(r), env={}, query=lambda: r != 2)
        except RuntimeError as e:
            errs[r] = str(e)
    run_threads(on, 3)
    assert sorted(errs) == [0, 1, 2]
    assert all(r"rank(s) [2]: CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED is 0" in e for e in errs.values())


# ------------------------------------------------------------------------------ lifecycle
def _bound(fake: FakeDriver, W: int, numel: int) -> list[tuple[torch.Tensor, int]]:
    """Per rank: a bf16 buffer registered as that rank's device memory, and its aligned address."""
    out = []
    for r in range(W):
        raw = torch.zeros(numel + fake.granularity, dtype=torch.bfloat16)
        fake.register(raw, r)
        skip = (-raw.data_ptr()) % fake.granularity // 2
        out.append((raw[skip:skip + numel], raw.data_ptr() + 2 * skip))
    return out


def _create_all(fake: FakeDriver, W: int, numel: int):
    ex = ThreadExchange(W)
    bufs = _bound(fake, W, numel)

    def make(r):
        return MulticastObject(fake, rank=r, local_size=W, exchange=ex.of(r), cudev=r, device_index=r,
                               bind_ptr=bufs[r][1], size=2 * numel, timeout_s=10)
    return bufs, make


def test_lifecycle_order_and_teardown():
    fake = FakeDriver()
    W = 3
    bufs, make = _create_all(fake, W, 512)
    objs = run_threads(make, W)
    assert fake.calls.count("cuMulticastCreate") == 1
    assert fake.calls.count("cuMemImportFromShareableHandle") == W - 1
    assert fake.calls.count("cuMulticastAddDevice") == W
    assert fake.calls.count("cuMulticastBindAddr") == W
    last_add = max(i for i, c in enumerate(fake.calls) if c == "cuMulticastAddDevice")
    first_bind = min(i for i, c in enumerate(fake.calls) if c == "cuMulticastBindAddr")
    assert last_add < first_bind  # every device before any binding
    assert all(o.mc_ptr and o.size == 1024 for o in objs)
    live = fake.live()
    assert len(live["maps"]) == W and len(live["bound"]) == W
    for o in objs:
        o.close()
        o.close()  # idempotent
    assert fake.live() == {}
    teardown = [c for c in fake.calls if c in ("cuMemUnmap", "cuMemAddressFree", "cuMulticastUnbind", "cuMemRelease")]
    assert teardown[:4] == ["cuMemUnmap", "cuMemAddressFree", "cuMulticastUnbind", "cuMemRelease"]


@pytest.mark.parametrize("step", ["cuMulticastGetGranularity", "cuMulticastCreate", "cuMemExportToShareableHandle",
                                  "cuMemImportFromShareableHandle", "cuMulticastAddDevice", "cuMulticastBindAddr",
                                  "cuMemAddressReserve", "cuMemMap", "cuMemSetAccess"])
def test_rollback_at_each_step_on_every_rank(step):
    fake = FakeDriver(fail=[step])
    W = 3
    _, make = _create_all(fake, W, 512)
    errs: dict[int, str] = {}

    def one(r):
        try:
            make(r)
        except RuntimeError as e:
            errs[r] = str(e)
    run_threads(one, W)
    assert sorted(errs) == list(range(W)), "every rank raises"
    assert all(step in e for e in errs.values()), errs
    assert fake.live() == {}, "rolled back everywhere"


def test_misaligned_bind_raises_everywhere():
    fake = FakeDriver()
    W = 2
    bufs = _bound(fake, W, 512)
    ex = ThreadExchange(W)
    errs = {}

    def one(r):
        try:
            MulticastObject(fake, rank=r, local_size=W, exchange=ex.of(r), cudev=r, device_index=r,
                            bind_ptr=bufs[r][1] + (2 if r == 1 else 0), size=1024, timeout_s=10)
        except RuntimeError as e:
            errs[r] = str(e)
    run_threads(one, W)
    assert sorted(errs) == [0, 1] and all("bind_ptr must be a multiple" in e for e in errs.values())
    assert fake.multicast_calls().count("cuMulticastCreate") == 0 and fake.live() == {}


# ------------------------------------------------------------------ collectives, emulated
# Awkward shapes: a dim 0 smaller than W, a prime, 1-D, a 3-D parameter; the bound range is
# small so the plan takes several chunks and splits a shard.
SHAPES = [(7, 5), (2,), (1, 4, 3), (13, 2), (97,)]


def test_chunk_plan_covers_every_element_once():
    W = 3
    layout = ShardLayout(SHAPES, W)
    plan = chunk_plan(layout, 64)
    assert len(plan) > 1
    seen = {(i, s): 0 for i in range(len(SHAPES)) for s in range(W)}
    for chunk in plan:
        end = 0
        for p in chunk:
            assert p.offset % 8 == 0 and p.offset >= end and p.offset + p.numel <= 64
            end = p.offset + p.numel
            assert p.start == seen[(p.param, p.shard)]
            seen[(p.param, p.shard)] += p.numel
    assert all(seen[(i, s)] == layout.shard_numels(s)[i] for i, s in seen)


@pytest.mark.parametrize("W", [2, 3])
def test_collectives_through_emulation(W):
    fake = FakeDriver()
    numel = 64
    bufs, make = _create_all(fake, W, numel)
    objs = run_threads(make, W)
    layout = ShardLayout(SHAPES, W)
    gen = torch.Generator().manual_seed(5)
    # Integer values: every fp32 sum is exact, and small enough to be exact in bf16 too
    # (the switch returns bf16), so the emulated path must match the fp32 reference bit for bit.
    grads = [[torch.randint(-8, 9, s, generator=gen).to(torch.bfloat16) for s in SHAPES] for _ in range(W)]
    full = [torch.randint(-50, 51, s, generator=gen).float() for s in SHAPES]
    bar = threading.Barrier(W, timeout=30)

    def rank(r):
        buf = EmulatedBuffers(fake, objs[r].mc_ptr, bufs[r][0], bar.wait)
        shards = [torch.full(s, 7.0) for s in layout.shard_shapes(r, padded=True)]
        reduce_scatter_node(buf, grads[r], shards, layout, r, scale=0.5, accumulate=False)
        acc = [torch.ones(s) for s in layout.shard_shapes(r)]
        reduce_scatter_node(buf, grads[r], acc, layout, r, scale=None, accumulate=True)
        mine = [f[r * c: r * c + n] for f, c, n in zip(full, layout.rows_per_rank, layout.shard_rows(r))]
        params = [torch.full(s, 3.0, dtype=torch.bfloat16) for s in layout.padded_shapes]
        all_gather_node(buf, mine, params, layout, r)
        return shards, acc, params

    out = run_threads(rank, W)
    for r in range(W):
        shards, acc, params = out[r]
        for i, s in enumerate(SHAPES):
            c, n = layout.rows_per_rank[i], layout.shard_rows(r)[i]
            total = sum(grads[q][i].float() for q in range(W))[r * c: r * c + n]
            assert torch.equal(shards[i][:n], total * 0.5)
            assert torch.equal(shards[i][n:], torch.zeros_like(shards[i][n:]))  # padding rows zeroed
            assert torch.equal(acc[i], total + 1)
            padded = torch.zeros(layout.padded_shapes[i], dtype=torch.bfloat16)
            padded[:s[0]] = full[i].to(torch.bfloat16)
            assert torch.equal(params[i], padded)
    for o in objs:
        o.close()
    assert fake.live() == {}


def test_reduce_ref_rounds_once_to_bf16():
    from tide_triton.kernels.multimem import multimem_reduce_ref
    a = torch.full((8,), 256.0, dtype=torch.bfloat16)
    b = torch.full((8,), 1.0, dtype=torch.bfloat16)
    out = torch.empty(8)
    multimem_reduce_ref([a, b], 0, out)
    assert torch.equal(out, torch.full((8,), 256.0))  # 257 is not a bf16: the switch returns 256
    with pytest.raises(ValueError, match="offset must be a multiple of 8"):
        multimem_reduce_ref([a], 3, out)


# ------------------------------------------------ no multicast call reaches the real driver
class _RaisingDriver:
    """The real driver module (or nothing) behind a wrapper that raises on any multicast call."""

    def __init__(self, real):
        self._real = real
        self.asked: list[str] = []

    def __getattr__(self, name):
        if name.startswith("cuMulticast"):
            self.asked.append(name)
            raise AssertionError(f"{name} reached the driver")
        if self._real is None:
            raise AttributeError(name)
        return getattr(self._real, name)


@pytest.mark.parametrize("mode,env", [("off", {}), ("auto", {}), ("auto", KILL[0]), ("auto", KILL[1]),
                                      ("auto", KILL[2])])
def test_no_multicast_call_reaches_the_driver(mode, env, monkeypatch, caplog):
    wrapper = _RaisingDriver(drv.cu)
    monkeypatch.setattr(drv, "cu", wrapper)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    W = 2
    groups = tt.local_groups(W, timeout_s=30, multicast=mode,
                             devices=[device] * W if device.type == "cuda" else None)
    layout = ShardLayout(SHAPES, W)
    gen = torch.Generator().manual_seed(9)
    grads = [[torch.randint(-8, 9, s, generator=gen).to(torch.bfloat16).to(device) for s in SHAPES]
             for _ in range(W)]
    full = [torch.randint(-50, 51, s, generator=gen).float().to(device) for s in SHAPES]

    def rank(r):
        if device.type == "cuda":  # every rank on the group's device, each on its own stream
            with torch.cuda.stream(torch.cuda.Stream(device)):
                return one(r, device)
        return one(r, device)

    def one(r, dev):
        g = [x.to(dev) for x in grads[r]]
        shards = [torch.empty(s, device=dev) for s in layout.shard_shapes(r)]
        tt.reduce_scatter(g, shards, group=groups[r], op="sum")
        mine = [f[r * c: r * c + n].to(dev) for f, c, n in zip(full, layout.rows_per_rank, layout.shard_rows(r))]
        params = [torch.empty(s, dtype=torch.bfloat16, device=dev) for s in SHAPES]
        tt.all_gather(mine, params, group=groups[r])
        if dev.type == "cuda":
            tt.synchronize(groups[r], timeout_s=30)
        return [x.cpu() for x in shards], [x.cpu() for x in params]

    try:
        with caplog.at_level(logging.INFO, logger="tide_triton"):
            out = run_threads(rank, W, timeout=300)
    finally:
        for g in groups:
            g.close()
    assert wrapper.asked == []
    for r in range(W):
        shards, params = out[r]
        for i in range(len(SHAPES)):
            c, n = layout.rows_per_rank[i], layout.shard_rows(r)[i]
            assert torch.equal(shards[i], sum(x[i].float().cpu() for x in grads)[r * c: r * c + n])
            assert torch.equal(params[i], full[i].cpu().to(torch.bfloat16))


def test_on_without_support_raises_on_every_rank():
    W = 2
    groups = tt.local_groups(W, timeout_s=30, multicast="on")
    errs: dict[int, str] = {}

    def rank(r):
        try:
            tt.reduce_scatter([torch.ones(4, dtype=torch.bfloat16)], [torch.empty(2)], group=groups[r])
        except RuntimeError as e:
            errs[r] = str(e)
    try:
        run_threads(rank, W, timeout=60)
    finally:
        for g in groups:
            g.close()
    assert sorted(errs) == [0, 1]
    assert all('multicast="on") cannot be honoured' in e for e in errs.values()), errs
