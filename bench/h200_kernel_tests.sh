#!/usr/bin/env bash
# The Triton kernel's whole GPU test file on an NVIDIA H200 (device call 29: the round-7 tables on the second GPU).
# Usage (device root, after installing the wheels): OUT=dir bash bench/h200_kernel_tests.sh
set -uo pipefail
T0=$(date +%s)
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
timeout 500 python3 -m pytest -q -rf -m gpu -p no:cacheprovider tests/backends/test_triton_mla.py 2>&1 | tail -8 \
  | tee "$OUT/triton_gpu_tests2_h200.txt"
echo "# call done in $(( $(date +%s) - T0 )) s"
