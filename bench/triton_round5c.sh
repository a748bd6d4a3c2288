#!/usr/bin/env bash
# Device call 21 of the Triton MLA work (round 5c): the kernel's GPU tests with SMALL_BATCH_TILES (FP8 32 heads
# and BF16 64 heads at batch <= 4), then the official dense and sparse benchmarks, both KV dtypes.
# Usage (device root, after installing the wheels): OUT=dir bash bench/triton_round5c.sh
set -uo pipefail
T0=$(date +%s)
timeout 330 python3 -m pytest -q -rf -m gpu -p no:cacheprovider tests/backends/test_triton_mla.py 2>&1 | tail -6 \
  | tee "$OUT/triton_gpu_tests14_h100.txt"
python3 bench/kernels.py --dense-only --max-seconds 0.4 --time-budget-s 170 \
  --out "$OUT/kernels-h100-dense-call21.txt" > /dev/null 2>&1
python3 bench/kernels.py --sparse-only --kv-len 32768 --max-seconds 0.4 \
  --time-budget-s $(( 575 - ($(date +%s) - T0) )) --out "$OUT/kernels-h100-sparse-call21.txt" > /dev/null 2>&1
grep -c TRITON "$OUT/kernels-h100-dense-call21.txt" "$OUT/kernels-h100-sparse-call21.txt"
echo "# call done in $(( $(date +%s) - T0 )) s"
