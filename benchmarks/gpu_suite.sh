#!/usr/bin/env bash
# Every CUDA test, then (optionally) benchmarks, in one call on a GPU machine: the build runs once
# and each test file reports on its own line, so a failure names its file.
#
#   bash benchmarks/gpu_suite.sh                 # build + all CUDA tests
#   bash benchmarks/gpu_suite.sh gemm linear     # then benchmarks/gemm.py and linear.py (--device cuda)
#   LDET_TESTS="test_crt_route:cuda test_crt_route:!cuda" bash benchmarks/gpu_suite.sh   # those only
#
# A test spec is file:filter, the filter pytest's -k ("" the whole file; "!cuda" its CPU tests,
# which then run on the device machine's host CPU).
# Writes logs and results under $OUT when it is set (the lent device machine), else /tmp/ldet-gpu.
# Pass LDET_COMMIT=<sha> (the results files record it): a copied working tree's git metadata
# need not be at the commit that was sent (session 8: it named the session's first commit). Left
# unset, benchmarks/_common.py records HEAD, marked "+modified" when tracked files differ from it.
set -uo pipefail
OUT=${OUT:-/tmp/ldet-gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 LIGHTNING_DET_BUILD_DIR=${LIGHTNING_DET_BUILD_DIR:-$PWD/build/ldet}
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv,noheader
grep -m1 'model name' /proc/cpuinfo; grep -o 'avx512[a-z_]*' /proc/cpuinfo | sort -u | tr '\n' ' '; echo
t0=$(date +%s)
python3 -m lightning_det._build || exit 1
echo "build: $(( $(date +%s) - t0 )) s"

status=0
# By default every file's CUDA tests.
ALL="test_fp64_route: test_cuda_gemm: test_int_slices:cuda test_det_modules:cuda test_adamw_sr:cuda test_digest:cuda
     test_digest_callback:cuda test_det_cross_entropy:cuda test_ops_api: test_gpt_char:cuda
     test_eager_rounding:cuda test_scatter_sum:cuda test_slices_guess:cuda test_crt_route:cuda
     test_norm_op:cuda test_ce_op:cuda test_trusted_mode: test_gelu_fast: test_combine_rounding:"
for spec in ${LDET_TESTS:-$ALL}; do
  f=${spec%%:*} k=${spec#*:}
  k=${k/#!/not }  # "!cuda": the file's CPU tests
  line=$(python3 -m pytest -q -p no:cacheprovider "tests/$f.py" ${k:+-k "$k"} 2>&1 | tee -a "$OUT/cuda-pytest.log" | tail -1)
  rc=${PIPESTATUS[0]}
  echo "$f${k:+ [$k]}: $line"
  [ "$rc" -eq 0 ] || status=1
done

for b in "$@"; do
  python3 "benchmarks/$b.py" --device cuda --out "$OUT/gpu-$b.json" 2>&1 | tee "$OUT/gpu-$b.log" || status=1
done
exit $status
