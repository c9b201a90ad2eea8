"""The rule around driver calls that wait for every stream of the process (module loads; see
``tide_triton/runtime/device_wide.py``): registered owners settle before one, a kernel variant's
first load settles first and only once, and a transport that cannot settle names the peer
its streams wait for.  The GPU case (a peer late on its GPU, a new kernel variant loaded
meanwhile) is in tests/test_faults.py."""
from __future__ import annotations

import gc
import types

import pytest
import torch

from tide_triton.runtime import device_wide
from tide_triton.errors import PeerTimeoutError


class _Owner:
    def __init__(self, log: list, name: str, error: BaseException | None = None, device: int | None = 0) -> None:
        self.log, self.name, self.error = log, name, error
        self.device = torch.device("cuda", device) if device is not None else torch.device("cpu")

    def settle_device_wide(self, what: str) -> None:
        self.log.append((self.name, what))
        if self.error is not None:
            raise self.error


@pytest.fixture
def clean_registry(monkeypatch):
    import weakref

    monkeypatch.setattr(device_wide, "_owners", weakref.WeakSet())
    return device_wide


def test_every_registered_owner_settles_and_the_first_error_propagates(clean_registry) -> None:
    log: list = []
    a, b, c, other = _Owner(log, "a"), _Owner(log, "b"), _Owner(log, "c"), _Owner(log, "gpu1", device=1)
    for o in (a, b, c, other):
        device_wide.register(o)
    device_wide.unregister(c)
    assert device_wide.registered() == 3
    device_wide.before("loading X", 0)
    assert sorted(log) == [("a", "loading X"), ("b", "loading X")]  # not the owner on another GPU
    device_wide.before("loading W", 1)
    assert log[-1] == ("gpu1", "loading W") and len(log) == 3
    b.error = PeerTimeoutError(3, "rank 3's flag", 1.0)
    with pytest.raises(PeerTimeoutError, match="rank 3") as e:
        device_wide.before("loading Z", 0)
    assert e.value.peer == 3


def test_owners_are_held_weakly(clean_registry) -> None:
    log: list = []
    device_wide.register(_Owner(log, "gone"))
    gc.collect()
    assert device_wide.registered() == 0
    device_wide.before("nothing to settle", 0)
    assert log == []


def test_a_kernel_variant_settles_before_its_first_load_and_only_then(clean_registry, monkeypatch) -> None:
    """``Binding.prepare`` on the CUDA branch (Triton's compile and load stood in for): the
    owners settle before the load, once per variant, and a settle error leaves nothing
    loaded -- the next prepare settles (and loads) again."""
    from tide_triton.kernels import segments
    from tide_triton.kernels.accumulate import bind_accumulate_shards
    from tide_triton.plan.layout import ShardLayout

    events: list = []
    owner = _Owner(events, "transport", device=None)  # the CPU tensors below: device index None
    device_wide.register(owner)

    class _Compiled:
        def _init_handles(self) -> None:
            events.append(("load", None))

    def warmup(*args, **kwargs):
        events.append(("compile", None))
        return _Compiled()

    monkeypatch.setattr(segments, "_COMPILED", {})
    monkeypatch.setattr(segments.segmented_reduce_kernel, "warmup", warmup)
    layout = ShardLayout([(6, 4), (8,)], 2)
    shards = [torch.zeros(s) for s in layout.shard_shapes(0, padded=True)]
    grads = [torch.ones(layout.flat_shard_numel * 2, dtype=torch.bfloat16) for _ in range(2)]
    b = bind_accumulate_shards(grads, shards, layout, 0)
    b._cuda = True  # the branch that compiles and loads (stood in for above)
    owner.error = PeerTimeoutError(1, "rank 1's flag 7 to reach 3", 2.0)
    with pytest.raises(PeerTimeoutError, match="rank 1"):
        b.prepare()
    assert [k for k, _ in events] == ["transport"]  # nothing compiled or loaded
    owner.error = None
    b.prepare()
    b.prepare()  # loaded: nothing settles again
    b.prepare(scale=0.5)  # another variant: settles, then loads
    kinds = [k for k, _ in events]
    assert kinds == ["transport", "transport", "compile", "load", "transport", "compile", "load"], kinds
    assert "loading a kernel variant" in events[1][1]


def test_a_transport_that_cannot_settle_names_the_peer_its_streams_wait_for() -> None:
    """``CudaTransport.settle_device_wide`` (no GPU: the parts it uses stood in for)."""
    pytest.importorskip("cuda.bindings.driver")
    from tide_triton.transport.cuda import CudaTransport

    t = object.__new__(CudaTransport)
    t._closed, t.rank = False, 0
    t.options = types.SimpleNamespace(timeout_s=0.25)
    t._waits = types.SimpleNamespace(stuck_peers=lambda: {2, 1})
    drained: list = []
    t._drain = lambda timeout_s: drained.append(timeout_s) or False
    with pytest.raises(PeerTimeoutError, match="before loading Y, which waits for every stream") as e:
        t.settle_device_wide("loading Y")
    assert e.value.peer == 1 and drained == [0.25]
    t._drain = lambda timeout_s: True
    t.settle_device_wide("loading Y")  # idle: returns
    t._waits = types.SimpleNamespace(stuck_peers=lambda: set())
    t._drain = lambda timeout_s: False
    with pytest.raises(TimeoutError, match="rank 0: before loading Y"):
        t.settle_device_wide("loading Y")
    t._closed = True
    t.settle_device_wide("loading Y")  # closed: nothing to settle


def test_an_outgrown_zero_buffer_stays_alive_until_the_group_closes() -> None:
    """Prepared copy lists keep the zero buffer's *address* (padding copied from it on the copy
    queue, where torch's allocator does not see the use): growing the buffer must not free
    the old one while the group lives."""
    import weakref

    import tide_triton as tt

    (g,) = tt.local_groups(1)
    try:
        cpu = torch.device("cpu")
        small = g.zeros(cpu, 16)
        ref = weakref.ref(small)
        ptr = small.data_ptr()
        del small
        big = g.zeros(cpu, 1 << 20)
        assert big.numel() >= 1 << 20 and bool((big == 0).all())
        gc.collect()
        assert ref() is not None and ref().data_ptr() == ptr  # still held by the group
        assert g.zeros(cpu, 8) is big  # never shrunk
    finally:
        g.close()
