#!/usr/bin/env bash
# Every CUDA test, then (optionally) benchmarks, in one call on a GPU machine, from the repository
# root: the build runs once, then benchmarks/cuda_suite.py runs each test file in its own pytest
# process and records one line per file (counts, commit, device, torch and CUDA versions) in
# <results>/<device>-cuda_suite.json.
#
#   bash benchmarks/gpu_suite.sh                          # build + every CUDA test file
#   bash benchmarks/gpu_suite.sh gemm linear              # then benchmarks/gemm.py and linear.py on CUDA
#   bash benchmarks/gpu_suite.sh "ddp_step --accelerator gpu --devices 1"   # a benchmark with its own arguments
#   LDET_TESTS="test_crt_route:cuda test_crt_route:!cuda" bash benchmarks/gpu_suite.sh   # those tests only
#
# A test spec is file:filter, the filter pytest's -k ("" the whole file; "!cuda" its CPU tests);
# LDET_TESTS="" runs no tests. A benchmark named alone gets its CUDA flag from the table below.
# With $OUT set (the lent device machine's folder that comes back), the results files go to
# $OUT/results/ under their benchmarks/results/ names (copy them there to commit them) and the
# logs to $OUT; without it, the results files go to benchmarks/results/ and the logs to
# /tmp/ldet-gpu. Pass LDET_COMMIT=<sha> (the results files record it): a copied working tree's git
# metadata need not be at the commit that was sent. Left unset, benchmarks/_common.py records
# HEAD, marked "+modified" when tracked files differ from it.
set -uo pipefail
LOGS=${OUT:-/tmp/ldet-gpu}
mkdir -p "$LOGS"
if [ -n "${OUT:-}" ]; then
  export LDET_RESULTS_DIR=$OUT/results
fi
export PYTHONUNBUFFERED=1 LIGHTNING_DET_BUILD_DIR=${LIGHTNING_DET_BUILD_DIR:-$PWD/build/ldet}
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv,noheader
grep -m1 'model name' /proc/cpuinfo; grep -o 'avx512[a-z_]*' /proc/cpuinfo | sort -u | tr '\n' ' '; echo
t0=$(date +%s)
python3 -m lightning_det._build || exit 1
echo "build: $(( $(date +%s) - t0 )) s"

status=0
if [ -z "${LDET_TESTS+set}" ]; then
  python3 benchmarks/cuda_suite.py --log "$LOGS/cuda-pytest.log" || status=1
elif [ -n "$LDET_TESTS" ]; then
  # shellcheck disable=SC2086  # one word per spec
  python3 benchmarks/cuda_suite.py --log "$LOGS/cuda-pytest.log" $LDET_TESTS || status=1
fi

for b in "$@"; do
  name=${b%% *}
  args=${b#"$name"}
  if [ -z "$args" ]; then
    case $name in
      ddp_step|quality) args="--accelerator gpu" ;;
      multi_gpu) args="--accelerator cuda --out $LOGS/multi_gpu" ;;
      optim) args="--devices cuda" ;;
      *) args="--device cuda" ;;
    esac
  fi
  if [ "$name" = nccl_kshard ]; then
    run=(python3 -m torch.distributed.run --standalone --nproc-per-node "$(nvidia-smi -L | wc -l)")
  else
    run=(python3)
  fi
  # shellcheck disable=SC2086  # the benchmark's arguments, one word each
  "${run[@]}" "benchmarks/$name.py" $args 2>&1 | tee "$LOGS/$name.log"
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
done
exit $status
