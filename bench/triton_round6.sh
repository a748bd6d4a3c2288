#!/usr/bin/env bash
# Device call 24 of the Triton MLA work (round 6): a 32-row BF16 tile for 32 heads, dense and sparse (winners
# written into launch.py by the 0.97 / 1.10 rule); if anything changed, the kernel's GPU tests and the official
# BF16 32-head rows.
# Usage (device root, after installing the wheels): OUT=dir bash bench/triton_round6.sh
set -uo pipefail
T0=$(date +%s)
cp backends/triton_mla/launch.py /tmp/launch_before.py
python3 bench/triton_dev.py rows32 --apply --budget-s 80 --out "$OUT/triton_rows32_h100.txt" > /dev/null
python3 bench/triton_dev.py rows32_sparse --apply --budget-s 80 --out "$OUT/triton_rows32_sparse_h100.txt" > /dev/null
grep -h "^# hoist" "$OUT/triton_rows32_h100.txt" "$OUT/triton_rows32_sparse_h100.txt"
if cmp -s /tmp/launch_before.py backends/triton_mla/launch.py; then echo "# nothing applied"; exit 0; fi
cp backends/triton_mla/launch.py "$OUT/launch_applied.py"
timeout 230 python3 -m pytest -q -rf -m gpu -p no:cacheprovider tests/backends/test_triton_mla.py 2>&1 | tail -6 \
  | tee "$OUT/triton_gpu_tests16_h100.txt"
python3 bench/kernels.py --dense-only --kv-dtype bf16 --heads 32 --max-seconds 0.4 --time-budget-s 45 \
  --out "$OUT/kernels-h100-dense-bf16-h32-call24.txt" > /dev/null 2>&1
python3 bench/kernels.py --sparse-only --kv-dtype bf16 --heads 32 --kv-len 32768 --max-seconds 0.4 --time-budget-s 30 \
  --out "$OUT/kernels-h100-sparse-bf16-h32-call24.txt" > /dev/null 2>&1
echo "# call done in $(( $(date +%s) - T0 )) s"
