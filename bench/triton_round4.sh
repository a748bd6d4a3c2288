#!/usr/bin/env bash
# Device calls 10-11 of the Triton MLA work (round 4): sparse tiles that look their rows up a chunk of top-k
# slots at a time (hoist_pages for sparse) against SPARSE_TILE_TABLE (winners written into launch.py),
# then the sparse GPU tests and the official sparse benchmark on the result.
# Usage (device root, after installing the wheels): OUT=dir bash bench/triton_round4.sh
set -uo pipefail
T0=$(date +%s)
python3 bench/triton_dev.py sparse_hoist --apply --budget-s 260 --out "$OUT/triton_sparse_hoist2_h100.txt"
cp backends/triton_mla/launch.py "$OUT/launch_applied.py"
timeout 150 python3 -m pytest -q -rf -m gpu -p no:cacheprovider tests/backends/test_triton_mla.py -k sparse 2>&1 \
  | tail -15 | tee "$OUT/triton_gpu_tests10_h100.txt"
python3 bench/kernels.py --sparse-only --kv-len 32768 --max-seconds 0.4 --time-budget-s 50 \
  --out "$OUT/kernels-h100-sparse-20261123b.txt" > /dev/null
echo "# call done in $(( $(date +%s) - T0 )) s"
