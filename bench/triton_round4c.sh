#!/usr/bin/env bash
# Device call 16 of the Triton MLA work (round 4b): smaller minimum splits for the FP8 32-row tile, dense
# and sparse (winners written into launch.py), then the GPU tests of the kernel and the official FP8
# dense and sparse benchmarks on the result.
# Usage (device root, after installing the wheels): OUT=dir bash bench/triton_round4c.sh
set -uo pipefail
T0=$(date +%s)
python3 bench/triton_dev.py small --apply --budget-s 100 --out "$OUT/triton_small_h100.txt" > /dev/null
python3 bench/triton_dev.py small_sparse --apply --budget-s 100 --out "$OUT/triton_small_sparse_h100.txt" > /dev/null
grep "^# hoist" "$OUT"/triton_small*_h100.txt
cp backends/triton_mla/launch.py "$OUT/launch_applied.py"
timeout 200 python3 -m pytest -q -rf -m gpu -p no:cacheprovider tests/backends/test_triton_mla.py 2>&1 | tail -4 \
  | tee "$OUT/triton_gpu_tests11_h100.txt"
python3 bench/kernels.py --sparse-only --kv-len 32768 --kv-dtype fp8_e4m3 --max-seconds 0.4 --time-budget-s 80 \
  --out "$OUT/kernels-h100-sparse-fp8-call16.txt" > /dev/null 2>&1
python3 bench/kernels.py --dense-only --kv-dtype fp8_e4m3 --max-seconds 0.4 --time-budget-s $(( 560 - ($(date +%s) - T0) )) \
  --out "$OUT/kernels-h100-dense-fp8-call16.txt" > /dev/null 2>&1
echo "# call done in $(( $(date +%s) - T0 )) s"
