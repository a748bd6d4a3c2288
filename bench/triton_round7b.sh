#!/usr/bin/env bash
# Device call 27 of the Triton MLA work (round 7): what fp16 math and the opaque V cast each gave the FP8 32-row
# tiles, the 16-row small-batch tiles against the new 32-row tiles (no --apply: read per shape), and the official
# FP8 32-head rows, dense and sparse.
# Usage (device root, after installing the wheels): OUT=dir bash bench/triton_round7b.sh
set -uo pipefail
T0=$(date +%s)
for mode in vcast_split vcast_split_sparse vcast_small vcast_small_sparse; do
  python3 bench/triton_dev.py $mode --budget-s 60 --out "$OUT/triton_${mode}_h100.txt" > /dev/null
  grep -h "^# hoist" "$OUT/triton_${mode}_h100.txt"
done
echo "# A/B done at $(( $(date +%s) - T0 )) s"
python3 bench/kernels.py --dense-only --kv-dtype fp8_e4m3 --heads 32 --max-seconds 0.4 --time-budget-s 90 \
  --out "$OUT/kernels-h100-dense-fp8-h32-call27.txt" > /dev/null 2>&1
python3 bench/kernels.py --sparse-only --kv-dtype fp8_e4m3 --heads 32 --kv-len 32768 --max-seconds 0.4 \
  --time-budget-s 40 --out "$OUT/kernels-h100-sparse-fp8-h32-call27.txt" > /dev/null 2>&1
echo "# call done in $(( $(date +%s) - T0 )) s"
