"""How many processes can hold a CUDA context on one GPU at once, by CUDA_DEVICE_MAX_CONNECTIONS.

A test run on the H200 saw context creation fail with "CUDA error: out of memory" while the GPU
had >100 GB free, when tests starting 2-8 processes each ran side by side.  This starts
processes one batch at a time, each creating its context on device 0 (driver API, no torch) and
holding it, until one fails or ``--max`` hold contexts; then every process is ended.
    python bench/context_limit.py [--max 96] [--connections 8 32] [--device 0]
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

_CHILD = r'''
import sys
from cuda.bindings import driver as cu
def ok(r, what):
    if int(r[0]) != 0:
        print(f"FAIL {what}: {cu.cuGetErrorName(r[0])[1].decode()}", flush=True); sys.exit(1)
    return r[1] if len(r) > 1 else None
ok(cu.cuInit(0), "cuInit")
dev = ok(cu.cuDeviceGet(int(sys.argv[1])), "cuDeviceGet")
ctx = ok(cu.cuDevicePrimaryCtxRetain(dev), "cuDevicePrimaryCtxRetain")
ok(cu.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
ok(cu.cuMemAlloc(1 << 20), "cuMemAlloc")          # the context is really created here
streams = [ok(cu.cuStreamCreate(1), "cuStreamCreate") for _ in range(4)]
print("OK", flush=True)
sys.stdin.read()
'''


def held_contexts(connections: int, limit: int, device: int, batch: int = 8) -> tuple[int, str]:
    env = dict(os.environ, CUDA_DEVICE_MAX_CONNECTIONS=str(connections))
    procs: list[subprocess.Popen] = []
    why = f"all {limit} held"
    try:
        while len(procs) < limit and why.startswith("all"):
            new = [subprocess.Popen([sys.executable, "-c", _CHILD, str(device)], env=env, text=True,
                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
                   for _ in range(min(batch, limit - len(procs)))]
            for p in new:
                line = p.stdout.readline().strip()
                if line != "OK":
                    why = f"process {len(procs) + 1}: {line or f'exit {p.wait()}'}"
                    break
                procs.append(p)
            else:
                continue
            for p in new:
                if p not in procs:
                    p.kill()
                    p.wait()
        return len(procs), why
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--max", type=int, default=96, help="stop at this many held contexts")
    ap.add_argument("--connections", type=int, nargs="+", default=[8, 32],
                    help="CUDA_DEVICE_MAX_CONNECTIONS values to try")
    ap.add_argument("--device", type=int, default=0)
    args = ap.parse_args()
    print("| CUDA_DEVICE_MAX_CONNECTIONS | contexts held at once | first failure | seconds |")
    print("|---|---|---|---|")
    for c in args.connections:
        t0 = time.monotonic()
        n, why = held_contexts(c, args.max, args.device)
        print(f"| {c} | {n} | {why} | {time.monotonic() - t0:.1f} |", flush=True)
        time.sleep(2)  # the driver takes the ended contexts back
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
