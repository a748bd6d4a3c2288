#!/usr/bin/env bash
# Device call 23 of the Triton MLA work: the small-batch tiles (launch.SMALL_BATCH_TILES, chosen on the H100)
# on an H200, on the buckets they change, to compare with the call-17 / 20261123 H200 files.
# Usage (device root, after installing the wheels): OUT=dir bash bench/h200_small_batch.sh
set -uo pipefail
T0=$(date +%s)
timeout 120 python3 -m pytest -q -rf -m gpu -p no:cacheprovider tests/backends/test_triton_mla.py -k small_batch 2>&1 \
  | tail -3 | tee "$OUT/triton_gpu_tests_small_batch_h200.txt"
python3 bench/kernels.py --dense-only --kv-dtype fp8_e4m3 --heads 32 --max-seconds 0.4 --time-budget-s 100 \
  --out "$OUT/kernels-h200-dense-fp8-h32-call23.txt" > /dev/null 2>&1
python3 bench/kernels.py --dense-only --kv-dtype bf16 --heads 64 --max-seconds 0.4 --time-budget-s 100 \
  --out "$OUT/kernels-h200-dense-bf16-h64-call23.txt" > /dev/null 2>&1
python3 bench/kernels.py --sparse-only --kv-dtype fp8_e4m3 --heads 32 --kv-len 32768 --max-seconds 0.4 \
  --time-budget-s 60 --out "$OUT/kernels-h200-sparse-fp8-h32-call23.txt" > /dev/null 2>&1
grep -c TRITON "$OUT"/kernels-h200-*.txt
echo "# call done in $(( $(date +%s) - T0 )) s"
