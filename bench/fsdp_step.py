"""FSDP2 training step: stock collectives vs tide_triton vs tide_triton + Slot-Reuse.

    torchrun --standalone --nproc-per-node 2 bench/fsdp_step.py --mode stock --backend nccl
    torchrun --standalone --nproc-per-node 2 bench/fsdp_step.py --mode tide
    torchrun --standalone --nproc-per-node 2 bench/fsdp_step.py --mode slot
    torchrun --standalone --nproc-per-node 2 bench/fsdp_step.py --dry-run --mode tide   # CPU, tiny

One process per rank, rank r on ``cuda:LOCAL_RANK % number of GPUs`` (the torchrun convention);
``--share-gpu`` puts every rank on cuda:0, as the recorded one-GPU runs did (several ranks per
GPU: NCCL needs >= 2.30 and ``NCCL_MULTI_RANK_GPU_ENABLE=1`` for ``--backend nccl``, a newer
NCCL given through ``LD_PRELOAD`` in the environment, never by replacing torch's files; gloo
works anywhere but moves CUDA tensors through the host).  The model (``--model``) is
``examples/train_llama.py``'s Llama with Llama-3.1-70B decoder layers (dim 8192, 64 query / 8
key-value heads, SwiGLU 28672: 855,654,400 parameters a layer, the shapes of
``shared/workloads/models.json``), or ``examples/train_moe.py``'s Qwen3-style MoE blocks at
Qwen3-30B-A3B's expert sizes (dim 2048, 32 query / 4 key-value heads, 128 SwiGLU experts of
hidden 768, top 8: 397 parameters a block, the many-parameter case), or
``examples/train_dit.py``'s DiT blocks at Wan2.2-14B's size (dim 5120, 40 heads, feed-forward
13824, biases, norms and a [1, 6, 5120] modulation: 27 parameters, 351,394,304 a block), stacked ``--layers``
deep, with a small vocabulary so that the blocks dominate.  FSDP2 as torchtitan wraps it (every block, then
the root), mixed precision bf16 parameters / fp32 reduce, AdamW.  Parameters are made on the
meta device and initialised shard by shard, so no rank ever holds the whole model.

Per rank, after ``--warmup`` steps:

* ``step ms``: median wall time of ``--steps`` steps (forward, backward, optimizer step), each
  ended by a device synchronisation;
* ``peak``, time-resolved per phase of every step (forward; backward; optimizer step and
  ``zero_grad``): torch's peak allocation within the phase (``max_memory_allocated`` after a
  ``reset_peak_memory_stats`` at its start) plus (tide) the VMM heap tide_triton has mapped
  outside torch's allocator during it (``tide_triton.fsdp.heap_bytes``: ring, Slot-Reuse slots,
  flags; sampled at the phase's ends, the larger of the two -- Slot-Reuse maps its slots at the
  forward's all-gathers and gives them back at the end of backward).  ``total`` is the largest
  phase sum; the torch and heap columns are their own maxima.  NCCL's own buffers are not counted
  there; ``device used / rank`` counts everything: the GPU's used memory
  (``torch.cuda.mem_get_info``: torch's reserved cache, the tide heap, NCCL's buffers, the CUDA
  contexts) sampled at every phase end, its maximum divided by the ranks on that GPU (an
  average per rank when ranks share it);
* ``FSDP2 host / module``: host time of FSDP2's own hooks per FSDP unit and step, from the
  profiled step (CPU time of the outermost ``FSDP::*`` ranges -- pre/post forward and backward,
  prefetches, the reduce-scatter; inflated by the profiler alike for every mode), where
  stock's and tide_triton's per-parameter work shows;
* the garbage collector's passes per measured step and their time (a pass over every object
  stops the host inside whatever hook allocates; no trace shows it).  The profiled step runs
  with the collector off: the profiler's records started ~2,900 passes (~3 s) in it, which
  inflated ``FSDP2 host / module`` wherever they landed;
* one more step under ``torch.profiler``: device time of FSDP2's layout copies (the ops
  ``fsdp::all_gather_copy_in``, ``fsdp::split_with_sizes_copy``, ``fsdp::chunk_cat`` and their
  aten forms), of NCCL kernels, of tide_triton's kernels, and of copy-engine memcpys.

Rank 0 prints one table row (rank max for time and memory) and appends it to ``--json``.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(_HERE)
for _p in (_ROOT, os.path.join(_ROOT, "examples")):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import torch  # noqa: E402

LAYOUT_OPS = ("fsdp::all_gather_copy_in", "fsdp::split_with_sizes_copy", "aten::split_with_sizes_copy",
              "fsdp::chunk_cat", "aten::_chunk_cat")


def _watch_binds(step_now) -> list:
    """``--why-binds``: every prepared run of the drop-in (``_Prepared._run_on``) logged as
    ``(step, collective, full side new, shard side new)`` -- "new" against every set of
    addresses that collective met before (bound or not), so a set that only recurs after
    eviction still counts as seen."""
    from tide_triton.executors.prepared import _Prepared

    log: list = []
    seen: dict = {}
    inner = _Prepared._run_on

    def run_on(self, first, second, **kw):
        full, shards = (first, second) if self._full_first else (second, first)
        sides = seen.setdefault(id(self), (set(), set()))
        keys = (tuple(t.data_ptr() for t in full), tuple(t.data_ptr() for t in shards))
        log.append((step_now(), self.name.split()[0], keys[0] not in sides[0], keys[1] not in sides[1]))
        sides[0].add(keys[0])
        sides[1].add(keys[1])
        return inner(self, first, second, **kw)

    _Prepared._run_on = run_on
    return log


def _print_binds(log: list, first_step: int) -> None:
    """Per measured step and collective: runs, and how many met new full tensors / new shards."""
    rows: dict = {}
    for step, name, new_full, new_shards in log:
        if step > first_step:
            r = rows.setdefault((step, name), [0, 0, 0])
            r[0] += 1
            r[1] += new_full
            r[2] += new_shards
    print("why-binds: (the watch reads every tensor's address per run: this run's step times include it)",
          flush=True)
    for (step, name), (n, nf, ns) in sorted(rows.items()):
        print(f"why-binds: step {step} {name}: {n} runs, new full tensors in {nf}, new shards in {ns}", flush=True)


def _host_profile(step, sync, path: str) -> None:
    """cProfile of one step (the host's Python: where FSDP2's per-module time goes)."""
    import cProfile
    import io
    import pstats

    pr = cProfile.Profile()
    pr.enable()
    step()
    sync()
    pr.disable()
    buf = io.StringIO()
    pstats.Stats(pr, stream=buf).sort_stats("cumulative").print_stats(40)
    with open(path, "w") as f:
        f.write(buf.getvalue())


def _profile_step(step, device: torch.device, trace: str | None = None) -> dict:
    """Device microseconds of one step by category (CPU: host microseconds of the layout ops);
    ``trace``: the profiler's Chrome trace of it into this file."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        step()
    if trace:
        prof.export_chrome_trace(trace)
    out = {"layout_copy_us": 0.0, "layout_copy_ops": {}, "nccl_us": 0.0, "tide_kernel_us": 0.0,
           "memcpy_us": 0.0, "kernel_us": 0.0, "fsdp_host_us": 0.0, "tide_ranges_us": {}}
    ranges = out["tide_ranges_us"]
    for e in prof.events():  # FSDP2's host ranges, outermost only (they nest: pre_forward > all_gather)
        if e.name.startswith("FSDP::") and not _inside_fsdp_range(e):
            out["fsdp_host_us"] += e.cpu_time_total
        elif e.name.startswith("tide_triton::"):  # tide_triton.runtime.profiling: preparation, host waits, copy graphs
            ranges[e.name] = ranges.get(e.name, 0.0) + e.cpu_time_total
    for e in prof.key_averages():
        if e.key in LAYOUT_OPS:
            us = e.device_time_total if device.type == "cuda" else e.cpu_time_total
            out["layout_copy_ops"][e.key] = out["layout_copy_ops"].get(e.key, 0.0) + us
    # The fsdp:: ops dispatch to their aten forms: count each kernel once, under the outermost op.
    ops = out["layout_copy_ops"]
    out["layout_copy_us"] = sum(v for k, v in ops.items() if k.startswith("fsdp::")) + sum(
        v for k, v in ops.items() if k.startswith("aten::") and f"fsdp::{k[6:].lstrip('_')}" not in ops)
    if device.type == "cuda":
        for e in prof.events():
            if getattr(e, "device_type", None) is None or str(e.device_type) != "DeviceType.CUDA":
                continue
            us = e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
            name = e.name
            if name.startswith(("Memcpy", "Memset")):
                out["memcpy_us"] += us
                continue
            out["kernel_us"] += us
            if name.startswith("nccl"):
                out["nccl_us"] += us
            elif "segmented" in name or "tide" in name:
                out["tide_kernel_us"] += us
    return out


def _inside_fsdp_range(e) -> bool:
    p = getattr(e, "cpu_parent", None)
    while p is not None:
        if p.name.startswith("FSDP::"):
            return True
        p = getattr(p, "cpu_parent", None)
    return False


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", choices=["stock", "tide", "slot", "prepared"], required=True,
                    help="prepared: tide_triton.fsdp.enable(model, prepared=True)")
    ap.add_argument("--backend", choices=["gloo", "nccl"], default="gloo",
                    help="process group for CUDA tensors (nccl: stock FSDP2's collectives run on NCCL)")
    ap.add_argument("--model", choices=["llama-3.1-70b", "qwen3-30b-a3b", "wan2.2-14b"], default="llama-3.1-70b",
                    help="decoder layers of Llama-3.1-70B, Qwen3-style MoE blocks (397 parameters each), or "
                         "Wan2.2-14B's DiT blocks (27 parameters each; examples/train_dit.py)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=1, help="sequences per rank")
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny model, Triton interpreter")
    ap.add_argument("--local-size", type=int, default=None,
                    help="declare nodes of this many ranks for tide_triton's groups (sets LOCAL_WORLD_SIZE "
                         "before enable(); stock FSDP2 is unaffected)")
    ap.add_argument("--chunk-mib", type=int, default=None,
                    help="one tide_triton group for every module, with this inter-node chunk (MiB)")
    ap.add_argument("--rs-push", default="auto", choices=["auto", "copy_engine", "kernel"],
                    help="tide modes: GroupOptions.rs_push (how the reduce-scatters push; auto: the kernel for MoE)")
    ap.add_argument("--share-gpu", action="store_true",
                    help="every rank on cuda:0 (default: rank on cuda:LOCAL_RANK %% number of GPUs)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--host-profile", default=None, metavar="FILE",
                    help="rank 0: cProfile of one more step, the 40 costliest functions by cumulative time into FILE")
    ap.add_argument("--why-binds", action="store_true",
                    help="--mode prepared: per measured step, how many runs met a new set of addresses, and "
                         "which side was new (the full tensors -- grads / params -- or the shards)")
    ap.add_argument("--fixed-routing", action="store_true",
                    help="qwen3-30b-a3b: the same experts per token every step (MoEConfig.fixed_routing): with "
                         "--why-binds, whether MoE gradients recur once the tokens per expert stop changing")
    ap.add_argument("--trace", default=None, metavar="FILE",
                    help="rank 0: the torch profiler's Chrome trace of the profiled step into FILE")
    args = ap.parse_args(argv)
    if args.fixed_routing and args.model != "qwen3-30b-a3b":
        ap.error("--fixed-routing applies to the MoE blocks (--model qwen3-30b-a3b)")
    if not args.dry_run and not torch.cuda.is_available():
        ap.error("no CUDA device is visible to torch: use --dry-run for the CPU check")
    if args.dry_run:
        os.environ.setdefault("TRITON_INTERPRET", "1")

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy

    import tide_triton
    from tide_triton.bench.measure import GcPasses, env_info
    from train_dit import DiT, DiTConfig
    from train_llama import Llama, LlamaConfig, batch, loss_fn, shard
    from train_moe import MoEConfig, MoEModel

    local = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cpu") if args.dry_run else torch.device(
        "cuda", 0 if args.share_gpu else local % torch.cuda.device_count())
    if device.type == "cuda":
        torch.cuda.set_device(device)
        dist.init_process_group("cuda:nccl,cpu:gloo" if args.backend == "nccl" else "gloo")
    else:
        dist.init_process_group("gloo")
    rank, W = dist.get_rank(), dist.get_world_size()
    moe, dit = args.model == "qwen3-30b-a3b", args.model == "wan2.2-14b"
    if args.dry_run:
        if dit:
            cfg = DiTConfig(vocab=64, dim=32, n_layers=2, n_heads=4, ffn=88, context=8)
        elif moe:
            cfg = MoEConfig(vocab=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, experts=8, top_k=2,
                            expert_hidden=24, fixed_routing=args.fixed_routing)
        else:
            cfg = LlamaConfig(vocab=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, hidden=88, tied=False)
        args.seq, args.steps, args.warmup = 16, 2, 1
    elif dit:
        cfg = DiTConfig.wan22_14b(args.layers, vocab=args.vocab)
    elif moe:
        cfg = MoEConfig(vocab=args.vocab, dim=2048, n_layers=args.layers, n_heads=32, n_kv_heads=4, experts=128,
                        top_k=8, expert_hidden=768, fixed_routing=args.fixed_routing)
    else:
        cfg = LlamaConfig(vocab=args.vocab, dim=8192, n_layers=args.layers, n_heads=64, n_kv_heads=8,
                          hidden=28672, tied=False)
    with torch.device("meta"):
        model = DiT(cfg) if dit else MoEModel(cfg) if moe else Llama(cfg)
    mesh = init_device_mesh(device.type, (W,))
    shard(model, mesh, MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
    model.to_empty(device=device)
    g = torch.Generator(device=device).manual_seed(1234 + rank)
    with torch.no_grad():
        for n, p in model.named_parameters():
            local = p.to_local()
            if n.split(".")[-1] == "weight" and "norm" in n.split(".")[-2]:  # norms' scales (DiT: norm_q, norm3)
                local.fill_(1.0)
            else:
                local.normal_(0.0, 0.02, generator=g)
    layer_numel = sum(p.numel() for p in model.layers[0].parameters())
    units = 1 + len(model.layers)  # fully_shard units: every block and the root
    if args.mode != "stock":
        if args.local_size:
            os.environ["LOCAL_WORLD_SIZE"] = str(args.local_size)  # read when enable() makes the groups
        group = None
        if args.chunk_mib or args.rs_push != "auto":
            extra = {"chunk_bytes": args.chunk_mib << 20} if args.chunk_mib else {}
            group = tide_triton.init(local_size=args.local_size, agree="first", rs_push=args.rs_push, **extra)
        report = tide_triton.fsdp.enable(model, group=group, slot_reuse=args.mode == "slot",
                                         prepared=args.mode == "prepared")
        if rank == 0:
            nodes = {st["nodes"] for st in tide_triton.fsdp.stats(model).values() if st is not None}
            print(f"tide_triton groups span {sorted(nodes)} node(s)", flush=True)
        stock = {k: v for k, v in report.items() if v is not None}
        if stock and rank == 0:
            print(f"stock path for: {stock}", flush=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    n_step = [0]
    binds_log = _watch_binds(lambda: n_step[0]) if args.why_binds else None

    cuda = device.type == "cuda"
    phases: list[dict] = []  # per measured step: {phase: (torch peak, heap mapped)}
    used: list[int] = []  # the GPU's used bytes at every measured phase end (every process on it)

    def device_used() -> int:
        if not cuda:
            return 0
        free, total = torch.cuda.mem_get_info(device)
        return total - free

    def heap_now() -> int:
        return tide_triton.fsdp.heap_bytes(model) if args.mode != "stock" else 0

    def step(record: bool = False) -> torch.Tensor:
        tokens = batch(cfg, n_step[0], rank, args.batch, args.seq, device)  # a new batch every step
        n_step[0] += 1
        marks = {}
        h0 = heap_now() if record else 0
        if record and cuda:
            torch.cuda.reset_peak_memory_stats()
        loss = loss_fn(model, tokens)
        for name, work in (("forward", None), ("backward", loss.backward), ("optimizer", opt.step)):
            if work is not None:
                work()
            if name == "optimizer":
                opt.zero_grad(set_to_none=True)
            if record:
                h1 = heap_now()
                marks[name] = (torch.cuda.max_memory_allocated() if cuda else 0, max(h0, h1))
                used.append(device_used())
                h0 = h1
                if cuda:
                    torch.cuda.reset_peak_memory_stats()
        if record:
            phases.append(marks)
        return loss

    def preparations() -> int:  # tide_triton collectives prepared so far (cache fills), all groups
        if args.mode == "stock":
            return 0
        from tide_triton.fsdp._torch_adapter import fsdp_modules, param_groups
        from tide_triton.fsdp.install import group_state

        states = [st for _, m in fsdp_modules(model) for pg in param_groups(m) if (st := group_state(pg)) is not None]
        groups = {id(st.group): st.group for st in states}
        # prepared collectives (--mode prepared): each new set of addresses bound counts as one
        binds = sum(p.binds for st in states for p in st.prepared.values())
        return sum(g.preparations for g in groups.values()) + binds

    for _ in range(args.warmup):
        step()
    sync()
    prep0 = preparations()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times = []
    gc_steps = GcPasses().start()  # the garbage collector's passes in the measured steps (no trace shows them)
    for _ in range(args.steps):
        sync()
        t0 = time.perf_counter()
        loss = step(record=True)
        sync()
        times.append(time.perf_counter() - t0)
    gc_steps.stop()
    prepared_per_step = (preparations() - prep0) / args.steps  # 0 in the steady state
    if binds_log is not None and rank == 0:
        _print_binds(binds_log, args.warmup)
    peak = max(a for marks in phases for a, _ in marks.values())
    reserved = torch.cuda.max_memory_reserved() if device.type == "cuda" else 0
    heap = max(h for marks in phases for _, h in marks.values())
    phase_peak = {name: max(m[name][0] + m[name][1] for m in phases) for name in phases[0]}
    # The profiler's own records start thousands of collector passes in that step (measured on
    # the H200: ~2,900 passes, 7 full, ~3 s per Qwen3 step in every mode), landing inside whichever
    # FSDP2 range allocates: the collector is off for the profiled step (counted; none expected).
    gc.collect()
    gc.disable()
    try:
        with GcPasses() as gc_prof:
            prof = _profile_step(step, device, args.trace if rank == 0 else None)
    finally:
        gc.enable()
    if args.host_profile and rank == 0:
        _host_profile(step, sync, args.host_profile)
    elif args.host_profile:
        step()
        sync()
    on_gpu = [None] * W
    dist.all_gather_object(on_gpu, (os.uname().nodename, device.index))
    sharing = on_gpu.count(on_gpu[rank])  # ranks whose memory mem_get_info also sees
    mine = {"step_ms": 1e3 * statistics.median(times), "step_ms_all": [1e3 * t for t in times],
            "device_used_per_rank": max(used, default=0) // sharing, "ranks_on_gpu": sharing,
            "prepared_per_step": prepared_per_step,
            "peak_allocated": peak, "peak_reserved": reserved, "tide_heap": heap,
            "peak_total": max(phase_peak.values()), "phase_peak_total": phase_peak,
            "phases": phases, "loss": float(loss.detach()),
            "gc_per_step": {"passes": gc_steps.count / args.steps, "full": gc_steps.full / args.steps,
                            "ms": 1e3 * gc_steps.seconds / args.steps},
            "gc_profiled_step": {"passes": gc_prof.count, "full": gc_prof.full, "ms": 1e3 * gc_prof.seconds}, **prof}
    rows = [None] * W
    dist.all_gather_object(rows, mine)
    if rank == 0:
        info = env_info(device)
        row = {"script": "fsdp_step", "model": args.model, "mode": args.mode, "rs_push": args.rs_push,
               "backend": args.backend, "world_size": W,
               "local_size": args.local_size if args.mode != "stock" else None, "chunk_mib": args.chunk_mib,
               "layers": cfg.n_layers, "layer_numel": layer_numel, "batch": args.batch, "seq": args.seq,
               "vocab": cfg.vocab, "ranks": rows, **info,
               "nccl_version": ".".join(map(str, torch.cuda.nccl.version())) if device.type == "cuda" else None,
               "step_ms": max(r["step_ms"] for r in rows),
               "peak_total_bytes": max(r["peak_total"] for r in rows),
               "peak_phase": max(rows[0]["phase_peak_total"], key=rows[0]["phase_peak_total"].get),
               "layout_copy_us": max(r["layout_copy_us"] for r in rows),
               "device_used_per_rank_bytes": max(r["device_used_per_rank"] for r in rows),
               "fsdp_host_us_per_module": max(r["fsdp_host_us"] for r in rows) / units,
               "prepared_per_step": max(r["prepared_per_step"] for r in rows)}
        mib = 1 << 20
        r0 = rows[0]
        wl = f"{W} ({W // args.local_size}x{args.local_size})" if row["local_size"] else f"{W}"
        print(f"| {args.mode} | {args.backend} | {wl} | {cfg.n_layers} | {row['step_ms']:.1f} | "
              f"{max(r['peak_allocated'] for r in rows) / mib:.0f} | {max(r['tide_heap'] for r in rows) / mib:.0f} | "
              f"{row['peak_total_bytes'] / mib:.0f} | {row['device_used_per_rank_bytes'] / mib:.0f} | "
              f"{row['layout_copy_us'] / 1e3:.2f} | {r0['nccl_us'] / 1e3:.2f} | "
              f"{r0['tide_kernel_us'] / 1e3:.2f} | {r0['memcpy_us'] / 1e3:.2f} | "
              f"{row['fsdp_host_us_per_module'] / 1e3:.2f} | {r0['loss']:.4f} |", flush=True)
        for r, rr in enumerate(rows):  # a pass over every object stops the host where no trace sees it
            a, b = rr["gc_per_step"], rr["gc_profiled_step"]
            print(f"rank {r}: garbage collector per measured step {a['passes']:.1f} passes ({a['full']:.1f} full), "
                  f"{a['ms']:.1f} ms; in the profiled step {b['passes']} ({b['full']} full), {b['ms']:.1f} ms",
                  flush=True)
        if args.mode != "stock":
            print(f"tide_triton collectives prepared per measured step (rank max; 0 in the steady state): "
                  f"{row['prepared_per_step']:g}", flush=True)
            for r, rr in enumerate(rows):  # where the host spent the profiled step inside tide_triton
                if rr.get("tide_ranges_us"):
                    print(f"rank {r}: tide_triton host ranges in the profiled step (ms): " + ", ".join(
                        f"{k.split('::', 1)[1]} {v / 1e3:.2f}" for k, v in sorted(rr["tide_ranges_us"].items())),
                          flush=True)
        if args.json:
            with open(args.json, "a") as f:
                f.write(json.dumps(row, default=str) + "\n")
    if device.type == "cuda" and args.mode != "stock":
        tide_triton.synchronize()
    # FSDP2's state (and the work objects it holds) goes before the process group: freed after
    # it, at interpreter exit, a rank aborted in ~1 of 9 CPU dry runs ("terminate called without
    # an active exception", stock FSDP2 on gloo too); 0 of 32 with this order.
    del model, opt, step
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()
    return 0


HEADER = ("| mode | backend | W | layers | step (ms, rank max) | torch peak / rank (MiB) | tide heap / rank (MiB) | "
          "total / rank (MiB) | device used / rank (MiB) | layout copies / step (ms) | NCCL kernels (ms, rank 0) | "
          "tide kernels (ms, rank 0) | memcpy (ms, rank 0) | FSDP2 host / module (ms, rank max) | loss |"
          "\n|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")

if __name__ == "__main__":
    from script_tools import script_main

    sys.exit(script_main(main, HEADER))
