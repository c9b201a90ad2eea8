#!/usr/bin/env bash
# One device call: FSDP2 drop-in on the GPU (processes sharing it), GEMM interference,
# memory, and a host backtrace of the teardown crash under cuda-gdb.  Logs land in $OUT.
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
RING=${RING:-268435456}
run() { local name=$1 limit=$2; shift 2; echo "=== $name"; timeout -k 10 "$limit" "$@" > "$OUT/$name.log" 2>&1; echo "rc=$?"; grep -E "^\||passed|failed|FAIL|rror|Timeout|Fatal|slowdown|SM time|#[0-9]+ " "$OUT/$name.log" | head -${LINES_MAX:-40}; }
run fsdp_gpu 170 python3 -X faulthandler -m pytest -q -p no:cacheprovider -p no:hypothesispytest tests/test_fsdp.py -k gpu -s
run interference 150 python3 -X faulthandler bench/interference.py --gemm-iters 50 --ring-bytes $RING --json "$OUT/interference.jsonl"
run memory 100 python3 bench/memory.py --models llama-3.1-70b --world-sizes 2 4 8 --ring-bytes $RING --json "$OUT/memory.jsonl"
run gdb 100 cuda-gdb -q -batch -ex "set pagination off" -ex "set cuda api_failures ignore" -ex run -ex bt -ex "info threads" --args python3 bench/diag_teardown.py --cycles 20
