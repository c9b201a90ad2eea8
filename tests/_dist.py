"""Run a function in ``world_size`` spawned CPU processes joined by a gloo process group.

Test helper, reused by every multi-process test::

    def _body(rank, world_size, x):          # module level: it is pickled by name
        ...
        return {"rank": rank}                # anything picklable

    results = run_multiprocess(_body, 4, x)  # list indexed by rank

Habits (STYLE.md, triton_kernels ``test_distributed``): the parent holds the rendezvous store
(a ``TCPStore`` on port 0 of 127.0.0.1: the OS picks a port and the parent keeps it bound, so
no other test can take it between choosing and binding, as it can a port chosen by binding
port 0 and closing it again); every wait has a timeout; survivors
are killed; each child destroys its process group in ``finally``; a child's exception comes back to the parent as a
``RuntimeError`` naming its rank and carrying its traceback text.
"""
from __future__ import annotations

import contextlib
import datetime
import faulthandler
import importlib
import logging
import os
import pickle
import queue as queue_mod
import signal
import time
import traceback
from typing import Any, Callable, Collection, Iterator, Mapping, Sequence

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["run_multiprocess", "report", "set_attrs", "rank_device", "nccl_problem", "CHILD_ENV", "SHARE_GPU",
           "train_step", "train", "assert_same", "LogLines"]

CHILD_ENV: dict[str, str] = {}
"""Set in every child's environment under the test's own ``env`` (conftest puts
``TRITON_INTERPRET=1`` here for CPU tests, so their children run the kernels through the
interpreter also on a GPU machine, where the parent runs compiled Triton)."""

SHARE_GPU = "TIDE_TESTS_SHARE_GPU"
"""Environment variable of the test suite (set by ``pytest --share-gpu``, inherited by the
children): ``1`` makes :func:`rank_device` put every rank on ``cuda:0``."""


def nccl_problem(world_size: int) -> str | None:
    """Why the GPU tests of declared nodes cannot run ``world_size`` ranks here (their hop
    is NCCL; several ranks on one GPU need NCCL >= 2.30 and ``NCCL_MULTI_RANK_GPU_ENABLE=1``),
    or None."""
    from tide_triton.transport import nccl

    try:
        lib = nccl.load()
    except OSError as e:
        return f"no NCCL: {e}"
    if torch.cuda.device_count() < world_size:
        if not lib.features.multi_rank_per_gpu:
            return f"NCCL {'.'.join(map(str, lib.version))} cannot run several ranks on one GPU (needs >= 2.30)"
        if os.environ.get("NCCL_MULTI_RANK_GPU_ENABLE") != "1":
            return "several ranks per GPU need NCCL_MULTI_RANK_GPU_ENABLE=1"
    return None


def rank_device(rank: int, *, share: bool | None = None) -> "torch.device":
    """The device of ``rank`` in a test: the torchrun convention ``cuda:(rank % n)`` over
    the ``n`` visible GPUs, or ``cuda:0`` for every rank when sharing one GPU (``share``,
    default: ``$TIDE_TESTS_SHARE_GPU == "1"``)."""
    n = torch.cuda.device_count()
    if n < 1:
        raise RuntimeError("rank_device needs a CUDA device (torch.cuda.device_count() is 0)")
    if share is None:
        share = os.environ.get(SHARE_GPU) == "1"
    return torch.device("cuda", 0 if share else rank % n)

_GRACE_S = 2.0
"""Seconds to wait for a dead child's last message, and for peers of a failed rank."""

_to_parent: Callable[[Any], None] | None = None
"""In a child of :func:`run_multiprocess`: sends a message to the parent (:func:`report`)."""


def report(obj: Any) -> None:
    """From a child of :func:`run_multiprocess`: hand ``obj`` (picklable) to the parent's
    ``on_message`` now, while ``fn`` still runs (a long run's records as they come)."""
    if _to_parent is None:
        raise RuntimeError("report() is for the children of run_multiprocess")
    _to_parent(obj)


# Results are pickled to bytes in the child (tensors by value, not as shared-memory handles
# that die with the child), so a child may exit as soon as its message is flushed.


@contextlib.contextmanager
def _patched_environ(env: Mapping[str, str] | None) -> Iterator[None]:
    """Set ``env`` in ``os.environ`` for the duration (spawned children inherit it, so
    variables read at import time work too), then restore the previous values."""
    if not env:
        yield
        return
    saved = {k: os.environ.get(k) for k in env}
    try:
        os.environ.update({k: str(v) for k, v in env.items()})
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _child(
    rank: int,
    world_size: int,
    store_port: int,
    fn: Callable[..., Any],
    args: tuple,
    env: Mapping[str, str] | None,
    attrs: Mapping[str, Any] | None,
    num_threads: int | None,
    pg_timeout_s: float,
    results: Any,
) -> None:
    # The parent asks for every thread's stack (SIGUSR1) before it kills a rank that did not
    # report in time: the test's output then shows where each stuck rank waited.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    global _to_parent
    _to_parent = lambda obj: results.put(("msg", rank, pickle.dumps(obj)))  # noqa: E731
    os.environ["RANK"] = str(rank)
    os.environ["LOCAL_RANK"] = str(rank)
    os.environ["WORLD_SIZE"] = str(world_size)
    os.environ["LOCAL_WORLD_SIZE"] = str(world_size)
    if env:  # after the defaults, so a test can declare LOCAL_WORLD_SIZE (nodes) through env
        os.environ.update({k: str(v) for k, v in env.items()})
    if num_threads is not None:
        torch.set_num_threads(num_threads)
    try:
        try:
            set_attrs(attrs)
            store = dist.TCPStore("127.0.0.1", store_port, None, False,
                                  timeout=datetime.timedelta(seconds=pg_timeout_s))
            dist.init_process_group(
                "gloo",
                store=store,
                rank=rank,
                world_size=world_size,
                timeout=datetime.timedelta(seconds=pg_timeout_s),
            )
            out = fn(rank, world_size, *args)
            payload = ("ok", rank, pickle.dumps(out))
        except BaseException:  # noqa: BLE001 - everything goes back to the parent
            payload = ("error", rank, traceback.format_exc())
        finally:
            if dist.is_initialized():
                with contextlib.suppress(Exception):
                    dist.destroy_process_group()
        try:
            results.put(payload)
        except Exception:  # e.g. the result was not picklable after all
            results.put(("error", rank, traceback.format_exc()))
    finally:
        results.close()
        results.join_thread()  # flush before exiting so the parent always gets the message


def run_multiprocess(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 120,
    env: Mapping[str, str] | None = None,
    attrs: Mapping[str, Any] | None = None,
    num_threads: int | None = 1,
    may_die: Collection[int] = (),
    pg_timeout: float | None = None,
    on_message: Callable[[int, Any], None] | None = None,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` spawned processes, each inside an
    initialised gloo process group, and return their results as a list indexed by rank.

    ``fn`` must be a module-level function and ``args`` and the results picklable.
    ``env`` is set in the children's environment (before they import anything).
    ``attrs`` are module attributes set in every child before ``fn`` runs (:func:`set_attrs`:
    the package's test switches, which are not environment variables).
    ``pg_timeout``: the process group's and store's deadline in the children (default ``timeout``).
    ``on_message(rank, obj)`` sees each :func:`report` of a child as it arrives.
    ``num_threads`` sets ``torch.set_num_threads`` in each child (1 by default: several
    ranks share few cores); ``None`` leaves torch's default.
    ``timeout`` bounds the whole run (seconds): on expiry the survivors are killed and a
    ``RuntimeError`` names the ranks that had not reported.  If a child raised, the parent
    raises ``RuntimeError`` with that rank and its traceback; a child that died without
    reporting gives a ``RuntimeError`` naming its rank and exit code -- unless it is in
    ``may_die`` (a test of peer failure): its result is then ``None``.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int):
        raise TypeError(f"world_size must be an int, got {type(world_size).__name__}")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if timeout <= 0:
        raise ValueError(f"timeout must be > 0, got {timeout}")

    ctx = mp.get_context("spawn")
    results_q = ctx.Queue()
    # The parent serves the store for the whole run: its port stays bound (no race with other
    # tests for a port chosen here and bound later by a child).
    store = dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=timeout))
    procs = []
    ok = False
    deadline = time.monotonic() + timeout
    # One rank per child: the driver's default 8 hardware queues suffice, and a context with
    # more costs the GPU's capacity for contexts (8 processes of a test beside others'); lazy
    # module loading (torch's default) is safe with one rank per process and keeps contexts
    # small -- a child running several ranks as threads asks for EAGER through ``env``.
    env = {"CUDA_DEVICE_MAX_CONNECTIONS": "8", "CUDA_MODULE_LOADING": "LAZY", **CHILD_ENV, **(env or {})}
    try:
        with _patched_environ(env):
            for rank in range(world_size):
                p = ctx.Process(
                    target=_child,
                    args=(rank, world_size, store.port, fn, args, env, attrs, num_threads,
                          pg_timeout or timeout, results_q),
                    name=f"run_multiprocess-rank{rank}",
                    daemon=True,
                )
                p.start()
                procs.append(p)

        outputs: dict[int, Any] = {}
        errors: dict[int, str] = {}
        dead_since: dict[int, float] = {}
        first_error_at: float | None = None
        name = getattr(fn, "__qualname__", repr(fn))
        while len(outputs) + len(errors) < world_size:
            now = time.monotonic()
            if now >= deadline:
                missing = sorted(set(range(world_size)) - outputs.keys() - errors.keys())
                for r in missing:  # their stacks, on the test's stderr
                    if procs[r].is_alive():
                        with contextlib.suppress(OSError):
                            os.kill(procs[r].pid, signal.SIGUSR1)
                time.sleep(1.0)
                raise RuntimeError(
                    f"run_multiprocess({name}, world_size={world_size}): ranks {missing}"
                    f" did not report within {timeout} s (their threads' stacks: the test's stderr)"
                    + _format_errors(errors)
                )
            try:
                status, rank, data = results_q.get(timeout=min(0.2, deadline - now))
            except queue_mod.Empty:
                pass
            else:
                if status == "msg":
                    if on_message is not None:
                        on_message(rank, pickle.loads(data))
                elif status == "ok":
                    outputs[rank] = pickle.loads(data)
                else:
                    errors[rank] = data
                    if first_error_at is None:
                        first_error_at = time.monotonic()
                continue
            now = time.monotonic()
            for r, p in enumerate(procs):
                if r in outputs or r in errors or p.is_alive():
                    continue
                # Dead and silent: allow a moment for a message still in the pipe.
                if now - dead_since.setdefault(r, now) > _GRACE_S and r in may_die:
                    outputs[r] = None
                elif now - dead_since.setdefault(r, now) > _GRACE_S:
                    errors[r] = f"rank {r} died without reporting (exit code {p.exitcode})"
                    if first_error_at is None:
                        first_error_at = now
            # A failed rank leaves its peers blocked in collectives: give them a short grace
            # period to report their own errors, then stop waiting for them.
            if first_error_at is not None and now - first_error_at > _GRACE_S:
                break
        if errors:
            raise RuntimeError(
                f"run_multiprocess({name}, world_size={world_size}): {len(errors)} rank(s)"
                f" failed: {sorted(errors)}" + _format_errors(errors)
            )
        ok = True
        return [outputs[r] for r in range(world_size)]
    finally:
        # After success the children are exiting: join them patiently.  After a failure
        # the survivors are probably blocked on a dead peer: kill them soon.
        join_deadline = time.monotonic() + (10.0 if ok else _GRACE_S)
        for p in procs:
            p.join(timeout=max(0.0, join_deadline - time.monotonic()))
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5.0)
        results_q.close()
        results_q.cancel_join_thread()
        del store


def set_attrs(attrs: Mapping[str, Any] | None) -> None:
    """Set each ``"package.module.NAME": value`` of ``attrs`` (``module.NAME = value``)."""
    for target, value in (attrs or {}).items():
        module, _, name = target.rpartition(".")
        mod = importlib.import_module(module)
        if not hasattr(mod, name):
            raise AttributeError(f"attrs: {module} has no attribute {name!r} to set (target {target!r})")
        setattr(mod, name, value)


def _format_errors(errors: Mapping[int, str]) -> str:
    return "".join(f"\n--- rank {r} ---\n{errors[r].rstrip()}" for r in sorted(errors))


def run_threads(fn: Callable[[int], Any], world_size: int, *, timeout: float = 120) -> list[Any]:
    """``fn(rank)`` for every rank, one thread each (the single-process mode's ranks);
    returns the results by rank.  A rank's exception is re-raised here with its rank; a rank
    still running after ``timeout`` is an error naming it and showing where it waits (its
    thread's stack)."""
    import sys
    import threading

    out: dict[int, Any] = {}
    errors: dict[int, BaseException] = {}

    def one(r: int) -> None:
        try:
            out[r] = fn(r)
        except BaseException as e:  # reported below, not lost in the thread
            errors[r] = e

    threads = [threading.Thread(target=one, args=(r,), daemon=True) for r in range(world_size)]
    for th in threads:
        th.start()
    deadline = time.monotonic() + timeout
    for th in threads:
        th.join(max(0.0, deadline - time.monotonic()))
    if errors:
        r = min(errors)
        raise RuntimeError(f"rank {r} failed: {type(errors[r]).__name__}: {errors[r]}") from errors[r]
    late = [r for r in range(world_size) if r not in out]
    if late:
        frames = sys._current_frames()
        stacks = "".join(
            f"\n--- rank {r} (thread {threads[r].ident}) ---\n"
            + "".join(traceback.format_stack(frames[threads[r].ident]))
            for r in late if threads[r].ident in frames)
        raise RuntimeError(f"rank(s) {late} did not finish within {timeout} s{stacks}")
    return [out[r] for r in range(world_size)]


# ---- the stock-vs-tide FSDP2 harness (tests/test_fsdp*.py, test_shard_dims.py) ----------------
def train_step(model, opt, loss_of: Callable[[int], Any], *, sync: Callable[[bool], None],
               micro: Sequence[bool] = (True,), full: Callable[[Any], Any] | None = None) -> tuple[list[float], Any]:
    """One optimizer step as the stock-vs-tide tests run it: per micro-batch ``i``,
    ``sync(micro[i])`` (the gradient sync that micro-batch runs), ``loss_of(i)`` and its
    backward; with ``full``, every parameter's full gradient (``full(p.grad)``) before the
    update (AdamW hides a wrong scale); then the optimizer step.  Returns the micro-batches'
    losses and those gradients (None without ``full``)."""
    losses = []
    for i, flag in enumerate(micro):
        sync(flag)
        loss = loss_of(i)
        loss.backward()
        losses.append(loss.item())
    grads = None if full is None else {n: full(p.grad) for n, p in model.named_parameters()}
    opt.step()
    opt.zero_grad()
    return losses, grads


def train(model, opt, steps: int, loss_of: Callable[[int, int], Any], *, sync: Callable[[bool], None],
          full: Callable[[Any], Any], micro: Sequence[bool] = (True,)) -> tuple[list[float], dict]:
    """``steps`` of :func:`train_step` (``loss_of(step, i)``): every micro-batch's loss in order,
    and the last step's full gradients before its update."""
    losses: list[float] = []
    grads: dict = {}
    for s in range(steps):
        got, g = train_step(model, opt, lambda i, s=s: loss_of(s, i), sync=sync, micro=micro,
                            full=full if s == steps - 1 else None)
        losses += got
        grads = g if g is not None else grads
    return losses, grads


def assert_same(a, b, what: str, tol: float = 0.0) -> None:
    """``a`` equals ``b`` (nested dicts of tensors or numbers): bit for bit when ``tol`` is 0,
    else within ``tol`` (relative and absolute); the message names the entry and the difference."""
    if isinstance(a, dict):
        assert a.keys() == b.keys(), what
        for k in a:
            assert_same(a[k], b[k], f"{what}[{k}]", tol)
        return
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    if tol == 0.0:
        assert torch.equal(a, b), f"{what}: max diff {(a - b).abs().max().item():.3g}"
    else:
        torch.testing.assert_close(a, b, rtol=tol, atol=tol, msg=lambda m: f"{what}: {m}")


class LogLines(logging.Handler):
    """The messages tide_triton logs at ``level`` or above while attached (:meth:`attach`)."""

    def __init__(self, level: int = logging.WARNING) -> None:
        super().__init__(level)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())

    def attach(self) -> "LogLines":
        logging.getLogger("tide_triton").addHandler(self)
        return self

    def detach(self) -> None:
        logging.getLogger("tide_triton").removeHandler(self)
