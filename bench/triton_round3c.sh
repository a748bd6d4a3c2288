#!/usr/bin/env bash
# Device call 9 of the Triton MLA work (round 3): the 64-row tiles with the score matmul split between
# warpgroups (split_scores) against the shipped tiles (winners written into launch.py), then the full
# GPU test file, the official dense and sparse benchmarks and the ragged issue-4 grid on the result.
# Usage (device root, after installing the wheels): OUT=dir bash bench/triton_round3c.sh
set -uo pipefail
T0=$(date +%s)
left() { echo $(( ${1} - ($(date +%s) - T0) )); }
python3 bench/triton_dev.py scores --apply --budget-s 120 --out "$OUT/triton_scores_h100.txt"
cp backends/triton_mla/launch.py "$OUT/launch_applied.py"
timeout 200 python3 -m pytest -q -rf -m gpu tests/backends/test_triton_mla.py 2>&1 | tail -15 \
  | tee "$OUT/triton_gpu_tests8_h100.txt"
python3 bench/kernels.py --dense-only --max-seconds 0.4 --time-budget-s "$(( $(left 400) < 150 ? $(left 400) : 150 ))" \
  --out "$OUT/kernels-h100-dense-20261122.txt" > /dev/null
python3 bench/kernels.py --sparse-only --kv-len 32768 --max-seconds 0.4 --time-budget-s 50 \
  --out "$OUT/kernels-h100-sparse-20261122.txt" > /dev/null
G=$(left 530)
echo "# grid budget ${G}s"
if [ "$G" -gt 40 ]; then
  python3 bench/triton_dev.py grid --flashinfer --grid-budget-s "$G" --out "$OUT/triton_grid7_h100.txt" > /dev/null
fi
echo "# call done in $(( $(date +%s) - T0 )) s"
