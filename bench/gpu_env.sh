# Sourced by the bench/gpu_*.sh device scripts: one environment for every GPU run.
# Multicast stays off (NCCL, torch symmetric memory, NVSHMEM): it can take a shared host's
# GPUs out of service.  The single-process mode needs its ranks' streams on separate
# hardware queues.  Results and logs go to $OUT.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-32}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
