#!/usr/bin/env bash
# Device call 20 of the Triton MLA work (round 5b): 16-row blocks for 64/128 heads at batch 1-16 (measured,
# not applied), then the official FP8 benchmarks (dense, sparse) with launch.SMALL_BATCH_TILES.
# Usage (device root, after installing the wheels): OUT=dir bash bench/triton_round5b.sh
set -uo pipefail
T0=$(date +%s)
python3 bench/triton_dev.py blocks16_small --budget-s 150 --out "$OUT/triton_blocks16_small_h100.txt" > /dev/null
grep -h "^# hoist" "$OUT/triton_blocks16_small_h100.txt"
python3 bench/kernels.py --dense-only --kv-dtype fp8_e4m3 --max-seconds 0.4 --time-budget-s 230 \
  --out "$OUT/kernels-h100-dense-fp8-call20.txt" > /dev/null 2>&1
tail -12 "$OUT/kernels-h100-dense-fp8-call20.txt"
python3 bench/kernels.py --sparse-only --kv-dtype fp8_e4m3 --kv-len 32768 --max-seconds 0.4 \
  --time-budget-s $(( 560 - ($(date +%s) - T0) )) --out "$OUT/kernels-h100-sparse-fp8-call20.txt" > /dev/null 2>&1
tail -12 "$OUT/kernels-h100-sparse-fp8-call20.txt"
echo "# call done in $(( $(date +%s) - T0 )) s"
