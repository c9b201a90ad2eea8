"""Heap regions, the all-gather block and Slot-Reuse slots: hand-overs stay paired after a
refused call, shared slots and empty parameters keep their storages straight, a failed enable
gives its memory back (host transport)."""
from __future__ import annotations

import threading
import time

import pytest
import torch

try:
    from _dist import run_multiprocess
except ImportError:  # pragma: no cover
    from tests._dist import run_multiprocess

_SENTINEL = 0x5A


def _handover_after_a_refused_call(rank: int, W: int, delay: float) -> dict:
    import tide_triton as tt
    from tide_triton.plan.layout import ShardLayout

    g = tt.init(timeout_s=60)
    shapes = [(4 * W, 8), (3 * W + 1,)]
    layout = ShardLayout(shapes, W)
    region = g.heap_region("params", sum(layout.padded_shard_numels) * W * 2, "cpu")
    grads = [torch.ones(s, dtype=torch.bfloat16) for s in shapes]
    # 1. Every rank hands its copy over; the staged call is refused on every rank (rank 1
    # passes a shard of the wrong shape: agreed, the group stays usable).
    region.vacate()
    bad = [torch.empty(s) for s in layout.shard_shapes(rank)]
    if rank == 1:
        bad[0] = torch.empty(1)
    try:
        tt.reduce_scatter(grads, bad, op="sum", staging=region)
        refused = "no error"
    except (TypeError, ValueError) as e:
        refused = type(e).__name__
    # 2. The next use: the owner still uses its copy for ``delay`` seconds, then vacates.
    owner = W - 1
    view = region.tensor(torch.uint8)
    view.fill_(_SENTINEL)
    g.exchange(None)  # every copy holds the sentinel before anyone stages
    seen: dict = {}
    th = None
    if rank == owner:
        def later() -> None:
            time.sleep(delay)
            seen["untouched"] = bool((view == _SENTINEL).all())
            region.vacate()

        th = threading.Thread(target=later)
        th.start()
    else:
        region.vacate()
    shards = [torch.empty(s) for s in layout.shard_shapes(rank)]
    tt.reduce_scatter(grads, shards, op="sum", staging=region)
    if th is not None:
        th.join()
    ok = all(torch.equal(x, torch.full_like(x, float(W))) for x in shards)
    g.close()
    return {"refused": refused, "ok": ok, **seen}


@pytest.mark.multiproc
@pytest.mark.parametrize("world_size", [2, 3])
def test_a_refused_staged_call_does_not_let_the_next_writers_in_early(world_size: int) -> None:
    """A ``vacate()`` whose staged reduce-scatter was refused (agreed argument error; the
    group stays usable) left the hand-over epochs one apart: the next staging's wait was met
    by the stale hand-over and the peers wrote into the owner's copy while it still used it
    (no error); ``HeapRegion._begin_staging`` keeps them paired."""
    out = run_multiprocess(_handover_after_a_refused_call, world_size, 1.5, timeout=120)
    for r, res in enumerate(out):
        assert res["refused"] != "no error", (r, res)
        assert res["ok"], (r, res)
    assert out[-1]["untouched"], "a peer wrote into the owner's region before its second vacate()"


def _disable_one_block_of_a_shared_slot(rank: int, W: int) -> dict:
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from train_llama import Llama, LlamaConfig, batch, loss_fn, shard

    import tide_triton as tt
    from tide_triton.fsdp._torch_adapter import param_groups
    from tide_triton.fsdp.install import group_state

    cfg = LlamaConfig(vocab=13, dim=8, n_layers=3, n_heads=2, hidden=12, tied=True, bias=True, head_gain=True)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    out: dict = {}
    for tide in (False, True):  # stock FSDP2, then Slot-Reuse with block 0 disabled after a step
        torch.manual_seed(0)
        model = Llama(cfg)
        shard(model, init_device_mesh("cpu", (W,)), mp)
        if tide:
            tt.fsdp.SLOT_POOL = 2
            tt.fsdp.enable(model, slot_reuse=True)
            out["keys"] = [group_state(param_groups(b)[0]).slot.region.key for b in model.layers]
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses = []
        try:
            for s in range(3):
                loss = loss_fn(model, batch(cfg, s, rank, 2, 4, "cpu"))
                loss.backward()
                opt.step()
                opt.zero_grad()
                losses.append(loss.item())
                if tide and s == 0:
                    tt.fsdp.disable(model.layers[0])  # blocks 0 and 2 shared a slot; 2 stays in it
            out["error"] = None
        except RuntimeError as e:
            out["error"] = str(e).splitlines()[0]
        out["tide" if tide else "stock"] = losses
    out["still_slotted"] = group_state(param_groups(model.layers[2])[0]).slot is not None
    if out["error"] is None:
        tt.fsdp.disable(model)
    return out


@pytest.mark.multiproc
def test_disabling_one_group_of_a_shared_slot_keeps_the_others_storage_a_slot() -> None:
    """Blocks 0 and 2 share a pool slot and lay out alike, so their views have the same
    storage addresses; ``disable(layers[0])`` (``slots.unbind``) dropped those addresses from
    the slot registry, and block 2's next reshard went to FSDP2's ``resize_(0)`` of heap
    storage ("not resizable"); ``slots.unbind`` keeps the other groups' addresses."""
    out = run_multiprocess(_disable_one_block_of_a_shared_slot, 2, timeout=300)
    for r, res in enumerate(out):
        assert res["keys"][0] == res["keys"][2] != res["keys"][1], res["keys"]
        assert res["error"] is None, (r, res["error"])
        assert res["still_slotted"], (r, res)
        assert res["tide"] == res["stock"], (r, res)  # W=2: bit for bit


def _empty_parameter_in_a_slot(rank: int, W: int) -> int:
    from types import SimpleNamespace

    import torch.distributed.fsdp._fully_shard._fsdp_param as fparam

    import tide_triton as tt
    from tide_triton.fsdp import slots

    class _Obj:  # weakly referencable stand-ins for FSDP2's FSDPParam / FSDPParamGroup
        pass

    g = tt.init(timeout_s=30)
    region = g.heap_region("test:slot", 4096, "cpu")
    params = []
    for shape in ((3, 2), (0,)):  # an empty parameter: its view is empty, at no heap address
        fp = _Obj()
        fp.padded_sharded_param_size, fp.sharded_param = torch.Size(shape), torch.empty(shape)
        fp.all_gather_outputs = []
        params.append(fp)
    pg = _Obj()
    pg.fsdp_params, pg.mp_policy = params, SimpleNamespace(param_dtype=None)
    st = SimpleNamespace(group=g, slot=None)
    slots._bind(pg, st, slots._new_slot(region, True, 2, False))
    slots.ORIG_STORAGE[:] = [fparam.alloc_storage, fparam.free_storage]
    try:
        stock = torch.empty(10)  # a stock group's unsharded storage: freed at reshard, allocated at unshard
        slots.free_storage(stock)
        slots.alloc_storage(stock)
        size = stock.untyped_storage().size()
    finally:
        slots.ORIG_STORAGE.clear()
        slots.unbind(pg, st)
    g.close()
    return size


@pytest.mark.multiproc
def test_an_empty_parameter_in_a_slot_does_not_claim_freed_stock_storage() -> None:
    """An empty parameter's slot view is ``torch.empty(0)`` (storage address 0), the address a
    storage freed by FSDP2's ``resize_(0)`` has too: registered as heap storage, every freed
    stock storage (a group on the stock path) looked like a slot, and ``alloc_storage``
    skipped it -- the unsharded parameter stayed 0 bytes; ``slots._bind`` registers none."""
    assert run_multiprocess(_empty_parameter_in_a_slot, 2, timeout=120) == [40, 40]


def _enable_fails_at_a_later_slot(rank: int, W: int) -> dict:
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from train_llama import Llama, LlamaConfig, shard

    import tide_triton as tt
    from tide_triton.group import process_groups
    from tide_triton.transport import host

    cfg = LlamaConfig(vocab=13, dim=8, n_layers=3, n_heads=2, hidden=12, tied=True, bias=True, head_gain=True)
    torch.manual_seed(0)
    model = Llama(cfg)
    shard(model, init_device_mesh("cpu", (W,)), MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    # Heaps of 16 MiB: flags, the 4 MiB ring and two slots fit, the third slot does not (as a
    # device running out of memory at the third slot would).
    host._RESERVE_BYTES = 16 << 20
    tt.fsdp.SLOT_POOL = 2
    try:
        tt.fsdp.enable(model, slot_reuse=True)
        err = "no error"
    except ValueError as e:
        err = str(e)
    regions = [r for g in process_groups.open_groups() if not g.closed for r in g.regions]
    return {"error": err, "regions": [(r.key, r.released) for r in regions],
            "enabled": tt.fsdp.is_enabled(model)}


@pytest.mark.multiproc
def test_a_failed_slot_reuse_enable_gives_back_the_slots_it_made() -> None:
    """``enable(slot_reuse=True)`` that fails at a later slot (the heap cannot grow) put the
    groups back on stock FSDP2; ``slots.assign_slots`` must also release the slots it made
    before, or they stay mapped for the group's life."""
    out = run_multiprocess(_enable_fails_at_a_later_slot, 2, timeout=120)
    for r, res in enumerate(out):
        assert "reservation" in res["error"] and not res["enabled"], (r, res)
        assert len(res["regions"]) == 2, (r, res)  # the root's slot and the first shared one
        assert all(released for _, released in res["regions"]), (r, res)
