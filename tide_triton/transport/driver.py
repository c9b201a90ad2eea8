"""Checked cuda-python driver calls: errors that name the call, rollback, contexts.

cuda-python returns ``(CUresult, *outputs)`` from every driver call.  :func:`check` turns
that into the outputs or a :class:`CudaError` naming the call (cuda.core ``handle_return``,
vLLM ``cuda_vmm``)::

    handle = check(cu.cuMemCreate(size, prop, 0), "cuMemCreate(rank=3)")

:class:`Transaction` rolls a multi-step acquisition back in reverse order when a later step
raises (cuda.core ``Transaction``).  :func:`device_context` gives the CUdevice and the
primary context that torch uses for a ``torch.device``; :class:`CtxGuard` makes a context
current around a block of driver calls, from any thread.

Importing this module never touches a GPU: without cuda-python, or without a driver,
:data:`cu` is ``None`` or its calls fail, and only the functions that need it raise.
"""
from __future__ import annotations

import contextlib
import logging
import threading
from typing import Any, Callable

import torch

log = logging.getLogger("tide_triton")

# cuda-bindings >= 12.6 (and 13.x, where the old path is gone) / cuda-python 12.x before it.
try:
    from cuda.bindings import driver as cu
except ImportError:  # pragma: no cover - depends on the installed cuda-python
    try:
        from cuda import cuda as cu  # type: ignore[no-redef]
    except ImportError as _exc:
        cu = None  # type: ignore[assignment]
        _IMPORT_ERROR: str | None = f"{type(_exc).__name__}: {_exc}"
    else:
        _IMPORT_ERROR = None
else:
    _IMPORT_ERROR = None


class CudaError(RuntimeError):
    """A driver call failed; ``code`` is the CUresult value, ``name`` its enum name."""

    def __init__(self, what: str, code: int, name: str) -> None:
        super().__init__(f"{what} failed: {name} ({code})")
        self.what = what
        self.code = code
        self.name = name


def require() -> Any:
    """The driver bindings module, or ``RuntimeError`` saying why there are none."""
    if cu is None:
        raise RuntimeError(
            f"tide_triton's CUDA transport needs cuda-python (cuda-bindings): {_IMPORT_ERROR}"
        )
    return cu


def error_name(err: Any) -> str:
    """``CUDA_ERROR_...`` for a CUresult (or its int value); never raises."""
    try:
        res = cu.cuGetErrorName(err)
        if int(res[0]) == 0 and res[1]:
            return res[1].decode() if isinstance(res[1], bytes) else str(res[1])
    except Exception:  # noqa: BLE001 - a name is a courtesy
        pass
    return getattr(err, "name", None) or f"CUresult {int(err)}"


def check(result: Any, what: str) -> Any:
    """Outputs of a cuda-python call, or :class:`CudaError` naming ``what``.

    ``result`` is the ``(err, *values)`` tuple; returns ``None`` for no values, the value
    for one, the tuple for several.
    """
    if not isinstance(result, tuple):
        result = (result,)
    err = result[0]
    code = int(err)
    if code != 0:
        raise CudaError(what, code, error_name(err))
    values = result[1:]
    if not values:
        return None
    if len(values) == 1:
        return values[0]
    return values


class Transaction:
    """Rollback for multi-step acquisitions (cuda.core ``Transaction``).

    ::

        with Transaction() as tx:
            va = check(cu.cuMemAddressReserve(...), "cuMemAddressReserve")
            tx.on_rollback(cu.cuMemAddressFree, va, size)
            ...                       # a raise here frees va
            tx.commit()               # optional: leaving the block normally commits too

    Undo callbacks run in reverse order when the block raises; each is guarded, so a
    failing undo is logged and the original exception propagates.  ``commit()`` drops
    them.
    """

    def __init__(self) -> None:
        self._stack = contextlib.ExitStack()

    def on_rollback(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        def _undo() -> None:
            try:
                fn(*args, **kwargs)
            except Exception:  # noqa: BLE001 - keep undoing, keep the first error
                log.warning("rollback step %s failed", getattr(fn, "__name__", fn), exc_info=True)

        self._stack.callback(_undo)

    def commit(self) -> None:
        self._stack.pop_all()

    def rollback(self) -> None:
        self._stack.close()

    def __enter__(self) -> "Transaction":
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> bool:
        if exc_type is None:
            self.commit()
        else:
            self.rollback()
        return False


_init_lock = threading.Lock()
_initialised = False


def init() -> Any:
    """``cuInit(0)`` once per process; returns the bindings module."""
    global _initialised
    mod = require()
    if not _initialised:
        with _init_lock:
            if not _initialised:
                check(mod.cuInit(0), "cuInit")
                _initialised = True
    return mod


def module_loading_is_lazy() -> bool:
    """Whether this process's CUDA driver loads kernels lazily (``cuModuleGetLoadingMode``;
    fixed at ``cuInit`` by ``$CUDA_MODULE_LOADING``)."""
    mod = init()
    mode = check(mod.cuModuleGetLoadingMode(), "cuModuleGetLoadingMode")
    return int(mode) == int(mod.CUmoduleLoadingMode.CU_MODULE_LAZY_LOADING)


def driver_version() -> int:
    """``cuDriverGetVersion``, e.g. 13000 for CUDA 13.0."""
    return int(check(init().cuDriverGetVersion(), "cuDriverGetVersion"))


def wait_with_deadline(wait: Callable[[], None], timeout_s: float,
                       on_timeout: Callable[[], BaseException]) -> None:
    """Run a blocking device wait (``torch.cuda.synchronize``, a stream's synchronize) with a
    deadline: in a daemon thread joined for ``timeout_s``; past it, raise ``on_timeout()``.
    A stream stuck on a peer's flag (a peer that died with our waits queued) never ends by
    itself, and a plain synchronize would hold the process forever; here the waiting thread
    stays blocked in the driver and the caller gets an error naming what it waited for.
    An exception of ``wait`` is re-raised in the caller."""
    failed: list[BaseException] = []

    def run() -> None:
        try:
            wait()
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller
            failed.append(exc)

    waiter = threading.Thread(target=run, name="tide_triton device wait", daemon=True)
    waiter.start()
    waiter.join(timeout_s)
    if waiter.is_alive():
        raise on_timeout()
    if failed:
        raise failed[0]


def device_context(device: torch.device) -> tuple[Any, Any]:
    """``(CUdevice, CUcontext)`` for ``device``: the primary context, which torch uses.

    Torch initialises CUDA on that device first (so the primary context exists and is the
    one torch's streams and allocations live in); the context is retained once, and the
    caller releases it with ``cuDevicePrimaryCtxRelease(dev)`` when done.
    """
    if device.type != "cuda" or device.index is None:
        raise ValueError(f"device must be a cuda device with an index, got {device}")
    torch.cuda.init()
    with torch.cuda.device(device.index):
        torch.cuda.synchronize(device)  # creates the primary context if torch had not yet
    return primary_context(device.index)


def primary_context(index: int) -> tuple[Any, Any]:
    """``(CUdevice, CUcontext)``: device ``index``'s primary context, retained once -- no
    device-wide synchronize (:func:`device_context` makes one to have torch create the context
    first; where torch already runs on the device, that would wait, with no deadline, for
    streams waiting on peers)."""
    mod = init()
    dev = check(mod.cuDeviceGet(index), f"cuDeviceGet({index})")
    return dev, check(mod.cuDevicePrimaryCtxRetain(dev), f"cuDevicePrimaryCtxRetain({index})")


class CtxGuard:
    """``with CtxGuard(ctx):`` -- ``ctx`` is current inside the block (push/pop), so
    driver calls work from any thread, whatever the thread had current before.

    Re-entrant per thread: a block nested inside another block of the same guard (a
    collective holding the context across its many enqueues) costs no driver call."""

    __slots__ = ("_ctx", "_depth")

    def __init__(self, ctx: Any) -> None:
        self._ctx = ctx
        self._depth = threading.local()

    def __enter__(self) -> None:
        d = getattr(self._depth, "n", 0)
        if d == 0:
            check(cu.cuCtxPushCurrent(self._ctx), "cuCtxPushCurrent")
        self._depth.n = d + 1

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        d = self._depth.n - 1
        self._depth.n = d
        if d:
            return
        res = cu.cuCtxPopCurrent()
        if exc_type is None:
            check(res, "cuCtxPopCurrent")
