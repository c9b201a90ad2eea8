#!/usr/bin/env bash
# Count unclean exits of small FSDP2 jobs under torchrun (bench/exit_job.py): N jobs, one at a
# time, alternating 2 and 4 processes unless NPROC is set; prints a tally line per job and a
# total.  Logs of failed jobs are kept in $EXIT_LOOP_LOGS (default: a fresh mktemp -d).
#
#   bench/exit_loop.sh N [job args...]          e.g. bench/exit_loop.sh 300
#   NPROC=2 bench/exit_loop.sh 100 --no-tide    stock FSDP2 only, 2 processes
#   EXIT_JOB=examples/train_llama.py bench/exit_loop.sh 60 --steps 4   another script as the job
#
# A job fails when torchrun exits non-zero or a rank wrote "terminate called" (std::terminate
# at exit).  Run from the repository root with the venv active.
set -u
n=${1:?usage: bench/exit_loop.sh N [job args...]}
shift
root=$(cd "$(dirname "$0")/.." && pwd)
logs=${EXIT_LOOP_LOGS:-$(mktemp -d -t exit_loop.XXXXXX)}
mkdir -p "$logs"
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}" OMP_NUM_THREADS=1 TRITON_INTERPRET=1
fails=0
for i in $(seq 1 "$n"); do
  np=${NPROC:-$(( i % 2 ? 2 : 4 ))}
  log="$logs/job-$i-np$np.log"
  timeout 300 python -m torch.distributed.run --standalone --nproc-per-node "$np" \
    "${EXIT_JOB:-$root/bench/exit_job.py}" "$@" >"$log" 2>&1
  rc=$?
  if [ "$rc" -ne 0 ] || grep -q "terminate called" "$log"; then
    fails=$((fails + 1))
    echo "job $i (np $np): FAILED rc=$rc ($(grep -c 'terminate called' "$log") terminate) log $log"
  else
    echo "job $i (np $np): ok"
    rm -f "$log"
  fi
done
echo "exit_loop: $fails failed of $n jobs (${EXIT_JOB:-bench/exit_job.py} $*) logs: $logs"
[ "$fails" -eq 0 ]
