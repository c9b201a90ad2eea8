"""FSDP2 uses of the drop-in that would go wrong without an error, each run
on the CPU (gloo, the host transport, the kernels as plain torch) beside stock FSDP2:

1. Slot-Reuse with two groups of one heap slot unsharded by ``unshard(async_op=True)``
   (FSDP2's documented early unshard) before either is waited for: the second all-gather
   overwrote the first's parameters (FSDP2 marks a group unsharded only at the wait), and
   the layer computed with another layer's weights. Now it raises, naming both.
2. ``enable(prepared=True)``: a step in which a parameter got no gradient (the same on every
   rank) gave the prepared reduce-scatter fewer tensors than it was made for; its run raised,
   breaking the group. Now such a step gets a program of its own: every step matches stock.
3. Slot-Reuse switched on or off between micro-batches run without sync: the gradients
   FSDP2 held on the unsharded parameters were dropped. Now the switch is refused.
4. Ranks deciding differently between tide_triton and stock FSDP2 for a group (another torch
   build on one node): their collectives never paired. Now ``enable`` raises on every rank.
5. Ranks running other same-shaped modules at the same position paired their data. The
   drop-in's calls now carry the module's name in their signature.
6. ``enable(slot_reuse=True)`` past a group's 64 heap regions raised half-way: slots bound,
   wrappers not installed, the next step failed. Now it raises before making any region.
7. ``disable()`` after an eval forward (which maps the released slots again) left them mapped
   until the group closed (a leak). Now it releases the slots no group holds.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

try:
    from _dist import run_multiprocess
except ImportError:  # pragma: no cover
    from tests._dist import run_multiprocess

pytestmark = [pytest.mark.multiproc, pytest.mark.cpu_torch]
W = 2


class _Net(nn.Module):
    def __init__(self, n: int = 3, d: int = 8) -> None:
        super().__init__()
        self.inp = nn.Linear(d, d, bias=False)
        self.extra = nn.Linear(d, d, bias=False)  # in the root's group; unused in some steps
        self.layers = nn.ModuleList([nn.Linear(d, d, bias=False) for _ in range(n)])

    def forward(self, x: torch.Tensor, use_extra: bool = True, only: int | None = None) -> torch.Tensor:
        x = self.inp(x)
        if use_extra:
            x = self.extra(x)
        for i, layer in enumerate(self.layers):
            if only is None or i == only:
                x = torch.tanh(layer(x))
        return x.sum()


def _build(tide: bool, n: int = 3, shard_kw: dict | None = None, **enable):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import tide_triton as tt

    torch.manual_seed(0)
    m = _Net(n)
    mesh = init_device_mesh("cpu", (W,))
    for layer in m.layers:
        fully_shard(layer, mesh=mesh, **(shard_kw or {}))
    fully_shard(m, mesh=mesh, **(shard_kw or {}))
    if tide:
        tt.fsdp.enable(m, **enable)
    return m


def _full(t: torch.Tensor) -> torch.Tensor:
    import torch.distributed as dist

    local = t.to_local().detach().float().contiguous()
    parts: list = [None] * dist.get_world_size()
    dist.all_gather_object(parts, local)
    return torch.cat(parts)[: t.shape[0]].reshape(t.shape).clone()


def _early_unshards(rank: int, world: int) -> dict:
    out = {}
    for name, tide, slot in (("stock", False, False), ("tide", True, False), ("slot", True, True)):
        m = _build(tide, **({"slot_reuse": True} if slot else {}))
        try:
            m.layers[0].unshard(async_op=True)  # layers 0 and 2 share heap slot 0 (SLOT_POOL = 2)
            m.layers[2].unshard(async_op=True)
            out[name] = ("ok", round(m(torch.ones(2, 8) * (rank + 1)).item(), 5))
        except RuntimeError as e:
            out[name] = ("RuntimeError", str(e))
    return out


def test_two_pending_unshards_into_one_heap_slot_raise_instead_of_overwriting() -> None:
    for rank, out in enumerate(run_multiprocess(_early_unshards, W, timeout=300)):
        assert out["tide"] == out["stock"] and out["stock"][0] == "ok", (rank, out)
        kind, msg = out["slot"]
        assert kind == "RuntimeError", (rank, out)  # unchecked: "ok" with another loss
        assert "layers.2" in msg and "layers.0" in msg and "not yet waited for" in msg, (rank, msg)


def _unused_parameter_steps(rank: int, world: int) -> dict:
    out = {}
    for name, tide, prepared in (("stock", False, False), ("tide", True, False), ("prepared", True, True)):
        m = _build(tide, **({"prepared": True} if prepared else {}))
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        log = []
        for use_extra in (True, False, True, False):  # extra.weight gets no gradient in steps 1, 3
            m(torch.ones(2, 8) * (rank + 1), use_extra).backward()
            opt.step()
            opt.zero_grad()
            log.append({n: _full(p) for n, p in m.named_parameters()})
        out[name] = log
    return out


def test_prepared_steps_with_an_unused_parameter_match_stock() -> None:
    for rank, out in enumerate(run_multiprocess(_unused_parameter_steps, W, timeout=300)):
        for step, (want, tide, prep) in enumerate(zip(out["stock"], out["tide"], out["prepared"])):
            for n in want:
                torch.testing.assert_close(tide[n], want[n], msg=f"rank {rank} step {step} {n} (tide)")
                torch.testing.assert_close(prep[n], want[n], msg=f"rank {rank} step {step} {n} (prepared)")


def _switch_between_micro_batches(rank: int, world: int) -> dict:
    import tide_triton as tt

    out = {}
    for name in ("stock", "disable-mid", "enable-mid"):
        m = _build(name == "disable-mid", **({"slot_reuse": True} if name == "disable-mid" else {}))
        x0, x1 = torch.ones(2, 8) * (rank + 1), torch.ones(2, 8) * (rank + 3)
        m.set_requires_gradient_sync(False)
        m(x0).backward()  # micro-batch 0: no reduce-scatter; FSDP2 keeps the gradient unsharded
        refused = None
        try:
            if name == "disable-mid":
                tt.fsdp.disable(m)
            elif name == "enable-mid":
                tt.fsdp.enable(m, slot_reuse=True)
        except RuntimeError as e:
            refused = str(e)
        m.set_requires_gradient_sync(True)
        m(x1).backward()
        out[name] = (refused, _full(m.layers[1].weight.grad))
        tt.fsdp.disable(m) if tt.fsdp.is_enabled(m) else None
    return out


def test_slot_reuse_is_not_switched_between_micro_batches_without_sync() -> None:
    for rank, out in enumerate(run_multiprocess(_switch_between_micro_batches, W, timeout=300)):
        want = out["stock"][1]
        for name in ("disable-mid", "enable-mid"):
            refused, grad = out[name]
            assert refused is not None and "accumulated without a reduce-scatter" in refused, (rank, name, refused)
            # refused: nothing switched, the accumulated gradient kept (before: micro-batch 1's alone)
            torch.testing.assert_close(grad, want, msg=f"rank {rank} {name}")


def _split_decision(rank: int, world: int) -> str:
    import tide_triton as tt
    from tide_triton.fsdp import _torch_adapter

    m = _build(False)
    if rank == 1:  # this rank's torch is not served (another build, stripped sources): stock
        _torch_adapter._API, _torch_adapter._API_ERROR = None, "torch build not served here"
    try:
        tt.fsdp.enable(m)
    except RuntimeError as e:
        return f"RuntimeError: {e}"
    return "enabled"


def test_ranks_that_would_take_different_paths_raise_in_enable() -> None:
    """4. The tide-or-stock decision is each rank's own reading; one rank on stock FSDP2
    against tide_triton on the others paired nothing: a timeout naming nobody useful on one
    side, a wait in the process group's collective on the other.  So ``enable`` agrees the
    decisions and raises on every rank, naming both."""
    for rank, out in enumerate(run_multiprocess(_split_decision, W, timeout=120)):
        assert out.startswith("RuntimeError: enable: ") and "on rank 0 and stock FSDP2's on rank 1" in out, (rank, out)
        assert "torch build not served here" in out, (rank, out)


def _other_modules(rank: int, world: int) -> str:
    m = _build(True)
    try:
        m(torch.ones(2, 8), only=rank).backward()  # rank r runs only layers.r: same shapes
    except Exception as e:  # noqa: BLE001 - the outcome is the test's subject
        return f"{type(e).__name__}: {e}"
    return "ok"


def test_ranks_running_other_same_shaped_modules_raise_naming_both() -> None:
    """5. Rank 0 runs only ``layers.0``, rank 1 only ``layers.1`` (same shapes: conditional
    blocks, experts): their all-gathers paired -- each layer computed with the other's rows,
    no error (stock FSDP2 does the same).  The drop-in's calls carry their module's name in
    the signature: every rank raises, naming both."""
    for rank, out in enumerate(run_multiprocess(_other_modules, W, timeout=120)):
        assert out.startswith("ArgumentMismatchError") and "layers.0" in out and "layers.1" in out, (rank, out)


def _too_many_private_slots(rank: int, world: int) -> dict:
    import tide_triton as tt

    m = _build(False, n=70, shard_kw={"reshard_after_forward": False})  # each a private slot
    try:
        tt.fsdp.enable(m, slot_reuse=True)
        err = None
    except ValueError as e:
        err = str(e)
    m(torch.ones(2, 8)).backward()  # stock FSDP2 again, whole
    return {"error": err, "enabled": tt.fsdp.is_enabled(m), "grad": _full(m.layers[3].weight.grad)}


def test_slot_reuse_past_the_region_limit_raises_before_changing_anything() -> None:
    for rank, out in enumerate(run_multiprocess(_too_many_private_slots, W, timeout=300)):
        assert out["error"] is not None and "needs 71 heap regions" in out["error"], (rank, out["error"])
        assert out["enabled"] is False and out["grad"].abs().sum() > 0, (rank, out)


def _disable_after_eval(rank: int, world: int) -> dict:
    import tide_triton as tt
    from tide_triton.fsdp import slots

    m = _build(True, slot_reuse=True)
    m(torch.ones(2, 8)).backward()  # the slots are released after backward
    with torch.no_grad():
        m(torch.ones(2, 8))  # an eval forward maps them again
    m.reshard()
    mine = [s for s in (ref() for ref in slots._SLOTS) if s is not None and s.members]
    tt.fsdp.disable(m)
    m(torch.ones(2, 8)).backward()  # stock again
    return {"slots": len(mine), "mapped after disable": [s.region.key for s in mine if not s.region.released]}


def test_disable_releases_the_slots_it_empties() -> None:
    for rank, out in enumerate(run_multiprocess(_disable_after_eval, W, timeout=300)):
        assert out["slots"] >= 2 and out["mapped after disable"] == [], (rank, out)
