#!/usr/bin/env bash
# Device call 22 of the Triton MLA work (round 5d): the kernel's GPU tests with the final SMALL_BATCH_TILES
# (BF16 64 heads only at batch 1), then the official dense BF16 benchmark at 64 heads.
# Usage (device root, after installing the wheels): OUT=dir bash bench/triton_round5d.sh
set -uo pipefail
T0=$(date +%s)
timeout 330 python3 -m pytest -q -rf -m gpu -p no:cacheprovider tests/backends/test_triton_mla.py 2>&1 | tail -6 \
  | tee "$OUT/triton_gpu_tests15_h100.txt"
python3 bench/kernels.py --dense-only --kv-dtype bf16 --heads 64 --max-seconds 0.4 \
  --time-budget-s $(( 420 - ($(date +%s) - T0) )) --out "$OUT/kernels-h100-dense-bf16-h64-call22.txt" > /dev/null 2>&1
grep -c TRITON "$OUT/kernels-h100-dense-bf16-h64-call22.txt"
echo "# call done in $(( $(date +%s) - T0 )) s"
