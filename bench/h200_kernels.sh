#!/usr/bin/env bash
# The Triton kernel's GPU tests and the official dense and sparse benchmarks on an H200 (one call).
# Usage (device root, after installing the wheels): OUT=dir bash bench/h200_kernels.sh DATE
set -uo pipefail
T0=$(date +%s)
timeout 170 python3 -m pytest -q -rf -m gpu -p no:cacheprovider tests/backends/test_triton_mla.py 2>&1 | tail -5 \
  | tee "$OUT/triton_gpu_tests_h200.txt"
python3 bench/kernels.py --sparse-only --kv-len 32768 --max-seconds 0.4 --time-budget-s 100 \
  --out "$OUT/kernels-h200-sparse-$1.txt" > /dev/null 2>&1
python3 bench/kernels.py --dense-only --max-seconds 0.4 --time-budget-s $(( 560 - ($(date +%s) - T0) )) \
  --out "$OUT/kernels-h200-dense-$1.txt" > /dev/null 2>&1
echo "# call done in $(( $(date +%s) - T0 )) s"
