#!/usr/bin/env bash
# Device call 28 of the Triton MLA work (round 7), on an H100: the official FP8 32-head rows, dense and sparse,
# on the round-7 table, and the sparse FP8 32-head small-batch tile against the new 32-row tile (batch 1-16).
# Usage (device root, after installing the wheels): OUT=dir bash bench/triton_round7c.sh
set -uo pipefail
T0=$(date +%s)
nvidia-smi --query-gpu=name --format=csv,noheader
python3 bench/kernels.py --dense-only --kv-dtype fp8_e4m3 --heads 32 --max-seconds 0.4 --time-budget-s 90 \
  --out "$OUT/kernels-h100-dense-fp8-h32-call28.txt" > /dev/null 2>&1
python3 bench/kernels.py --sparse-only --kv-dtype fp8_e4m3 --heads 32 --kv-len 32768 --max-seconds 0.4 \
  --time-budget-s 40 --out "$OUT/kernels-h100-sparse-fp8-h32-call28.txt" > /dev/null 2>&1
python3 bench/triton_dev.py vcast_small_sparse --budget-s 60 --out "$OUT/triton_vcast_small_sparse_h100.txt" > /dev/null
grep -h "^# hoist" "$OUT/triton_vcast_small_sparse_h100.txt"
echo "# call done in $(( $(date +%s) - T0 )) s"
