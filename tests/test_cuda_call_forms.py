"""The CUDA transport's hot-path driver calls, in the exact forms it makes them, accepted by
cuda-python -- without a GPU.  A stub ``libcuda.so.1`` (compiled here; every entry point
returns CUDA_SUCCESS) stands in for the driver, so cuda-python parses and converts every
argument (lists of CUdeviceptr, memop structs, stream handles) as it would on a GPU; a wrong
type or count fails here instead of on the first GPU run.  Runs in a subprocess: the loader
reads LD_LIBRARY_PATH at process start."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("cuda.bindings.driver")

STUB = r"""
#include <string.h>
typedef int CUresult;
static CUresult generic(void) { return 0; }
static CUresult drvver(int* v) { if (v) *v = 13000; return 0; }
static CUresult errname(int e, const char** s) { if (s) *s = "CUDA_SUCCESS"; return 0; }
static void* pick(const char* s) {
  if (!strcmp(s, "cuDriverGetVersion")) return (void*)drvver;
  if (!strcmp(s, "cuGetErrorName") || !strcmp(s, "cuGetErrorString")) return (void*)errname;
  return (void*)generic;
}
CUresult cuGetProcAddress_v2(const char* s, void** f, int v, unsigned long long fl, int* st) {
    *f = pick(s); if (st) *st = 0; return 0; }
CUresult cuGetProcAddress(const char* s, void** f, int v, unsigned long long fl) { *f = pick(s); return 0; }
CUresult cuDriverGetVersion(int* v) { return drvver(v); }
CUresult cuInit(unsigned f) { return 0; }
CUresult cuGetErrorName(int e, const char** s) { return errname(e, s); }
CUresult cuGetErrorString(int e, const char** s) { return errname(e, s); }
"""

SCRIPT = r"""
import contextlib, sys, threading
from cuda.bindings import driver as cu
from tide_triton.transport.signals import CopyEngine, HiddenWords
from tide_triton.transport.vmm import VmmHeap
from tide_triton.transport.driver import Transaction

t = object.__new__(CopyEngine)             # no constructor: no torch.cuda on this machine
t._cu, t._guard, t.rank, t.local_size, t.n_flags = cu, contextlib.nullcontext(), 0, 4, 64
t.copy_stream_int, t.streams_used, t._pending, t._tls, t.rank_offset = 0x5000, set(), {}, threading.local(), 0
t._waits_into = None
t.copy_graphs, t._graphs, t._capture_handle = "off", {}, None
t.words = HiddenWords(0, 32, 4096)
t.own_va = 0x7f0000000000
t.bases = [0x7f0000000000 + r * (1 << 36) for r in range(4)]
t.WRITE = int(cu.CUstreamWriteValue_flags.CU_STREAM_WRITE_VALUE_DEFAULT)
t.GEQ = int(cu.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_GEQ)
t._WAIT_OP = cu.CUstreamBatchMemOpType.CU_STREAM_MEM_OP_WAIT_VALUE_64
t._WRITE_OP = cu.CUstreamBatchMemOpType.CU_STREAM_MEM_OP_WRITE_VALUE_64
a = cu.CUmemcpyAttributes()
a.srcAccessOrder = cu.CUmemcpySrcAccessOrder.CU_MEMCPY_SRC_ACCESS_ORDER_STREAM
a.flags = cu.CUmemcpyFlags.CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE
t._attrs = [a]
base = 0x7f0000100000
dsts, srcs, sizes = [base + 4096 * i for i in range(300)], [base + (1 << 30) + 8 * i for i in range(300)], [8] * 300
sizes[7] = 0                               # dropped, as copy() drops empty pieces
for path in ("batch", "loop"):
    t.copy_path = path
    p = t.prepare_copies(dsts, srcs, sizes)
    assert len(p.nbytes) == 299 and len(p.dst_ptrs) == 299 and isinstance(p.dst_ptrs[0], cu.CUdeviceptr)
    t.copy_prepared(p)
# Prepared lists replayed as CUDA graphs: captured at the second use under "auto" (lists of
# >= 8 descriptors), at the first under "always"; a graph lives as long as its list.
import gc
from tide_triton.transport.signals import GRAPH_MIN_DESCRIPTORS
t._graphs, t._capture_handle = {}, None
t.copy_path = "batch"
for mode, uses_before_graph in (("auto", 1), ("always", 0)):
    t.copy_graphs = mode
    p = t.prepare_copies(dsts, srcs, sizes)
    for _ in range(uses_before_graph):
        t.copy_prepared(p)
        assert "graph" not in p.replay and t.graphs() == 0, (mode, p.replay)
    t.copy_prepared(p)
    assert p.replay.get("graph") is not None and t.graphs() == 1, (mode, p.replay)
    t.copy_prepared(p)                     # replayed: one cuGraphLaunch
    del p
    gc.collect()
    assert t.graphs() == 0                 # destroyed with its list
# warm_replays (a collective, before its flag waits) captures what the next use would replay
t.copy_graphs = "auto"
p = t.prepare_copies(dsts, srcs, sizes)
t.warm_replays([p, None])
assert "graph" not in p.replay                # never used: nothing to replay yet
t.copy_prepared(p)
t.warm_replays([p])
assert p.replay.get("graph") is not None and t.graphs() == 1
t.copy_prepared(p)                            # the warmed graph
del p
gc.collect()
assert t.graphs() == 0
n = GRAPH_MIN_DESCRIPTORS - 1
small = t.prepare_copies(dsts[:n], srcs[:n], [8] * n)
for _ in range(3):
    t.copy_prepared(small)
assert "graph" not in small.replay and t.graphs() == 0
t.copy_graphs = "always"
kept = t.prepare_copies(dsts, srcs, sizes)
t.copy_prepared(kept)
assert t.graphs() == 1
for key in list(t._graphs):
    t._drop_graph(key)
assert t.graphs() == 0
t.copy_graphs = "off"
for sig in ("direct", "copy"):
    t.signal_path = sig
    for batch in (True, False):
        t.memop_batch = batch
        t.wait_all([1, 2, 3], [5, 6, 7], peers=[1, 2, 3], timeout_s=1.0, what="rank {peer}")
        t.signal_all([1, 2, 3], [4, 4, 4], [9, 9, 9])
        t.signal(2, 3, 1 << 40)
        t.wait(3, 1 << 40, peer=1, timeout_s=1.0)
t._memops(t.copy_stream_int, [(t._WRITE_OP, base, 7, t.WRITE)] * 300, "write")  # > 255: two calls
assert set(t._pending) == {1, 2, 3}, t._pending
# A run recorded into a graph (tide_triton.run_graph): its waits go into the recording, not
# into the pending waits (nothing waits until a replay); each replay notes them as pending on
# the stream it was launched on -- what a stuck synchronize names.
before = dict(t._pending)
with t.recording_waits() as rec:
    t.memop_batch = True
    t.wait_all([7, 8], [3, 3], peers=[1, 2], timeout_s=1.0, what="rank {peer}'s block")
    t.memop_batch = False
    t.wait(9, 4, peer=3, timeout_s=1.0, what="rank 3's slot")
assert t._pending == before and t._waits_into is None, t._pending
assert rec == {7: (3, 1, 0x5000, "rank 1's block"), 8: (3, 2, 0x5000, "rank 2's block"),
               9: (4, 3, 0x5000, "rank 3's slot")}, rec
try:
    with t.recording_waits():
        with t.recording_waits():
            raise AssertionError("recording twice at once must raise")
except RuntimeError as e:
    assert "records waits already" in str(e), e
assert t._waits_into is None
t.copy_stream_int = 0x5100                  # the replay's stream (None: the copy stream)
t.note_waits(rec, None)
assert {k: t._pending[k] for k in (7, 8, 9)} == {k: (v, p, 0x5100, w) for k, (v, p, _s, w) in rec.items()}
t.copy_stream_int = 0x5000
for k in (7, 8, 9):
    del t._pending[k]
# The stream recordings are captured on: the rank's own (cuStreamCreate), made once.
import torch
made = []
torch.cuda.ExternalStream = lambda handle, device=None: made.append((handle, device)) or ("external", handle)
t._capture_handle = t._record_stream = None
t.device = "cuda:0"
first = t.recording_stream()
assert t.recording_stream() is first and len(made) == 1 and made[0][1] == "cuda:0", made
assert first == ("external", int(t._capture_handle)), (first, t._capture_handle)

# A close whose streams did not drain releases this rank's own pending flag waits: the short
# ones only (a GEQ counter below its value, an EQ identity word holding another value), with
# the value each wait expects -- never lowering a counter that is past it.
class Recording:
    def __init__(self, real):
        self.real, self.writes = real, []
    def __getattr__(self, name):
        f = getattr(self.real, name)
        if name == "cuStreamQuery":  # 0x5000 is still busy, every other stream idle
            return lambda s: (cu.CUresult(600 if int(s) == 0x5000 else 0),)
        if name != "cuStreamWriteValue64":
            return f
        def write(s, addr, value, flags):
            self.writes.append((int(addr), int(value)))
            return f(s, addr, value, flags)
        return write
t._cu = Recording(cu)
t._host_stream, t.host_stream_int = cu.CUstream(0x6000), 0x6000
t._pending = {1: (5, 1, 0x5000, ""), 2: (6, 2, 0x5000, ""), 3: (7, 3, 0x5000, ""), 4: (8, 3, 0x5000, ""),
              5: (9, 1, 0x5100, "")}
t._equal = {3, 4, 5}
cur = {1: 9, 2: 2, 3: 12, 4: 8, 5: 0}       # 1 passed; 2 short; 3 another identity; 4 passed;
                                            # 5 reset by its reader, on an idle stream: finished
t.read_flag = lambda slot: cur[slot]
import time
assert t.stuck_peers() == {2, 3}, t.stuck_peers()   # the peers of the short waits
# A stream stuck behind another stream's wait (the copy queue fenced behind a replay on the
# caller's stream) names that wait's peer, not "no pending flag wait is short".
from tide_triton.errors import PeerTimeoutError
try:
    t.raise_stuck(1.0, 0x5100)
except PeerTimeoutError as e:
    assert e.peer == 2, e
else:
    raise AssertionError("raise_stuck named no peer")
assert t.release_own_waits(time.monotonic() + 1.0) == 2
assert t._cu.writes == [(t.flag_addr(0, 2), 6), (t.flag_addr(0, 3), 7)], t._cu.writes
t._cu = cu

# Fences: one cuEventRecord + cuStreamWaitEvent on an event lent to the calling thread.  A
# thread that ends gives its event back (threads made per step add none); threads alive at
# once hold one each; close destroys every event made.
class Events:
    def __init__(self, real):
        self.real, self.made, self.destroyed = real, 0, []
    def __getattr__(self, name):
        if name == "cuEventCreate":
            def create(flags):
                self.made += 1
                return (cu.CUresult(0), cu.CUevent(0x9000 + self.made))
            return create
        if name == "cuEventDestroy":
            return lambda ev: self.destroyed.append(int(ev)) or (cu.CUresult(0),)
        return getattr(self.real, name)
t._cu = Events(cu)
t._events, t._free_events, t._events_lock = [], [], threading.Lock()
t._fence_what = ("cuEventRecord(rank=0, fence)", "cuStreamWaitEvent(rank=0, fence)")
t.stream_waits_for(0x5100, 0x5000)
t.stream_waits_for(0x5000, 0x5100)
assert t._cu.made == 1, t._cu.made
def fence():
    t.stream_waits_for(0x5100, 0x5000)
for _ in range(5):
    th = threading.Thread(target=fence)
    th.start()
    th.join()
gc.collect()
assert t._cu.made == 2 and len(t._free_events) == 1, (t._cu.made, t._free_events)
together = threading.Barrier(3)
def fence_together():
    fence()
    together.wait()
ths = [threading.Thread(target=fence_together) for _ in range(3)]
for th in ths:
    th.start()
for th in ths:
    th.join()
gc.collect()
assert t._cu.made == 4 and len(t._free_events) == 3, (t._cu.made, t._free_events)
t._destroy_events(lambda f, *a: f(*a))
assert sorted(t._cu.destroyed) == [0x9001, 0x9002, 0x9003, 0x9004] and not t._events, t._cu.destroyed
t._cu = cu

# Cross-device heap calls: one cuMemSetAccess with a descriptor per device that touches
# the mapping (the single-process mode over GPUs 0, 1, 2), and the peer-access query.
h = object.__new__(VmmHeap)
h._cu, h._guard, h.rank = cu, contextlib.nullcontext(), 0
h.H = cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
prop = cu.CUmemAllocationProp()
prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
prop.location.id = 0
prop.requestedHandleTypes = h.H
h._prop = prop
h.access_devices = (0, 1, 2)
h._access = h._access_descs(h.access_devices)
assert [d.location.id for d in h._access] == [0, 1, 2]
h.own_va, h.peer_va, h.peer_segments, h.segments, h.mapped = 0x7f0000000000, {1: 0x7f1000000000}, {1: []}, [], 0
with Transaction() as tx:
    handle = h.create_segment(0, 2 << 20, tx)
    h.import_segment(1, 5, 0, 2 << 20, tx)
    tx.commit()
ok = cu.cuDeviceCanAccessPeer(cu.CUdevice(0), cu.CUdevice(1))
assert int(ok[0]) == 0, ok
print("call forms ok")
"""


def test_hot_path_driver_call_forms_are_accepted(tmp_path: Path) -> None:
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler to build the stub driver")
    (tmp_path / "stub.c").write_text(STUB)
    subprocess.run([cc, "-shared", "-fPIC", "-O1", "-o", str(tmp_path / "libcuda.so.1"), str(tmp_path / "stub.c")],
                   check=True)
    env = dict(os.environ, LD_LIBRARY_PATH=f"{tmp_path}:{os.environ.get('LD_LIBRARY_PATH', '')}")
    root = Path(__file__).resolve().parents[1]
    env["PYTHONPATH"] = f"{root}:{env.get('PYTHONPATH', '')}"
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(SCRIPT)], env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0 and "call forms ok" in out.stdout, out.stdout + out.stderr
