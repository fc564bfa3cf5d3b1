#!/usr/bin/env bash
# One device call: build, then the CUDA tests that compare CUDA with the CPU kernels (their CPU
# side included) and the CPU slices' own tests on the device's host CPU, in that order, each
# file's verdict on its own line; gpt_char's CPU-vs-CUDA step last (the longest). Logs to $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/ldet-gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 LIGHTNING_DET_BUILD_DIR=${LIGHTNING_DET_BUILD_DIR:-$PWD/build/ldet}
grep -m1 'model name' /proc/cpuinfo; grep -o 'avx512[a-z]*' /proc/cpuinfo | sort -u | tr '\n' ' '; echo
t0=$(date +%s)
python3 -m lightning_det._build || exit 1
echo "build: $(( $(date +%s) - t0 )) s"
status=0
for spec in "test_cuda_gemm:" "test_int_slices:cuda" "test_crt_route:cuda" "test_slices_guess:cuda" \
            "test_det_modules:cuda" "test_eager_rounding:cuda" "test_scatter_sum:cuda" \
            "test_crt_route:not cuda" "test_int_slices:not cuda" "test_fp_environment:" "test_gpt_char:cuda"; do
  f=${spec%%:*} k=${spec#*:}
  line=$(python3 -m pytest -q -p no:cacheprovider "tests/$f.py" ${k:+-k "$k"} 2>&1 | tee -a "$OUT/pytest.log" | tail -1)
  rc=${PIPESTATUS[0]}
  echo "$f [${k:-all}]: $line"
  [ "$rc" -eq 0 ] || status=1
done
exit $status
