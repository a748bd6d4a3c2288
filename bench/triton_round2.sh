#!/usr/bin/env bash
# Device call 4 of the Triton MLA work (round 2), as run on the lent H100:
# hoisted-page candidates vs the shipped tiles (winners written into launch.py), GPU tests,
# the official dense and sparse benchmarks, then the ragged issue-4 grid while time is left.
# Usage (device root, after installing the wheels): OUT=dir bash bench/triton_round2.sh
set -uo pipefail
T0=$(date +%s)
left() { echo $(( ${1} - ($(date +%s) - T0) )); }
python3 bench/triton_dev.py hoist --apply --budget-s 120 --out "$OUT/triton_hoist_h100.txt"
cp backends/triton_mla/launch.py "$OUT/launch_applied.py"
timeout 60 python3 -m pytest -q -m gpu tests/backends/test_triton_mla.py \
  -k "edge_lengths or cuda_graph or short_requests" 2>&1 | tail -15 \
  | tee "$OUT/triton_gpu_tests3_h100.txt"
python3 bench/kernels.py --dense-only --max-seconds 0.4 --time-budget-s 170 \
  --out "$OUT/kernels-h100-dense-20261122.txt" > /dev/null
python3 bench/kernels.py --sparse-only --kv-len 32768 --max-seconds 0.4 --time-budget-s 60 \
  --out "$OUT/kernels-h100-sparse-20261122.txt" > /dev/null
G=$(left 470)
echo "# grid budget ${G}s"
if [ "$G" -gt 40 ]; then
  python3 bench/triton_dev.py grid --flashinfer --grid-budget-s "$G" --out "$OUT/triton_grid2_h100.txt" > /dev/null
fi
echo "# call done in $(( $(date +%s) - T0 )) s"
