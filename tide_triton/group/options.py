"""Options of a tide_triton group (:func:`tide_triton.init`, :func:`tide_triton.local_groups`):
one frozen, keyword-only dataclass, every field documented and checked on creation."""
from __future__ import annotations

from dataclasses import dataclass

from ..runtime import envs
from ..runtime.checks import is_int

RENAMED_OPTIONS = {"max_inflight_chunks": "host_ahead_chunks"}
"""Options that were renamed, old name to new: passing an old name raises ``TypeError``
naming the new one."""


@dataclass(frozen=True)
class GroupOptions:
    """Options of :func:`init` (keyword-only)."""

    timeout_s: float = 300.0
    """Longest wait on any peer before raising an error that names it."""
    ring_bytes: int = 256 << 20
    """Reduce-scatter receive staging per rank, whatever the world size or the layout.
    Measured on the H200 (Llama-3.1-70B layer, 2 ranks): 256 MiB takes 7 chunks and
    3.0 ms; 64 MiB takes 26 chunks and 9.9 ms, bound by the host's per-chunk enqueue work."""
    stages: int = 2
    """Stages of the receive ring: chunk j+1's copies overlap chunk j's accumulation."""
    max_ctas: int | None = None
    """CTA budget of the collectives' kernels (None: as many as the work has tiles)."""
    agree: str = "always"
    """``"always"``: every collective exchanges its signature and errors over the bootstrap
    group first, so bad arguments on one rank raise on every rank at once.  ``"first"``: only
    the first call with a given signature does; later ones start at once (training loops,
    where the same collectives repeat every step).  A rank whose arguments are bad then raises
    alone, at once, and publishes that it abandoned the call: its peers raise
    ``PeerArgumentError`` naming it (on the host transport within ~50 ms; on CUDA their
    stream waits cannot see it, so :func:`tide_triton.synchronize` or the next call raises
    it, by ``timeout_s`` at the latest).  Either way every collective carries its identity
    (call number and signature) to the peers before any data moves, so calls never pair
    with other calls."""
    rs_push: str | None = None
    """How a node-local reduce-scatter moves this rank's gradient slices into its peers' ring
    slots: ``"copy_engine"`` -- copy descriptors (no SMs; gradients allocated back to back
    merge into a few strided ones); ``"kernel"`` -- one launch of the segment kernel per
    round on the copy queue, reading the gradients' addresses from a device table (SMs,
    capped by ``max_ctas``; the host hands the driver one launch instead of a descriptor per
    piece); ``"auto"``: the kernel where a round holds more than
    :data:`tide_triton.executors.prepare.KERNEL_PUSH_MIN_PIECES` pieces (MoE layers: hundreds of
    parameters, whose gradients land at new, scattered addresses every step, so each step
    pays a descriptor per piece and parameter), else copy descriptors.  ``None`` (default):
    ``$TIDE_TRITON_RS_PUSH``, else ``"auto"`` -- resolved when the options are made, so the
    field always holds one of the three.  What the kernel pushes cost and save:
    docs/collectives.md.  This rank's own affair (its peers only see their slots and flags)."""
    host_ahead_chunks: int = 8
    """On one node: how many reduce-scatter chunks the host may enqueue ahead of the GPU
    (:class:`~tide_triton.group.parts.Pacer`; not ``inflight_chunks``, the chunks on the
    inter-node wire)."""
    chunk_bytes: int = 4 << 20
    """Across nodes: largest chunk on the inter-node wire (one send, gated on its signal)."""
    inflight_chunks: int = 2
    """Across nodes: chunks a rank may have on the inter-node wire at once; the wire's
    buffers are ``inflight_chunks * chunk_bytes`` per rank, whatever the number of nodes."""
    inter_node: str = "auto"
    """Across nodes on CUDA, how bytes cross: ``"put_signal"`` -- NCCL's one-sided
    ``ncclPutSignal`` into each rail peer's landing ring (a registered window of
    ``inflight_chunks * chunk_bytes``), ``ncclWaitSignal`` to pace it; copy engines on NVLink,
    NCCL's proxy on a network, no SMs.  ``"send_recv"`` -- grouped ``ncclSend`` / ``ncclRecv``
    (NCCL's kernels: uses SMs).  ``"auto"``: put/signal where the NCCL library and every
    rail support it, else send/recv (logged once).  ``"put_signal"`` where it is not
    supported raises, naming the rank and why."""
    nccl_library: str | None = None
    """Across nodes on CUDA: the libnccl to load (else ``$TIDE_TRITON_NCCL_LIBRARY``, the
    nvidia-nccl wheel, the system's; see :mod:`tide_triton.transport.nccl`)."""

    multicast: str = "off"
    """NVSwitch multicast for the node-local collectives (docs/multicast.md): ``"off"``
    (default: never asked of the driver), ``"auto"`` (used only where the guard passes --
    every rank's device reports multicast support, the node's ranks agree, no kill switch
    in the environment -- else the copy-engine path, logged once), ``"on"`` (raises on every
    rank, saying why, where the guard fails).  Never run on multicast hardware yet."""

    def __new__(cls, *args: object, **kwargs: object) -> "GroupOptions":
        # the dataclass __init__ would only say "unexpected keyword argument"
        for old, new in RENAMED_OPTIONS.items():
            if old in kwargs:
                raise TypeError(f"the group option {old!r} is now called {new!r}: pass {new}={kwargs[old]!r}")
        return super().__new__(cls)

    def __post_init__(self) -> None:
        if self.rs_push is None:
            object.__setattr__(self, "rs_push", envs.rs_push())
        elif self.rs_push not in envs.RS_PUSH_CHOICES:
            raise ValueError(f"rs_push must be 'auto', 'copy_engine' or 'kernel', got {self.rs_push!r}")
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")
        if not is_int(self.ring_bytes) or self.ring_bytes < 256:
            raise ValueError(f"ring_bytes must be an int >= 256, got {self.ring_bytes!r}")
        if not is_int(self.stages) or self.stages < 1:
            raise ValueError(f"stages must be an int >= 1, got {self.stages!r}")
        if self.agree not in ("always", "first"):
            raise ValueError(f'agree must be "always" or "first", got {self.agree!r}')
        if not is_int(self.host_ahead_chunks) \
                or self.host_ahead_chunks < 1:
            raise ValueError(f"host_ahead_chunks must be an int >= 1, got {self.host_ahead_chunks!r}")
        if not is_int(self.chunk_bytes) or self.chunk_bytes < 16:
            raise ValueError(f"chunk_bytes must be an int >= 16, got {self.chunk_bytes!r}")
        if not is_int(self.inflight_chunks) \
                or self.inflight_chunks < 1:
            raise ValueError(f"inflight_chunks must be an int >= 1, got {self.inflight_chunks!r}")
        if self.inter_node not in ("auto", "put_signal", "send_recv"):
            raise ValueError(f'inter_node must be "auto", "put_signal" or "send_recv", got {self.inter_node!r}')
        if self.nccl_library is not None and not isinstance(self.nccl_library, str):
            raise TypeError(f"nccl_library must be None or a path (str), got {type(self.nccl_library).__name__}")
        if self.max_ctas is not None and (not is_int(self.max_ctas)
                                          or self.max_ctas < 1):
            raise ValueError(f"max_ctas must be None or an int >= 1, got {self.max_ctas!r}")
        if self.multicast not in ("off", "auto", "on"):
            raise ValueError(f'multicast must be "off", "auto" or "on", got {self.multicast!r}')
