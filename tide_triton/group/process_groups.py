"""tide_triton groups and torch.distributed: the bootstrap store their exchanges go through
(the default process group's), and the open groups of this process -- closed at interpreter
exit and when their process group is destroyed, newest first."""
from __future__ import annotations

import atexit
import itertools
import logging
import weakref
from typing import Any

import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from .bootstrap import Exchange, StoreKeyValue

log = logging.getLogger("tide_triton")

_ALL: "weakref.WeakSet[Any]" = weakref.WeakSet()
"""Every open group of this process: closed at interpreter exit and when their process
group is destroyed (a group left open there aborted the process in 3 of 27 exits)."""
_OPENED = itertools.count()
"""Creation order of this process's groups (``Group._opened``)."""
_INSTANCES: dict[str, int] = {}


def opened(g: Any) -> int:
    """Note the open group ``g`` (closed at exit); returns its creation number."""
    _ALL.add(g)
    return next(_OPENED)


def forget(g: Any) -> None:
    """``g`` is closed."""
    _ALL.discard(g)


def open_groups() -> list[Any]:
    """The open groups of this process."""
    return list(_ALL)


def _default_store() -> Any:
    """The default process group's store (every process group's ranks reach it)."""
    try:
        return c10d._get_default_store()
    except Exception as e:  # noqa: BLE001
        raise RuntimeError(f"tide_triton needs torch.distributed's default store for its bootstrap "
                           f"exchanges, and none is reachable ({e}); call init_process_group first") from e


def exchange_once(pg: Any, obj: object, *, what: str, timeout_s: float) -> list:
    """One all-gather of a small picklable object over ``pg``'s ranks (in their order there),
    through the bootstrap store like a group's exchanges -- with a deadline naming the ranks
    that did not arrive, and no collective of ``pg`` itself (no NCCL communicator made)."""
    ex = _store_exchange(pg, _store_prefix(pg) + "once/")
    return ex.exchange(obj, call=0, index=1, timeout_s=timeout_s, what=what)


def store_exchange(pg: Any) -> Exchange:
    """The exchange of a new group over ``pg``, under keys of its own."""
    return _store_exchange(pg, _store_prefix(pg))


def _store_exchange(pg: Any, prefix: str) -> Exchange:
    """An exchange of ``pg``'s ranks through the default store, whose failure names its host:
    global rank 0 (``init_method="tcp://..."`` / ``"env://"`` serve the store there)."""
    ex = Exchange(StoreKeyValue(_default_store()), prefix, dist.get_rank(pg), dist.get_world_size(pg))
    ranks = dist.get_process_group_ranks(pg)
    ex.store_host = ranks.index(0) if 0 in ranks else None
    return ex


def _store_prefix(pg: Any) -> str:
    """Keys of one group instance: the process group's name and how many groups this process
    made for it before (every rank makes them in the same order: creation is collective)."""
    try:
        name = c10d._get_process_group_name(pg)
    except Exception:  # noqa: BLE001
        name = "ranks-" + "-".join(map(str, dist.get_process_group_ranks(pg)))
    n = _INSTANCES[name] = _INSTANCES.get(name, 0) + 1
    return f"tide_triton/{name}/{n}/"


def _open_groups_newest_first() -> list[Any]:
    """The open groups in the reverse of their creation order.  Closing destroys NCCL
    communicators, which their other members must destroy in the same order (a window
    deregistration and the destroy wait for them): ``_ALL`` iterates by address, which
    differs between processes -- two ranks closing two communicators in opposite orders
    hung in ``ncclCommDestroy`` (docs/constraints.md#communicators-close-in-one-order).
    Groups are created collectively, so the creation order is the same on every member."""
    return sorted(_ALL, key=lambda g: g._opened, reverse=True)


def _close_all() -> None:
    for g in _open_groups_newest_first():
        try:
            g.close()
        except Exception as e:  # noqa: BLE001 -- at exit: log, never raise
            log.warning("closing a tide_triton group at exit failed: %s", e)


atexit.register(_close_all)

_destroy_wrapped = False


def close_with_process_groups() -> None:
    """Close groups when their process group is destroyed: ``dist.destroy_process_group``
    is wrapped (once) to close the groups over that process group (all, for the world)
    before torch tears it down."""
    global _destroy_wrapped
    if _destroy_wrapped:
        return
    orig = c10d.destroy_process_group

    def destroy_process_group(group: Any = None) -> Any:
        for g in _open_groups_newest_first():
            if g.pg is not None and (group is None or g.pg is group or group is dist.group.WORLD):
                try:
                    g.close()
                except Exception as e:  # noqa: BLE001
                    log.warning("closing a tide_triton group before destroy_process_group failed: %s", e)
        return orig(group)

    destroy_process_group.__wrapped__ = orig  # type: ignore[attr-defined]
    destroy_process_group.__doc__ = orig.__doc__
    c10d.destroy_process_group = destroy_process_group
    dist.destroy_process_group = destroy_process_group
    _destroy_wrapped = True
