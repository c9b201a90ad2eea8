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
import torch
from tide_triton.transport.copies import Copies
from tide_triton.transport.copy_graphs import CopyGraphs
from tide_triton.transport.flags import Flags, HiddenWords
from tide_triton.transport.streams import RankStreams
from tide_triton.transport.waits import WaitLedger
from tide_triton.transport.vmm import VmmHeap
from tide_triton.transport.driver import Transaction

# The parts of one rank's CUDA transport, made by their own constructors on the stub driver
# (cuStreamCreate, cuMemAllocHost, the progress words' cuMemAlloc + cuMemsetD8Async + sync: the
# forms); torch's handle of the copy stream stands in (no torch.cuda on this machine).
torch.cuda.ExternalStream = lambda handle, device=None: ("external", handle)
guard, dev = contextlib.nullcontext(), torch.device("cuda", 0)
with Transaction() as tx:
    st = RankStreams(cu, guard, rank=0, local_size=4, device=dev, tx=tx)
st.copy_stream_int = 0x5000
st.progress._next, st.progress._end = 0x7e0000000000, 0x7e0000000000 + 4096  # the stub's pointer is 0
words = HiddenWords(0, 32, 4096)
own = 0x7f0000000000
w = WaitLedger(cu, guard, st, rank=0, own_flags=own + words.user_off)
f = Flags(cu, guard, st, w, rank=0, local_size=4, n_flags=64, own_va=own, words=words)
f.bases = [own + r * (1 << 36) for r in range(4)]
g = CopyGraphs(cu, guard, st, rank=0)
c = Copies(cu, guard, st, g, rank=0, device=dev)
a = cu.CUmemcpyAttributes()
a.srcAccessOrder = cu.CUmemcpySrcAccessOrder.CU_MEMCPY_SRC_ACCESS_ORDER_STREAM
a.flags = cu.CUmemcpyFlags.CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE
c._attrs = [a]
base = 0x7f0000100000
dsts, srcs, sizes = [base + 4096 * i for i in range(300)], [base + (1 << 30) + 8 * i for i in range(300)], [8] * 300
sizes[7] = 0                               # dropped, as copy() drops empty pieces
for path in ("batch", "loop"):
    c.copy_path = path
    p = c.prepare_copies(dsts, srcs, sizes)
    assert len(p.nbytes) == 299 and len(p.dst_ptrs) == 299 and isinstance(p.dst_ptrs[0], cu.CUdeviceptr)
    c.copy_prepared(p)
# Prepared lists replayed as CUDA graphs: captured at the second use under "auto" (lists of
# >= 8 descriptors), at the first under "always"; a graph lives as long as its list.
import gc
from tide_triton.transport.copy_graphs import GRAPH_MIN_DESCRIPTORS
g._graphs, st._capture_handle = {}, None
c.copy_path = "batch"
for mode, uses_before_graph in (("auto", 1), ("always", 0)):
    g.mode = mode
    p = c.prepare_copies(dsts, srcs, sizes)
    for _ in range(uses_before_graph):
        c.copy_prepared(p)
        assert "graph" not in p.replay and g.held() == 0, (mode, p.replay)
    c.copy_prepared(p)
    assert p.replay.get("graph") is not None and g.held() == 1, (mode, p.replay)
    c.copy_prepared(p)                     # replayed: one cuGraphLaunch
    del p
    gc.collect()
    assert g.held() == 0                 # destroyed with its list
# warm_replays (a collective, before its flag waits) captures what the next use would replay
g.mode = "auto"
p = c.prepare_copies(dsts, srcs, sizes)
g.warm_replays([p, None])
assert "graph" not in p.replay                # never used: nothing to replay yet
c.copy_prepared(p)
g.warm_replays([p])
assert p.replay.get("graph") is not None and g.held() == 1
c.copy_prepared(p)                            # the warmed graph
del p
gc.collect()
assert g.held() == 0
n = GRAPH_MIN_DESCRIPTORS - 1
small = c.prepare_copies(dsts[:n], srcs[:n], [8] * n)
for _ in range(3):
    c.copy_prepared(small)
assert "graph" not in small.replay and g.held() == 0
g.mode = "always"
kept = c.prepare_copies(dsts, srcs, sizes)
c.copy_prepared(kept)
assert g.held() == 1
for key in list(g._graphs):
    g._drop_graph(key)
assert g.held() == 0
g.mode = "off"
for sig in ("direct", "copy"):
    f.signal_path = sig
    for batch in (True, False):
        f.memop_batch = batch
        f.wait_all([1, 2, 3], [5, 6, 7], peers=[1, 2, 3], timeout_s=1.0, what="rank {peer}")
        f.signal_all([1, 2, 3], [4, 4, 4], [9, 9, 9])
        f.signal(2, 3, 1 << 40)
        f.wait(3, 1 << 40, peer=1, timeout_s=1.0)
f._memops(st.copy_stream_int, [(f._WRITE_OP, base, 7, f.WRITE)] * 300, "write")  # > 255: two calls
assert set(w._pending) == {1, 2, 3}, w._pending
# A run recorded into a graph (tide_triton.executors.recorded): its waits go into the recording, not
# into the pending waits (nothing waits until a replay); each replay notes them as pending on
# the stream it was launched on -- what a stuck synchronize names.
before = dict(w._pending)
with w.recording_waits() as rec:
    f.memop_batch = True
    f.wait_all([7, 8], [3, 3], peers=[1, 2], timeout_s=1.0, what="rank {peer}'s block")
    f.memop_batch = False
    f.wait(9, 4, peer=3, timeout_s=1.0, what="rank 3's slot")
assert w._pending == before and w._waits_into is None, w._pending
rw = rec[7][4]                              # the recording's own progress word (copy stream)
assert rw and rw not in {tr.word for tr in w._tracks.values()}, (rec, w._tracks)
assert rec == {7: (3, 1, 0x5000, "rank 1's block", rw, 1), 8: (3, 2, 0x5000, "rank 2's block", rw, 1),
               9: (4, 3, 0x5000, "rank 3's slot", rw, 2)}, rec
try:
    with w.recording_waits():
        with w.recording_waits():
            raise AssertionError("recording twice at once must raise")
except RuntimeError as e:
    assert "records waits already" in str(e), e
assert w._waits_into is None
st.copy_stream_int = 0x5100                 # the replay's stream (None: the copy stream)
w.note_waits(rec, None)
assert {k: w._pending[k] for k in (7, 8, 9)} == {k: (v, p, 0x5100, wt, word, seq)
                                                  for k, (v, p, _s, wt, word, seq) in rec.items()}
st.copy_stream_int = 0x5000
for k in (7, 8, 9):
    del w._pending[k]
# The stream recordings are captured on: the rank's own (cuStreamCreate), made once.
made = []
torch.cuda.ExternalStream = lambda handle, device=None: made.append((handle, device)) or ("external", handle)
st._capture_handle = st._record_stream = None
st.device = "cuda:0"
first = st.recording_stream()
assert st.recording_stream() is first and len(made) == 1 and made[0][1] == "cuda:0", made
assert first == ("external", int(st._capture_handle)), (first, st._capture_handle)

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
w._cu = Recording(cu)
st.host_stream, st.host_stream_int = cu.CUstream(0x6000), 0x6000
w._pending = {1: (5, 1, 0x5000, "", 0, 0), 2: (6, 2, 0x5000, "", 0, 0), 3: (7, 3, 0x5000, "", 0, 0),
              4: (8, 3, 0x5000, "", 0, 0), 5: (9, 1, 0x5100, "", 0, 0)}   # no progress words: the flags tell
w._equal = {3, 4, 5}
cur = {1: 9, 2: 2, 3: 12, 4: 8, 5: 0}       # 1 passed; 2 short; 3 another identity; 4 passed;
                                            # 5 reset by its reader, on an idle stream: finished
w.read_flag = lambda slot: cur[slot]
import time
assert w.stuck_peers() == {2, 3}, w.stuck_peers()   # the peers of the short waits
# A stream stuck behind another stream's wait (the copy queue fenced behind a replay on the
# caller's stream) names that wait's peer, not "no pending flag wait is short".
from tide_triton.errors import PeerTimeoutError
try:
    w.raise_stuck(1.0, 0x5100)
except PeerTimeoutError as e:
    assert e.peer == 2, e
else:
    raise AssertionError("raise_stuck named no peer")
assert w.release_own_waits(time.monotonic() + 1.0) == 2
assert w._cu.writes == [(f.flag_addr(0, 2), 6), (f.flag_addr(0, 3), 7)], w._cu.writes
w._cu = cu

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
st._cu = Events(cu)
st.stream_waits_for(0x5100, 0x5000)
st.stream_waits_for(0x5000, 0x5100)
assert st._cu.made == 1, st._cu.made
def fence():
    st.stream_waits_for(0x5100, 0x5000)
for _ in range(5):
    th = threading.Thread(target=fence)
    th.start()
    th.join()
gc.collect()
assert st._cu.made == 2 and len(st._free_events) == 1, (st._cu.made, st._free_events)
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
assert st._cu.made == 4 and len(st._free_events) == 3, (st._cu.made, st._free_events)
st._destroy_events(lambda fn, *a: fn(*a))
assert sorted(st._cu.destroyed) == [0x9001, 0x9002, 0x9003, 0x9004] and not st._events, st._cu.destroyed
st._cu = cu

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
st.progress.free_all()                      # cuMemFree of the progress words' chunk (at close)
assert st.progress.available() == 0 and not st.progress._chunks
print("call forms ok")
"""


PROGRESS_SCRIPT = r"""
# Progress words (tide_triton/transport/progress.py): every wait batch ends with a write of its
# sequence number into its stream's word, so a timeout and a close tell the waits that passed
# (a token word its reader reset reads "short" all the same) from the one a stream is stuck on.
import contextlib, time
import torch
from cuda.bindings import driver as cu
from tide_triton.errors import PeerTimeoutError
from tide_triton.transport.driver import Transaction
from tide_triton.transport.flags import Flags, HiddenWords
from tide_triton.transport.streams import RankStreams
from tide_triton.transport.waits import WaitLedger

WAIT_OP = cu.CUstreamBatchMemOpType.CU_STREAM_MEM_OP_WAIT_VALUE_64
NONE = cu.CUstreamCaptureStatus.CU_STREAM_CAPTURE_STATUS_NONE
ACTIVE = cu.CUstreamCaptureStatus.CU_STREAM_CAPTURE_STATUS_ACTIVE

class Driver:
    # The stub driver behind a log of every call (memop batches decoded into their operations);
    # streams in `busy` are not idle; `capturing` is what cuStreamIsCapturing answers.
    def __init__(self):
        self.calls, self.busy, self.capturing = [], set(), NONE
    def __getattr__(self, name):
        f = getattr(cu, name)
        if not name.startswith("cu"):
            return f
        if name == "cuStreamQuery":
            return lambda s: (cu.CUresult(600 if int(s) in self.busy else 0),)
        if name == "cuStreamIsCapturing":
            return lambda s: (cu.CUresult(0), self.capturing)
        if name == "cuStreamBatchMemOp":
            def batch(s, n, params, flags):
                ops = []
                for p in params[:n]:
                    if p.operation == WAIT_OP:
                        ops.append(("wait", int(p.waitValue.address), int(p.waitValue.value64)))
                    else:
                        ops.append(("write", int(p.writeValue.address), int(p.writeValue.value64)))
                self.calls.append((name, int(s), ops))
                return f(s, n, params, flags)
            return batch
        def logged(*a):
            self.calls.append((name, *[int(x) if isinstance(x, (int, cu.CUstream)) else x for x in a]))
            return f(*a)
        return logged

def engine(local_size=4):
    # One rank's streams, wait ledger and flags on the logged stub driver; streams are handles
    # here, and the host reads device words from `mem` (address -> value).
    drv = Driver()
    guard = contextlib.nullcontext()
    torch.cuda.ExternalStream = lambda handle, device=None: ("external", handle)  # no torch.cuda here
    with Transaction() as tx:
        st = RankStreams(drv, guard, rank=0, local_size=local_size, device=torch.device("cuda", 0), tx=tx)
    st.copy_stream_int = 0x5000
    st.host_stream, st.host_stream_int = cu.CUstream(0x6000), 0x6000
    st.progress._next, st.progress._end = 0x7e0000000000, 0x7e0000000000 + 4096  # a chunk (the stub's is 0)
    st.stream_int = lambda stream: st.copy_stream_int if stream is None else stream
    mem = {}
    st.read_words = lambda addr, n: [mem.get(addr + 8 * i, 0) for i in range(n)]
    words, own = HiddenWords(0, 32, 4096), 0x7f0000000000
    w = WaitLedger(drv, guard, st, rank=0, own_flags=own + words.user_off)
    f = Flags(drv, guard, st, w, rank=0, local_size=local_size, n_flags=64, own_va=own, words=words)
    f.bases = [own + r * (1 << 36) for r in range(local_size)]
    f.signal_path, f.memop_batch = "direct", True
    return f, w, drv, mem

def flag(f, slot):
    return f.flag_addr(f.rank, slot)

T = (7 << 32) | 1                              # a prepared collective's token

# (1) A timeout names the wait its stream is stuck on.  Rank 0 of 4 on one stream: batch 1 took
# the tokens of peers 1, 2 and 3 (slots 10..12) and its reader reset them to 0; batch 2 waits for
# slots 20..22, where peer 3's token never came; batch 3 (slot 5, lower than all) is behind it.
# Read from the host, slots 10..12 look short like slot 22 does; the progress word (1) says batch
# 1 passed and batch 2 is the earliest that did not.
f, w, drv, mem = engine()
f.wait_all([10, 11, 12], [T] * 3, peers=[1, 2, 3], timeout_s=1.0, equal=True, what="rank {peer}'s token (A)")
f.wait_all([20, 21, 22], [T] * 3, peers=[1, 2, 3], timeout_s=1.0, equal=True, what="rank {peer}'s token (B)")
f.wait_all([5], [T], peers=[1], timeout_s=1.0, equal=True, what="rank {peer}'s token (C)")
word = w._tracks[0x5000].word
assert [w._pending[sl][4:] for sl in (10, 20, 5)] == [(word, 1), (word, 2), (word, 3)], w._pending
mem[word] = 1                                  # batch 1 passed, batch 2 did not
mem[flag(f, 20)] = mem[flag(f, 21)] = T        # peers 1 and 2 did their part of batch 2
drv.busy.add(0x5000)
try:
    w.raise_stuck(1.0, 0x5000)
except PeerTimeoutError as e:
    assert e.peer == 3 and "rank 3's token (B)" in str(e), (e.peer, str(e))
else:
    raise AssertionError("raise_stuck named no peer")
assert w.stuck_peers() == {1, 3}, w.stuck_peers()  # 3 (batch 2), and 1 (batch 3, behind it)
try:                                           # the pacer's wait (no stream of its own): the same
    w.raise_stuck(1.0, None)
except PeerTimeoutError as e:
    assert e.peer == 3, e.peer
mem[word] = 3                                  # every batch passed: nothing short any more
try:
    w.raise_stuck(1.0, 0x5000)
except PeerTimeoutError as e:
    raise AssertionError(f"named rank {e.peer} for waits that passed")
except TimeoutError as e:
    assert "no pending flag wait is short" in str(e), e
mem[word] = 1

# (2) A close releases only the waits that did not pass: slot 22 (and slot 5, behind it), never
# the tokens of batch 1 (writing them again would leave a token nobody takes) nor slots 20, 21.
drv.calls.clear()
assert w.release_own_waits(time.monotonic() + 1.0) == 2
writes = [c[2:4] for c in drv.calls if c[0] == "cuStreamWriteValue64"]
assert writes == [(flag(f, 5), T), (flag(f, 22), T)], (writes, drv.calls)
assert all(c[1] == 0x6000 for c in drv.calls if c[0] == "cuStreamWriteValue64"), drv.calls

# (3) A recording: its waits use words of its own, one per stream (the branches of its graph run
# concurrently), numbered 1..k; its first node writes them to 0 (recording_started, right after
# the capture began), so each replay starts from 0.  The eager words and numbers are untouched.
f, w, drv, mem = engine()
f.wait_all([1, 2], [3, 3], peers=[1, 2], timeout_s=1.0)          # an eager batch on the copy stream
eager = w._tracks[0x5000].word
pending_before = dict(w._pending)
drv.calls.clear()
with w.recording_waits() as rec:
    f.recording_started(0x7000)                                   # the recording stream
    (name, stream, ops), = drv.calls                              # the graph's first node: both resets
    assert name == "cuStreamBatchMemOp" and stream == 0x7000, drv.calls
    assert [op[0] for op in ops] == ["write", "write"] and [op[2] for op in ops] == [0, 0], ops
    w_rec, w_copy = ops[0][1], ops[1][1]
    assert len({w_rec, w_copy, eager}) == 3, (w_rec, w_copy, eager)
    f.wait_all([30, 31], [T, T], peers=[1, 2], timeout_s=1.0, stream=0x7000, equal=True)
    f.wait_all([40], [T], peers=[1], timeout_s=1.0, equal=True)   # the copy stream, joined by a fence
    f.wait_all([41, 42], [T, T], peers=[2, 3], timeout_s=1.0, equal=True)
    f.wait(43, 9, peer=3, timeout_s=1.0, stream=0x7100)           # a stream that joined later
assert drv.calls[1] == ("cuStreamBatchMemOp", 0x7000, [("wait", flag(f, 30), T), ("wait", flag(f, 31), T),
                                                        ("write", w_rec, 1)]), drv.calls[1]
late = drv.calls[-1][2]
assert late[0][0] == "write" and late[0][2] == 0 and late[1] == ("wait", flag(f, 43), 9) and late[2][2] == 1, late
assert [rec[sl][4:] for sl in (30, 31, 40, 41, 42)] == [(w_rec, 1), (w_rec, 1), (w_copy, 1), (w_copy, 2),
                                                         (w_copy, 2)], rec
assert w._pending == pending_before and w._tracks[0x5000].seq == 1 and w._rec_tracks is None
# a replay (one launch: no driver call of the engine) notes them on the replay's stream; stuck at
# slot 31 (rank 2) while the copy branch's batch 1 passed and its token word was reset
drv.calls.clear()
w.note_waits(rec, 0x5100)
assert drv.calls == [] and w._pending[31] == (T, 2, 0x5100, "", w_rec, 1), w._pending[31]
mem[w_rec], mem[w_copy], mem[late[0][1]] = 0, 1, 1
mem[flag(f, 30)] = T
drv.busy.update({0x5000, 0x5100})
try:
    w.raise_stuck(1.0, 0x5100)
except PeerTimeoutError as e:
    assert e.peer == 2, e.peer                 # slot 40 (rank 1's reset token) lies lower, but passed
assert 1 not in {w.peer for w in w._short_waits() if w.slot == 40}

# Under a user's capture (torch.cuda.graph around a prepared run: the run's capture query said so)
# the waits get no progress word -- the graph would write its numbers at each of the user's replays
# -- and keep the old rule; the next query that says "not captured" ends it.
f, w, drv, mem = engine()
f.wait_all([1], [1], peers=[1], timeout_s=1.0)
drv.capturing = ACTIVE
assert w.stream_capturing(0x5000)
drv.calls.clear()
f.wait_all([2, 3], [T, T], peers=[1, 2], timeout_s=1.0, equal=True)
assert drv.calls == [("cuStreamBatchMemOp", 0x5000, [("wait", flag(f, 2), T), ("wait", flag(f, 3), T)])], drv.calls
assert w._pending[2][4:] == (0, 0) and w._tracks[0x5000].seq == 1, (w._pending, w._tracks)
drv.capturing = NONE
assert not w.stream_capturing(0x5000)
f.wait_all([2, 3], [T, T], peers=[1, 2], timeout_s=1.0, equal=True)
assert w._pending[2][4:] == (w._tracks[0x5000].word, 2), w._pending
# ... and so does the end of the captured run (user_capture_ended), without another query: the
# thread's eager waits after it are numbered again
drv.capturing = ACTIVE
assert w.stream_capturing(0x5000)
w.user_capture_ended()
f.wait_all([4], [T], peers=[3], timeout_s=1.0, equal=True)
assert w._pending[4][4:] == (w._tracks[0x5000].word, 3), w._pending

# (4) What a wait batch costs: its progress write rides in the same cuStreamBatchMemOp -- no
# driver call more per batch (nor at a stream's first batch: the words were allocated before);
# without batches, one cuStreamWriteValue64 more per batch.
f, w, drv, mem = engine()
drv.calls.clear()
f.wait_all([1, 2, 3], [5, 6, 7], peers=[1, 2, 3], timeout_s=1.0, stream=0x5200)
f.wait(4, 8, peer=1, timeout_s=1.0, stream=0x5200)
w = w._tracks[0x5200].word
assert drv.calls == [
    ("cuStreamBatchMemOp", 0x5200, [("wait", flag(f, 1), 5), ("wait", flag(f, 2), 6), ("wait", flag(f, 3), 7),
                                    ("write", w, 1)]),
    ("cuStreamBatchMemOp", 0x5200, [("wait", flag(f, 4), 8), ("write", w, 2)]),
], drv.calls
drv.calls.clear()
f.wait_all([i % 64 for i in range(255)], [1] * 255, peers=[1] * 255, timeout_s=1.0, stream=0x5200)  # 256 ops
assert [len(c[2]) for c in drv.calls] == [255, 1] and drv.calls[1][2] == [("write", w, 3)], drv.calls[1]
f.memop_batch = False
drv.calls.clear()
f.wait_all([1, 2, 3], [5, 6, 7], peers=[1, 2, 3], timeout_s=1.0, stream=0x5200)
assert [c[0] for c in drv.calls] == ["cuStreamWaitValue64"] * 3 + ["cuStreamWriteValue64"], drv.calls
assert drv.calls[-1][2:4] == (w, 4), drv.calls[-1]
# (5) A replay noted behind a stuck run (FSDP2's backward enqueues the next layer's replay without
# waiting): two recordings of the same slots, G1 stuck on rank 3, G2 noted after it -- its word still
# reads its last replay's count until its first node runs, so its waits read "passed".  G1's waits,
# replaced in the ledger by G2's, are kept aside: the timeout still names rank 3, and a close
# releases G1's missing token (not G2's, which would hide it from G1's exact-value wait).
f, w, drv, mem = engine()
T1, T2 = (7 << 32) | 1, (8 << 32) | 1
recs = {}
for name, tok in (("G1", T1), ("G2", T2)):
    with w.recording_waits() as rec:
        f.recording_started(0x7000)
        f.wait_all([20, 21, 22], [tok] * 3, peers=[1, 2, 3], timeout_s=1.0, stream=0x7000, equal=True,
                   what=name + ": rank {peer}'s contribution")
    recs[name] = rec
w1, w2 = recs["G1"][20][4], recs["G2"][20][4]
mem[w2] = 1                                    # G2's previous replay passed its batch
w.note_waits(recs["G1"], 0x5100)
mem[w1] = 0                                    # G1 reset its word and is stuck in batch 1
mem[flag(f, 20)] = mem[flag(f, 21)] = T1       # ranks 1 and 2 delivered, rank 3 never
drv.busy.add(0x5100)
w.note_waits(recs["G2"], 0x5100)
try:
    w.raise_stuck(1.0, 0x5100)
except PeerTimeoutError as e:
    assert e.peer == 3 and "G1: rank 3's contribution" in str(e), e
else:
    raise AssertionError("no PeerTimeoutError")
assert w.stuck_peers() == {3}, w.stuck_peers()
drv.calls.clear()
assert w.release_own_waits(time.monotonic() + 1.0) == 1
assert [c[2:4] for c in drv.calls if c[0] == "cuStreamWriteValue64"] == [(flag(f, 22), T1)], drv.calls
drv.busy.clear()
w.synchronize(timeout_s=1.0, stream=0x5100)    # idle: its waits, kept aside or not, leave the ledger
assert not w._pending and not w._superseded, (w._pending, w._superseded)

# the words are freed at close
freed = []
drv.cuMemFree = lambda p: freed.append(int(p)) or (cu.CUresult(0),)
w._streams.progress._chunks = [0x7e0000000000]
w._streams.progress.free_all()
assert freed == [0x7e0000000000] and w._streams.progress.available() == 0
print("progress words ok")
"""


def _run_on_stub(tmp_path: Path, script: str) -> subprocess.CompletedProcess:
    """``script`` in a fresh interpreter whose ``libcuda.so.1`` is the stub (skips without a C compiler)."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler to build the stub driver")
    if not (tmp_path / "libcuda.so.1").exists():
        (tmp_path / "stub.c").write_text(STUB)
        subprocess.run([cc, "-shared", "-fPIC", "-O1", "-o", str(tmp_path / "libcuda.so.1"),
                        str(tmp_path / "stub.c")], check=True)
    env = dict(os.environ, LD_LIBRARY_PATH=f"{tmp_path}:{os.environ.get('LD_LIBRARY_PATH', '')}")
    root = Path(__file__).resolve().parents[1]
    env["PYTHONPATH"] = f"{root}:{env.get('PYTHONPATH', '')}"
    return subprocess.run([sys.executable, "-c", textwrap.dedent(script)], env=env, capture_output=True, text=True,
                          timeout=120)


def test_hot_path_driver_call_forms_are_accepted(tmp_path: Path) -> None:
    out = _run_on_stub(tmp_path, SCRIPT)
    assert out.returncode == 0 and "call forms ok" in out.stdout, out.stdout + out.stderr


def test_progress_words_tell_passed_waits_from_the_stuck_one(tmp_path: Path) -> None:
    """Wait batches end with a progress write (in the same batch call); a timeout names the peer
    of the earliest unpassed batch, never one whose token wait passed and was reset; a close
    releases only unpassed waits; a recording's waits have words of their own, reset by its first
    node; a user's capture writes none.  Without progress words the timeout in (1) would name
    rank 1 (the lowest short slot: 5, behind the stuck batch -- without batch 3, slot 10, a token
    taken and reset) instead of rank 3, and the close would write slots 10..12 too."""
    out = _run_on_stub(tmp_path, PROGRESS_SCRIPT)
    assert out.returncode == 0 and "progress words ok" in out.stdout, out.stdout + out.stderr
