#!/usr/bin/env bash
# Device call 34 of the Triton MLA work (round 9), on an H100: fp8_qk (the 64-row FP8 tiles' scores by e4m3
# wgmma on the tile as loaded) checked against the reference, then timed against the shipped tiles, dense and sparse.
# Usage (device root, after installing the wheels): OUT=dir bash bench/triton_round9.sh
set -uo pipefail
T0=$(date +%s)
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -m pytest -q -m gpu tests/backends/test_triton_mla.py -k "gpu_fp8_qk" 2>&1 | tail -4 | tee "$OUT/triton_gpu_tests_fp8_qk_h100.txt"
python3 bench/triton_dev.py fp8qk --budget-s 200 --out "$OUT/triton_fp8qk_h100.txt" > /dev/null
grep -h "^# hoist" "$OUT/triton_fp8qk_h100.txt"
python3 bench/triton_dev.py fp8qk_sparse --budget-s 110 --out "$OUT/triton_fp8qk_sparse_h100.txt" > /dev/null
grep -h "^# hoist" "$OUT/triton_fp8qk_sparse_h100.txt"
echo "# call done in $(( $(date +%s) - T0 )) s"
