#!/usr/bin/env bash
# Device call 25 of the Triton MLA work: the kernel's whole GPU test file against the final tile tables (round 6
# applied, both small-batch and 32-row sparse branches), then the official sparse BF16 rows at every head count.
# Usage (device root, after installing the wheels): OUT=dir bash bench/triton_final_check.sh
set -uo pipefail
T0=$(date +%s)
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
timeout 400 python3 -m pytest -q -rf -m gpu -p no:cacheprovider tests/backends/test_triton_mla.py 2>&1 | tail -8 \
  | tee "$OUT/triton_gpu_tests17_h100.txt"
echo "# tests done at $(( $(date +%s) - T0 )) s"
python3 bench/kernels.py --sparse-only --kv-dtype bf16 --kv-len 32768 --max-seconds 0.4 --time-budget-s 90 \
  --out "$OUT/kernels-h100-sparse-bf16-call25.txt" > /dev/null 2>&1
tail -3 "$OUT/kernels-h100-sparse-bf16-call25.txt"
echo "# call done in $(( $(date +%s) - T0 )) s"
