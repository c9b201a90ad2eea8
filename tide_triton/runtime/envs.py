"""Every environment variable tide_triton reads, documented in one place, with one reader each.

Readers are functions, not module constants: they read ``os.environ`` when called, so a
variable set after import (a test's ``monkeypatch.setenv``, a launcher) is seen.  Callers
read a variable where the decision is made (a transport at creation, a communicator at
close), never at import -- except :func:`use_interpreter_if_no_gpu`, which must run before
Triton decorates the kernels.

Variables of the package
========================

``TIDE_TRITON_NCCL_LIBRARY``
    Path of the ``libnccl.so.2`` the inter-node hop loads (after an explicit
    ``GroupOptions.nccl_library``, before the nvidia-nccl wheel and the system loader).  An
    NCCL >= 2.30 is needed for several ranks per GPU.  (:mod:`tide_triton.transport.nccl`)
``TIDE_TRITON_NCCL_CLOSE_DEADLINE_S``
    Seconds a communicator's close (window deregistration and destroy, which wait for the
    other members) may take before an error names the rank and the members and the
    communicator is left to process exit; default 60.  (:mod:`tide_triton.transport.nccl`)
``TIDE_TRITON_RS_PUSH``
    ``GroupOptions.rs_push`` for groups made without it: ``auto`` (default), ``copy_engine``
    or ``kernel`` -- how a reduce-scatter pushes its slices (copy descriptors, or the segment
    kernel on SMs), so a training job can be run both ways without a code change.  An
    explicit option wins.  Read when a group's options are made.  (:mod:`tide_triton.group.options`)
``TIDE_TRITON_COPY_GRAPHS``
    When the CUDA transport replays a prepared copy list as one CUDA graph launch
    (``cuGraphLaunch`` of the list captured once) instead of enqueueing its descriptors:
    ``auto`` (default: from a list's second use, for lists of at least 8 descriptors --
    a reused list is FSDP2's steady state; a one-off list never pays the capture),
    ``always`` (from the first use, any list: the tests' setting), ``off``.  Where several
    ranks of one process drive the GPU (the single-process mode) ``auto`` is ``off``: an
    instantiation while peers' streams waited deadlocked there (``graphs_in_process``).
    (:mod:`tide_triton.transport.copy_graphs`)
``TIDE_TRITON_RUN_GRAPHS``
    Which prepared collectives replay an eager-launched run as one recorded graph (a CUDA
    graph on a GPU, a host graph on the host transport), from the second run on a set of
    addresses (a one-off set never pays the recording): ``auto`` (default) and ``all``:
    all-gathers and reduce-scatters; ``all-gathers``: those only;
    ``off``: none, every run enqueues its operations.  Read when a collective is prepared.
    On a GPU driven by several ranks of one process (the single-process mode) ``auto`` is
    ``off``: instantiating a recording while peers' streams waited deadlocked the process
    there (``graphs_in_process``).
    (:mod:`tide_triton.executors.recorded`; the measurements behind the default:
    docs/benchmarks.md#recorded-against-op-by-op)
``TIDE_TRITON_MULTICAST``
    Kill switch of NVSwitch multicast: ``0`` keeps every group on the copy-engine path,
    whatever ``GroupOptions.multicast`` says (``"on"`` then raises, saying so).  Any other
    value, or unset, leaves the decision to the option and the guard.  The benchmarks'
    environment sets it to ``0``.  (:mod:`tide_triton.transport.multicast`)
``TIDE_TRITON_CPU_KERNELS``
    How the kernels run on CPU tensors: ``torch`` (default) runs each launch as plain torch
    ops on views of the tensors, exact and equal to the kernels bit for bit (the same fp32
    summation order, bf16 rounded to nearest even); ``interpret`` runs the Triton kernels
    through Triton's interpreter (the kernels' own tests), which needs ``TRITON_INTERPRET=1``
    before the kernels are defined -- set for you when no CUDA device exists and this
    variable says ``interpret`` at import.  Read when a kernel binding is made.
    (:mod:`tide_triton.kernels.segments`)

Switches that exist only for the tests and benchmarks are module attributes they set directly
(``monkeypatch.setattr``), not variables: ``transport.host.COPY_QUEUE`` and
``COPY_QUEUE_JITTER_S``, ``transport.nccl.CLOSE``, ``transport.cuda.AUTO_COPY_MODE``,
``transport.flags.MEMOP_BATCH``, ``kernels.segments.JIT_LAUNCH``.  The user's table:
docs/environment.md.

Variables of other software, as the package reads them
=======================================================

``TRITON_INTERPRET``
    Triton's own switch: kernels run through its CPU interpreter on CPU tensors.  Triton
    reads it when ``@triton.jit`` decorates a kernel; the package reads it to tell which
    tensors a launch accepts (:func:`triton_interpret`), and sets it when no GPU exists and
    ``TIDE_TRITON_CPU_KERNELS=interpret`` (:func:`use_interpreter_if_no_gpu`).
``CUDA_DEVICE_MAX_CONNECTIONS``
    The driver's number of hardware queues per device, read when the CUDA context is
    created; the single-process mode needs it >= 2 x ranks.  Read and set by
    :mod:`tide_triton.group.core` (:func:`cuda_device_max_connections` reads it).
``CUDA_MODULE_LOADING``
    The driver's module loading, read once at ``cuInit`` (``torch.cuda.is_available()``
    already calls it): ``LAZY`` (torch's default) loads a kernel at its first launch, which
    can synchronize the context -- in the single-process mode that deadlocks ranks whose
    streams wait on each other, so its CUDA transport refuses lazy loading with several
    ranks (set ``EAGER`` before the process touches CUDA).  Read by :mod:`tide_triton.group.core`
    (:func:`cuda_module_loading` reads it).
``NCCL_NVLS_ENABLE``
    NCCL's switch for NVLink SHARP (its own use of multicast objects); ``0`` is honoured by
    tide_triton as a second kill switch of multicast (:func:`nccl_nvls_enabled`).
``TORCH_SYMM_MEM_DISABLE_MULTICAST``
    PyTorch symmetric memory's switch; ``1`` is honoured by tide_triton as a third kill
    switch of multicast (:func:`torch_symm_mem_multicast_disabled`).
``LOCAL_WORLD_SIZE``
    torchrun's ranks per node: the default node size of a group.  Read by
    :mod:`tide_triton.plan.topology` (:func:`local_world_size` reads it).
"""
from __future__ import annotations

import logging
import os
from typing import Mapping

import torch

log = logging.getLogger("tide_triton")

NCCL_LIBRARY = "TIDE_TRITON_NCCL_LIBRARY"
RS_PUSH = "TIDE_TRITON_RS_PUSH"
MULTICAST = "TIDE_TRITON_MULTICAST"
CPU_KERNELS = "TIDE_TRITON_CPU_KERNELS"

_COPY_GRAPHS = ("auto", "always", "off")
_RUN_GRAPHS = ("auto", "all", "all-gathers", "off")
RS_PUSH_CHOICES = ("auto", "copy_engine", "kernel")
CPU_KERNELS_CHOICES = ("torch", "interpret")


def _choice(name: str, default: str, allowed: tuple[str, ...], env: Mapping[str, str] | None) -> str:
    raw = (os.environ if env is None else env).get(name)
    if raw is None or raw.strip() == "":
        return default
    value = raw.strip()
    if value not in allowed:
        raise ValueError(f"${name} must be one of {allowed}, got {raw!r}; unset it for {default!r}")
    return value


def nccl_library(env: Mapping[str, str] | None = None) -> str | None:
    """``$TIDE_TRITON_NCCL_LIBRARY`` (a path), or None when unset or empty."""
    raw = (os.environ if env is None else env).get(NCCL_LIBRARY)
    return raw if raw else None


def rs_push(env: Mapping[str, str] | None = None) -> str:
    """``$TIDE_TRITON_RS_PUSH``: ``"auto"`` (default), ``"copy_engine"`` or ``"kernel"``."""
    return _choice(RS_PUSH, "auto", RS_PUSH_CHOICES, env)


def copy_graphs(env: Mapping[str, str] | None = None, *, ranks_in_process: int = 1) -> str:
    """``$TIDE_TRITON_COPY_GRAPHS``: ``"auto"`` (default), ``"always"`` or ``"off"`` -- as in
    effect for a rank of a GPU group whose process drives ``ranks_in_process`` of its ranks
    (:func:`graphs_in_process`)."""
    return graphs_in_process("TIDE_TRITON_COPY_GRAPHS", _choice("TIDE_TRITON_COPY_GRAPHS", "auto", _COPY_GRAPHS, env),
                             ranks_in_process)


def run_graphs(env: Mapping[str, str] | None = None, *, ranks_in_process: int = 1) -> str:
    """``$TIDE_TRITON_RUN_GRAPHS``: ``"auto"`` (default), ``"all"``, ``"all-gathers"`` or ``"off"``
    -- as in effect for a rank of a GPU group whose process drives ``ranks_in_process`` of its
    ranks (:func:`graphs_in_process`; the host transport's host graphs pass 1)."""
    return graphs_in_process("TIDE_TRITON_RUN_GRAPHS", _choice("TIDE_TRITON_RUN_GRAPHS", "auto", _RUN_GRAPHS, env),
                             ranks_in_process)


_warned_in_process: set[str] = set()


def graphs_in_process(name: str, value: str, ranks_in_process: int) -> str:
    """The one rule for the graphs tide_triton makes by itself (copy lists at their second use,
    prepared runs at a set of addresses' second run), where one process drives several ranks of
    a GPU group (the single-process mode): ``auto`` makes none there, and any other value but
    ``off`` is kept with a warning (once per variable).  Such a graph is instantiated in the
    middle of the ranks' calls, while peers' streams wait for this rank's next flags; on the
    H200 (driver 580) that stopped every rank thread inside driver calls -- ``cuGraphInstantiate``,
    ``capture_end``, ``cuEventRecord``, flag reads -- where no deadline can fire (copy graphs at
    W=4, recordings at W=8; docs/constraints.md#graphs-made-while-peers-wait).  One rank per
    process: ``value``."""
    if ranks_in_process <= 1 or value == "off":
        return value
    if value == "auto":
        return "off"
    if name not in _warned_in_process:
        _warned_in_process.add(name)
        log.warning("tide_triton: %s=%s with %d ranks in this process: making such a graph while peers' streams "
                    "wait for this rank has deadlocked the process on the H200 (no deadline fires inside a driver "
                    "call); the default (auto) makes none in this mode", name, value, ranks_in_process)
    return value


def nccl_close_deadline_s(env: Mapping[str, str] | None = None) -> float:
    """``$TIDE_TRITON_NCCL_CLOSE_DEADLINE_S`` (default 60)."""
    return _non_negative("TIDE_TRITON_NCCL_CLOSE_DEADLINE_S", 60.0, "seconds", env)


def _non_negative(name: str, default: float, unit: str, env: Mapping[str, str] | None) -> float:
    raw = (os.environ if env is None else env).get(name, "").strip()
    try:
        value = float(raw) if raw else default
    except ValueError:
        raise ValueError(f"${name} must be a number of {unit}, got {raw!r}") from None
    if value < 0:
        raise ValueError(f"${name} must be >= 0, got {raw!r}")
    return value


def triton_interpret(env: Mapping[str, str] | None = None) -> bool:
    """True when ``$TRITON_INTERPRET`` is set to something other than ``""`` / ``"0"``:
    Triton's kernels then run through its CPU interpreter."""
    return (os.environ if env is None else env).get("TRITON_INTERPRET", "0") not in ("", "0")


def cpu_kernels(env: Mapping[str, str] | None = None) -> str:
    """``$TIDE_TRITON_CPU_KERNELS``: ``"torch"`` (default) or ``"interpret"`` -- how a kernel
    launch on CPU tensors runs."""
    return _choice(CPU_KERNELS, "torch", CPU_KERNELS_CHOICES, env)


_interpreter_decided = False


def use_interpreter_if_no_gpu() -> bool:
    """Without a CUDA device compiled Triton cannot run: where ``$TIDE_TRITON_CPU_KERNELS``
    asks for the interpreter, set ``TRITON_INTERPRET=1`` so the kernels run through it on CPU
    tensors (the default, ``torch``, needs no interpreter and sets nothing).  A value the user
    set is kept either way.  Called by :mod:`tide_triton.kernels` before its kernels are
    defined (Triton reads the variable then); what was decided is logged once.  Returns
    whether the interpreter is on afterwards."""
    global _interpreter_decided
    if not _interpreter_decided:
        if not torch.cuda.is_available():
            try:
                mode = cpu_kernels()
            except ValueError:  # raised where a kernel is bound, naming the value; import goes on
                mode = "torch"
            if mode == "interpret" and "TRITON_INTERPRET" not in os.environ:
                os.environ["TRITON_INTERPRET"] = "1"
            log.info("no CUDA device: kernels on CPU tensors run %s ($%s=%s)",
                     "through Triton's interpreter" if mode == "interpret" else "as plain torch",
                     CPU_KERNELS, mode)
    _interpreter_decided = True
    return triton_interpret()


def cuda_device_max_connections(env: Mapping[str, str] | None = None) -> str | None:
    """``$CUDA_DEVICE_MAX_CONNECTIONS`` as set (None when unset)."""
    return (os.environ if env is None else env).get("CUDA_DEVICE_MAX_CONNECTIONS")


def cuda_module_loading(env: Mapping[str, str] | None = None) -> str | None:
    """``$CUDA_MODULE_LOADING`` as set, upper-cased (None when unset)."""
    raw = (os.environ if env is None else env).get("CUDA_MODULE_LOADING")
    return None if raw is None else raw.strip().upper()


def local_world_size(env: Mapping[str, str] | None = None) -> int | None:
    """``$LOCAL_WORLD_SIZE`` (torchrun's ranks per node) as an int >= 1, None when unset
    or empty; ValueError naming the value otherwise."""
    raw = (os.environ if env is None else env).get("LOCAL_WORLD_SIZE")
    if raw is None or raw.strip() == "":
        return None
    try:
        n = int(raw.strip())
    except ValueError:
        raise ValueError(f"LOCAL_WORLD_SIZE must be an int, got {raw!r}") from None
    if n < 1:
        raise ValueError(f"LOCAL_WORLD_SIZE must be >= 1, got {n}")
    return n


def multicast_enabled(env: Mapping[str, str] | None = None) -> bool:
    """``$TIDE_TRITON_MULTICAST``: False when it is ``0`` (the kill switch), else True."""
    return (os.environ if env is None else env).get(MULTICAST, "").strip() != "0"


def nccl_nvls_enabled(env: Mapping[str, str] | None = None) -> bool:
    """``$NCCL_NVLS_ENABLE``: False when it is ``0``, else True (unset included)."""
    return (os.environ if env is None else env).get("NCCL_NVLS_ENABLE", "").strip() != "0"


def torch_symm_mem_multicast_disabled(env: Mapping[str, str] | None = None) -> bool:
    """``$TORCH_SYMM_MEM_DISABLE_MULTICAST``: True when it is ``1``."""
    return (os.environ if env is None else env).get("TORCH_SYMM_MEM_DISABLE_MULTICAST", "").strip() == "1"
