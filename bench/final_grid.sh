#!/usr/bin/env bash
# The official dense and sparse grids (device calls 32, 33 and 36) in one call on the final tables (one file each, no merged rows).
# Usage (device root, after installing the wheels): OUT=dir bash bench/final_grid.sh NAME
set -uo pipefail
T0=$(date +%s)
python3 bench/warm_jit.py > /dev/null 2>&1
python3 bench/kernels.py --dense-only --max-seconds 0.4 --time-budget-s 220 --out "$OUT/kernels-$1-dense-final.txt" \
  > /dev/null 2>&1
python3 bench/kernels.py --sparse-only --kv-len 32768 --max-seconds 0.4 --time-budget-s 120 \
  --out "$OUT/kernels-$1-sparse-final.txt" > /dev/null 2>&1
python3 bench/summarize_kernels.py "$OUT/kernels-$1-dense-final.txt" "$OUT/kernels-$1-sparse-final.txt"
echo "# call done in $(( $(date +%s) - T0 )) s"
