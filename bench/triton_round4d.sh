#!/usr/bin/env bash
# Device call 18 of the Triton MLA work (round 4c): minimum split 32 tokens for the 16-row tiles (winners
# written into launch.py), then the kernel's GPU tests and the official dense benchmark on the result.
# Usage (device root, after installing the wheels): OUT=dir bash bench/triton_round4d.sh
set -uo pipefail
T0=$(date +%s)
python3 bench/triton_dev.py small2 --apply --budget-s 150 --out "$OUT/triton_small2_h100.txt" > /dev/null
grep "^# hoist" "$OUT/triton_small2_h100.txt"
cp backends/triton_mla/launch.py "$OUT/launch_applied.py"
timeout 200 python3 -m pytest -q -rf -m gpu -p no:cacheprovider tests/backends/test_triton_mla.py 2>&1 | tail -4 \
  | tee "$OUT/triton_gpu_tests12_h100.txt"
python3 bench/kernels.py --dense-only --max-seconds 0.4 --time-budget-s $(( 560 - ($(date +%s) - T0) )) \
  --out "$OUT/kernels-h100-dense-call18.txt" > /dev/null 2>&1
echo "# call done in $(( $(date +%s) - T0 )) s"
