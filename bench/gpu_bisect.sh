#!/usr/bin/env bash
# Which path does the intermittent GC-time segfault of the single-process mode follow?
# Runs bench/diag_teardown.py N times under each diagnostic switch and counts crashes.
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
N=${N:-4}
for v in base TIDE_TRITON_COPY_MODE=loop TIDE_TRITON_MEMOP_BATCH=0 TIDE_TRITON_LAUNCH=jit; do
  crashes=0
  for i in $(seq $N); do
    if [ $v = base ]; then e=(); else e=("$v"); fi
    env "${e[@]}" timeout 45 python3 -X faulthandler bench/diag_teardown.py --cycles 10 > "$OUT/$v.$i.log" 2>&1; rc=$?
    [ $rc -ne 0 ] && crashes=$((crashes+1))
    echo "$v run $i rc=$rc $(grep -h 'cyclic garbage' "$OUT/$v.$i.log")"
  done
  echo "### $v: $crashes of $N crashed"
done
