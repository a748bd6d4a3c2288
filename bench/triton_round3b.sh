#!/usr/bin/env bash
# Device call 8 of the Triton MLA work (round 3): 8-warp 16/32-row tiles with a register cap against the shipped
# tiles (winners written into launch.py), then the full GPU test file, the official dense
# and sparse benchmarks and the ragged issue-4 grid on the result.
# Usage (device root, after installing the wheels): OUT=dir bash bench/triton_round3b.sh
set -uo pipefail
T0=$(date +%s)
left() { echo $(( ${1} - ($(date +%s) - T0) )); }
python3 bench/triton_dev.py regs --apply --budget-s 130 --out "$OUT/triton_regs_h100.txt"
cp backends/triton_mla/launch.py "$OUT/launch_applied.py"
timeout 160 python3 -m pytest -q -rf -m gpu tests/backends/test_triton_mla.py 2>&1 | tail -15 \
  | tee "$OUT/triton_gpu_tests7_h100.txt"
python3 bench/kernels.py --dense-only --max-seconds 0.4 --time-budget-s "$(( $(left 470) < 150 ? $(left 470) : 150 ))" \
  --out "$OUT/kernels-h100-dense-20261122.txt" > /dev/null
python3 bench/kernels.py --sparse-only --kv-len 32768 --max-seconds 0.4 --time-budget-s 55 \
  --out "$OUT/kernels-h100-sparse-20261122.txt" > /dev/null
G=$(left 525)
echo "# grid budget ${G}s"
if [ "$G" -gt 40 ]; then
  python3 bench/triton_dev.py grid --flashinfer --grid-budget-s "$G" --out "$OUT/triton_grid6_h100.txt" > /dev/null
fi
echo "# call done in $(( $(date +%s) - T0 )) s"
