# Sourced by the bench/gpu_*.sh scripts: one environment for every GPU run.
# Run a script from the repository root: `bash bench/gpu_<family>.sh`; logs and JSON rows go
# to $OUT (default /tmp/out).  docs/benchmarks.md says which table each script produces.
#
# Multicast stays off (NCCL, torch symmetric memory, NVSHMEM): it can take a shared host's
# GPUs out of service.  Several ranks may share one GPU (NCCL >= 2.30 with the variable below).
# CUDA_DEVICE_MAX_CONNECTIONS is not exported: the single-process mode raises it in its own
# process (tide_triton.local_groups, the benches' threads mode), and a process per rank keeps
# the default 8 -- at 32 only 9 processes hold a context on an H200
# (docs/constraints.md#contexts-per-gpu-and-hardware-queues).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1
export NCCL_MULTI_RANK_GPU_ENABLE=${NCCL_MULTI_RANK_GPU_ENABLE:-1}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
# Every row records the git SHA: from TIDE_GIT_SHA, else from git (a copy without .git: pass it),
# "+dirty" where the tree differs from that commit (so a row never names a commit its tree was not).
export TIDE_GIT_SHA=${TIDE_GIT_SHA:-$(git rev-parse --short=12 HEAD 2>/dev/null || echo unknown)$(git diff --quiet HEAD 2>/dev/null || echo +dirty)}
NGPU=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')

# NCCL: torch's own unless a newer library is given; nothing inside an installed package is
# ever overwritten.  tide_triton takes it through TIDE_TRITON_NCCL_LIBRARY, torch (its NCCL
# backend, FSDP2's stock baselines) through LD_PRELOAD -- both set only by `with_nccl`.
#   NCCL_LIBRARY=/path/to/libnccl.so.2    a library on disk; else the first of
#   .nccl/ or /tmp/nccl/                  libnccl.so.2, or xz parts libnccl.xz.part.* (split to
#                                         fit size limits; unpacked once to $TMPDIR/tide-nccl/)
NCCL_LIB=
if [ -n "${NCCL_LIBRARY:-}" ]; then
  NCCL_LIB=$(readlink -f "$NCCL_LIBRARY")
else
  for d in .nccl /tmp/nccl; do
    if [ -s "$d/libnccl.so.2" ]; then NCCL_LIB=$(readlink -f "$d/libnccl.so.2"); break; fi
    if ls "$d"/libnccl.xz.part.* >/dev/null 2>&1; then
      NCCL_LIB=${TMPDIR:-/tmp}/tide-nccl/libnccl.so.2
      if [ ! -s "$NCCL_LIB" ]; then
        mkdir -p "$(dirname "$NCCL_LIB")"
        cat "$d"/libnccl.xz.part.* | xz -d > "$NCCL_LIB.part" && mv "$NCCL_LIB.part" "$NCCL_LIB"
      fi
      break
    fi
  done
fi
[ -z "$NCCL_LIB" ] || [ -s "$NCCL_LIB" ] || { echo "NCCL library $NCCL_LIB is missing or empty" >&2; exit 2; }

# with_nccl CMD...: run CMD (and its children) with the chosen NCCL for tide_triton and torch.
with_nccl() {
  if [ -n "$NCCL_LIB" ]; then
    LD_PRELOAD="$NCCL_LIB${LD_PRELOAD:+:$LD_PRELOAD}" TIDE_TRITON_NCCL_LIBRARY="$NCCL_LIB" "$@"
  else
    "$@"
  fi
}

# GPU, driver, versions and the NCCL a process actually loads -> stdout and $OUT/env.txt.
log_env() {
  {
    nvidia-smi --query-gpu=index,name,driver_version,memory.used --format=csv,noheader
    echo "git $TIDE_GIT_SHA | NCCL library: ${NCCL_LIB:-the one torch ships}"
    with_nccl python3 -c "import torch, triton; print('torch', torch.__version__, '| triton', triton.__version__, '| cuda', torch.version.cuda, '| torch NCCL', torch.cuda.nccl.version())"
    [ -z "$NCCL_LIB" ] || with_nccl python3 -c "from tide_triton.transport import nccl; print('tide_triton NCCL:', nccl.load())"
  } 2>&1 | tee "$OUT/env.txt"
}

# run NAME LIMIT_S CMD...: CMD under a time limit, output in $OUT/NAME.log, table rows echoed.
run() {
  local name=$1 limit=$2; shift 2
  echo "=== $name"
  timeout -k 15 "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  grep -E "^\||passed|failed|Fatal|^E  |Error" "$OUT/$name.log" | head -${LINES_MAX:-60}
  echo "=== $name rc=$rc"
  return $rc
}
