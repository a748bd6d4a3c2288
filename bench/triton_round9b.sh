#!/usr/bin/env bash
# Device call 35 (round 9, second try), H100: fp8_qk with the (hi, lo) products in one accumulator chain, checked
# against the reference, then timed against the shipped 64-row FP8 tiles (dense, then sparse).
# Usage (device root, after installing the wheels): OUT=dir bash bench/triton_round9b.sh
set -uo pipefail
T0=$(date +%s)
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -m pytest -q -m gpu tests/backends/test_triton_mla.py -k "gpu_fp8_qk" 2>&1 | tail -4 | tee "$OUT/triton_gpu_tests_fp8_qk2_h100.txt"
python3 bench/triton_dev.py fp8qk2 --budget-s 200 --out "$OUT/triton_fp8qk2_h100.txt" > /dev/null
grep -h "^# hoist" "$OUT/triton_fp8qk2_h100.txt"
python3 bench/triton_dev.py fp8qk2_sparse --budget-s 100 --out "$OUT/triton_fp8qk2_sparse_h100.txt" > /dev/null
grep -h "^# hoist" "$OUT/triton_fp8qk2_sparse_h100.txt"
echo "# call done in $(( $(date +%s) - T0 )) s"
