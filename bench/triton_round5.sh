#!/usr/bin/env bash
# Device call 19 of the Triton MLA work (round 5): FP8 32 and 64 heads as blocks of the FP8 16-row tile
# (dense and sparse; winners written into launch.py by the 0.97 / 1.10 rule), then the kernel's GPU tests
# (now with FP16 caches too) on the result.
# Usage (device root, after installing the wheels): OUT=dir bash bench/triton_round5.sh
set -uo pipefail
T0=$(date +%s)
python3 bench/triton_dev.py blocks16 --apply --budget-s 140 --out "$OUT/triton_blocks16_h100.txt" > /dev/null
python3 bench/triton_dev.py blocks16_sparse --apply --budget-s 100 --out "$OUT/triton_blocks16_sparse_h100.txt" > /dev/null
grep -h "^# hoist" "$OUT/triton_blocks16_h100.txt" "$OUT/triton_blocks16_sparse_h100.txt"
cp backends/triton_mla/launch.py "$OUT/launch_applied.py"
timeout $(( 570 - ($(date +%s) - T0) )) python3 -m pytest -q -rf -m gpu -p no:cacheprovider \
  tests/backends/test_triton_mla.py 2>&1 | tail -6 | tee "$OUT/triton_gpu_tests13_h100.txt"
echo "# call done in $(( $(date +%s) - T0 )) s"
