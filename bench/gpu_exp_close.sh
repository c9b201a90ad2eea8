#!/usr/bin/env bash
# Quick re-check of the cross-node GPU tests (NCCL 2.32 parts in /tmp/nccl).
source "$(dirname "$0")/gpu_env.sh"; export PYTHONFAULTHANDLER=1 NCCL_MULTI_RANK_GPU_ENABLE=1
cat /tmp/nccl/libnccl.xz.part.* | xz -d > /opt/torch/.venv/lib/python3.12/site-packages/nvidia/nccl/lib/libnccl.so.2
timeout ${T:-75} python3 -m pytest -q -p no:cacheprovider tests/test_hier_cuda.py ${K:+-k "$K"} > "$OUT/hier.log" 2>&1
echo "rc=$?"; grep -E "passed|failed|what\(\)|^E  .*Error" "$OUT/hier.log" | head -8
