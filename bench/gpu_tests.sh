#!/usr/bin/env bash
# The test suite on a GPU machine in parts that each end inside one device call (<= 10 min),
# with every failure's report written as it happens ($OUT/failures.txt), the threads' stacks of
# any test still running after STACKS_AFTER seconds ($OUT/stacks.<worker>) and the GPUs' used
# memory every 2 s ($OUT/gpu_memory.csv): a part stopped at its limit still says what failed,
# why, and where a stuck test waits (tests/conftest.py).
#   bash bench/gpu_tests.sh [1|1a|1b|2]   1: the files with CUDA tests (marked gpu / multi_gpu),
#                                         1a / 1b: every other one of them (on one H200 with 16
#                                         cores part 1 needs ~600 s: past one call; 1a 86-122 s,
#                                         1b 200-300 s), 2: the others (~95 s);
#                                         default: 1a 1b 2
#   WORKERS=4 (pytest-xdist, where installed), TEST_TIMEOUT=200 (pytest-timeout, where
#   installed), PART_LIMIT=540 s, STACKS_AFTER=120 s.  Logs: $OUT/pytest.part<N>.log.
# The README's command (`python -m pytest -q`) runs the same tests in one go.
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
log_env
marked="mark\.gpu\|mark\.multi_gpu"
export TIDE_TRITON_TEST_FAILURES=$OUT/failures.txt TIDE_TRITON_TEST_STACKS=$OUT/stacks:${STACKS_AFTER:-120}
args=(-v -p no:cacheprovider --durations=20)
python3 -c "import xdist" 2>/dev/null && args+=(-n "${WORKERS:-4}")
python3 -c "import pytest_timeout" 2>/dev/null && args+=(--timeout "${TEST_TIMEOUT:-200}")
# The GPUs' used memory every 2 s (a test that cannot create a context says who held it)
nvidia-smi --query-gpu=timestamp,index,memory.used --format=csv,noheader -l 2 > "$OUT/gpu_memory.csv" 2>&1 &
mem_logger=$!
trap 'kill $mem_logger 2>/dev/null' EXIT
for part in ${1:-1a 1b 2}; do
  case "$part" in
    1) files=$(grep -l "$marked" tests/test_*.py) ;;
    1a) files=$(grep -l "$marked" tests/test_*.py | awk 'NR % 2 == 1') ;;
    1b) files=$(grep -l "$marked" tests/test_*.py | awk 'NR % 2 == 0') ;;
    2) files=$(grep -L "$marked" tests/test_*.py) ;;
    *) echo "unknown part $part (1, 1a, 1b or 2)" >&2; exit 2 ;;
  esac
  echo "=== part $part: $(echo $files | wc -w) files, ${args[*]}"
  with_nccl timeout -k 10 "${PART_LIMIT:-540}" python3 -m pytest "${args[@]}" $files > "$OUT/pytest.part$part.log" 2>&1
  echo "=== part $part rc=$? (124: stopped at PART_LIMIT)"
  grep -E "^=+ .*(passed|failed|error).* =+$" "$OUT/pytest.part$part.log"
  grep -oE "(FAILED|ERROR) tests/[^ ]+" "$OUT/pytest.part$part.log" | sort -u | head -30
done
[ -s "$OUT/failures.txt" ] && echo "failure reports: $OUT/failures.txt ($(grep -c '^==== FAILED' "$OUT/failures.txt"))"
ls "$OUT"/stacks.* >/dev/null 2>&1 && grep -l "most recent call first" "$OUT"/stacks.* | sed 's/^/stacks of a stuck test: /'
exit 0
