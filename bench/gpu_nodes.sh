#!/usr/bin/env bash
# Across declared nodes (nodes emulated on the GPUs at hand; NCCL >= 2.30 needed for several
# ranks on one GPU: give it as NCCL_LIBRARY, see bench/gpu_env.sh).  Parts, in order:
#   tests     tests/test_hier_cuda.py: put/signal 2x2, 3x2, 4x2; send/recv 2x2, 4x2, over sockets
#   bench     bench/hier_gpu.py, Llama-3.1-70B layer at 2x2 for each inter-node hop (HOPS=), then
#             put/signal at 3x2 and 4x2 and with CHUNK_SMALL (16 MiB) chunks, then 2x2 over
#             NCCL's sockets (NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1)
#   baseline  NCCL's flat W=4 ring along FSDP2's path (bench/nccl_baseline.py --world-sizes 4)
#   fsdp      bench/fsdp_step.py at W=4: stock (flat NCCL) vs tide_triton declared 2 x 2, + Slot-Reuse,
#             with the drop-in's own group and with --chunk-mib 64; then the drop-in's 2x2 GPU test
#   gpus      with 2+ GPUs: each GPU a node (hier_gpu.py --gpu-per-node), W=2 x 1 and 4 as 2 x 2
#   bash bench/gpu_nodes.sh            all parts (over 10 minutes: pick some with PARTS="tests bench")
# Tables: docs/benchmarks.md "Across declared nodes".  Rows: $OUT/hier_gpu.jsonl, nccl_w4.jsonl,
# fsdp_nodes.jsonl.
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
log_env
[ -n "$NCCL_LIB" ] || echo "warning: no NCCL_LIBRARY: torch's NCCL may refuse several ranks on one GPU" >&2
PARTS=${PARTS:-tests bench baseline fsdp gpus}
has() { case " $PARTS " in *" $1 "*) return 0;; esac; return 1; }
hier() {  # hier NAME NPROC ARGS...: one bench/hier_gpu.py run, rows to hier_gpu.jsonl
  local name=$1 n=$2; shift 2
  with_nccl timeout -k 15 120 torchrun --standalone --nproc-per-node "$n" bench/hier_gpu.py "$@" \
    --json "$OUT/hier_gpu.jsonl" > "$OUT/hier_$name.log" 2>&1; echo "hier_gpu $name rc=$?"
  grep -E "^\||Error|error" "$OUT/hier_$name.log" | head -6
}
if has tests; then
  run hier_tests 400 with_nccl python3 -m pytest -q -s -p no:cacheprovider tests/test_hier_cuda.py
fi
if has bench; then
  python3 bench/hier_gpu.py --header
  for hop in ${HOPS:-put_signal send_recv}; do hier "2x2_$hop" 4 --local-size 2 --inter-node "$hop"; done
  hier 3x2_put_signal 6 --local-size 2 --inter-node put_signal
  hier 4x2_put_signal 8 --local-size 2 --inter-node put_signal
  hier 2x2_put_signal_small_chunks 4 --local-size 2 --inter-node put_signal --chunk-bytes ${CHUNK_SMALL:-16777216}
  NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 hier 2x2_put_signal_sockets 4 --local-size 2 --inter-node put_signal
fi
if has baseline; then
  run nccl_w4 200 with_nccl python3 bench/nccl_baseline.py --world-sizes 4 --models llama-3.1-70b --iters 5 \
    --no-profile --json "$OUT/nccl_w4.jsonl"
fi
if has fsdp; then
  python3 bench/fsdp_step.py --header
  for cfg in "stock" "tide" "slot" "tide --chunk-mib 64" "slot --chunk-mib 64"; do
    set -- $cfg; mode=$1; shift
    if [ "$mode" = stock ]; then extra=(--backend nccl); else extra=(--backend gloo --local-size 2 "$@"); fi
    name="$mode${1:+-chunk64}"
    with_nccl timeout -k 15 150 torchrun --standalone --nproc-per-node 4 bench/fsdp_step.py --mode "$mode" \
      "${extra[@]}" --json "$OUT/fsdp_nodes.jsonl" > "$OUT/fsdp_nodes.$name.log" 2>&1 \
      || { echo "| $name | failed rc=$? |"; tail -5 "$OUT/fsdp_nodes.$name.log"; }
    grep -E "^\||span" "$OUT/fsdp_nodes.$name.log"
  done
  run fsdp_nodes_test 240 with_nccl python3 -m pytest -x -q -s -p no:cacheprovider tests/test_fsdp.py \
    -k across_declared_nodes_on_one_gpu
fi
if has gpus && [ "${NGPU:-0}" -lt 2 ]; then echo "part gpus: skipped, $NGPU GPU(s)"; fi
if has gpus && [ "${NGPU:-0}" -ge 2 ]; then
  nvidia-smi topo -m | tee "$OUT/topo.txt"
  for cfg in "2 1" "4 2"; do
    set -- $cfg
    for hop in put_signal send_recv; do
      hier "gpu_per_node_${1}_$hop" "$1" --local-size "$2" --gpu-per-node --inter-node "$hop"
    done
  done
fi
