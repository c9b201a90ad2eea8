"""Small helpers of the transports: log a fallback once per process, share errors, round up."""
from __future__ import annotations

import logging
import threading
from typing import Any

from ..plan.heap import round_up as round_up  # re-exported for the transports: one round_up in the package

log = logging.getLogger("tide_triton")

_logged: set[str] = set()
_logged_lock = threading.Lock()


def log_once(key: str, level: int, msg: str, *args: Any) -> None:
    """Log ``msg % args`` at ``level`` the first time ``key`` is seen in this process."""
    with _logged_lock:
        if key in _logged:
            return
        _logged.add(key)
    log.log(level, msg, *args)


def describe(exc: BaseException) -> str:
    """``"TypeName: message"`` -- an error as it travels to the peers."""
    return f"{type(exc).__name__}: {exc}"


def raise_if_failed(infos: Any, what: str) -> None:
    """Raise one RuntimeError naming every rank whose entry of an exchange carries ``"err"``."""
    errs = {r: i.get("err") for r, i in enumerate(infos) if i.get("err")}
    if errs:
        detail = "; ".join(f"rank {r}: {e}" for r, e in sorted(errs.items()))
        raise RuntimeError(f"{what} failed on rank(s) {sorted(errs)}: {detail}")

