"""transport/base.py's protocols are current: every transport class the executors use has
every member, with a signature that accepts every call the protocol allows (same positional
names in order, the keyword-only names, or ``**kw`` / ``*args`` that take them).  Structural,
on the classes, so the CUDA transport is checked without a GPU; plus a runtime
``isinstance`` on a live host transport and a GlobalRanks around it."""
from __future__ import annotations

import inspect

import pytest

from tide_triton.transport.base import DeviceTransport, Transport
from tide_triton.transport.cuda import CudaTransport
from tide_triton.transport.host import HostTransport
from tide_triton.transport.node_view import GlobalRanks


def _members(proto: type) -> dict[str, object]:
    out = {}
    for klass in proto.__mro__:
        if klass in (object,) or not getattr(klass, "_is_protocol", False):
            continue
        for name, value in vars(klass).items():
            if not name.startswith("_") and name not in out:
                out[name] = value
        for name in getattr(klass, "__annotations__", {}):
            out.setdefault(name, None)
    return out


def _accepts(impl: inspect.Signature, proto: inspect.Signature) -> list[str]:
    """What of ``proto``'s calls ``impl`` would refuse."""
    P = inspect.Parameter
    ip = [p for n, p in impl.parameters.items() if n != "self"]
    pp = [p for n, p in proto.parameters.items() if n != "self"]
    var_kw = any(p.kind is P.VAR_KEYWORD for p in ip)
    var_pos = any(p.kind is P.VAR_POSITIONAL for p in ip)
    by_name = {p.name: p for p in ip}
    positional = [p for p in ip if p.kind in (P.POSITIONAL_ONLY, P.POSITIONAL_OR_KEYWORD)]
    bad = []
    for i, p in enumerate(q for q in pp if q.kind in (P.POSITIONAL_ONLY, P.POSITIONAL_OR_KEYWORD)):
        if i < len(positional):
            if positional[i].name != p.name:
                bad.append(f"positional {i} is {positional[i].name!r}, protocol {p.name!r}")
        elif not var_pos:
            bad.append(f"takes no positional {p.name!r}")
    for p in pp:
        if p.kind is P.KEYWORD_ONLY and p.name not in by_name and not var_kw:
            bad.append(f"takes no keyword {p.name!r}")
        if p.default is not P.empty and p.name in by_name and by_name[p.name].default is P.empty \
                and by_name[p.name].kind is not P.VAR_KEYWORD:
            bad.append(f"{p.name!r} has no default")
    for q in ip:  # required parameters the protocol does not pass
        if q.default is P.empty and q.kind in (P.POSITIONAL_OR_KEYWORD, P.KEYWORD_ONLY) \
                and q.name not in proto.parameters:
            bad.append(f"requires {q.name!r}, which the protocol does not pass")
    return bad


def _problems(cls: type, proto: type, delegate: type | None = None) -> list[str]:
    out = []
    for name, member in _members(proto).items():
        impl = inspect.getattr_static(cls, name, None)
        if impl is None and delegate is not None:  # GlobalRanks forwards to its inner transport
            impl = inspect.getattr_static(delegate, name, None)
        if impl is None:
            if member is None:  # a data attribute: set in __init__, checked at runtime below
                continue
            out.append(f"{cls.__name__} has no {name}")
            continue
        if callable(member) and not isinstance(member, property) and callable(impl):
            why = _accepts(inspect.signature(impl), inspect.signature(member))
            out += [f"{cls.__name__}.{name}: {w}" for w in why]
    return out


@pytest.mark.parametrize("cls, proto, delegate", [
    (HostTransport, Transport, None),
    (CudaTransport, Transport, None),
    (CudaTransport, DeviceTransport, None),
    (GlobalRanks, Transport, HostTransport),
    (GlobalRanks, DeviceTransport, CudaTransport),
], ids=["host", "cuda", "cuda-device", "global-host", "global-cuda"])
def test_transports_satisfy_the_protocol(cls, proto, delegate) -> None:
    assert _problems(cls, proto, delegate) == []


def test_the_check_catches_a_stale_signature() -> None:
    class Stale(HostTransport):
        def wait(self, slot, value, peer, timeout_s):  # positional peer, no stream / what
            return None

        def fence_to(self, stream, extra):
            return None

    bad = _problems(Stale, Transport)
    assert any("wait: takes no keyword 'stream'" in b for b in bad), bad
    assert any("fence_to: requires 'extra'" in b for b in bad), bad


def test_every_protocol_method_has_a_docstring() -> None:
    for proto in (Transport, DeviceTransport):
        for name, member in vars(proto).items():
            if not name.startswith("_") and (callable(member) or isinstance(member, property)):
                assert (member.__doc__ or "").strip(), f"{proto.__name__}.{name} has no docstring"


def test_live_host_transport_and_its_global_view_are_transports() -> None:
    t = HostTransport(0, 1, lambda obj: [obj], n_flags=4)
    try:
        assert isinstance(t, Transport)
        assert not isinstance(t, DeviceTransport)  # no copy stream on the host
        view = GlobalRanks(t, 6)
        # Structural, not isinstance: Python 3.12's runtime protocols look attributes up
        # statically and do not see GlobalRanks' __getattr__ delegation.
        missing = [m for m in dir(Transport) if not m.startswith("_") and not hasattr(view, m)]
        assert not missing and view.rank == 6, missing
    finally:
        t.close()


def test_bound_transport_puts_every_wait_and_signal_on_its_stream_and_delegates_nothing() -> None:
    """The cross-node executor wraps its transport so that every operation lands on one
    stream: a method the wrapper does not pin would silently go to the transport's own copy
    stream (the call-identity wait did, and would not have ordered the data after it)."""
    from tide_triton.executors.work import bound

    seen: list = []

    class Recorder:
        def __getattr__(self, name):
            return lambda *a, **k: seen.append((name, k.get("stream")))

    w = bound(Recorder(), "side")
    for name in ("copy", "copy_prepared", "signal", "signal_all", "wait", "wait_all", "wait_all_equal"):
        getattr(w, name)()
    assert seen == [(n, "side") for n in ("copy", "copy_prepared", "signal", "signal_all", "wait", "wait_all",
                                          "wait_all_equal")]
    # no delegation by name: an operation it does not pin is not reachable through it
    assert not hasattr(w, "ensure_heap") and not hasattr(w, "warm_replays")
