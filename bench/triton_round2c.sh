#!/usr/bin/env bash
# Device call 6 of the Triton MLA work (round 2): the split partials' cost in the split-size model
# (winner written into launch.py); if it changed the default, the full GPU test file, the official
# dense and sparse benchmarks and the ragged issue-4 grid on the result.
# Usage (device root, after installing the wheels): OUT=dir bash bench/triton_round2c.sh
set -uo pipefail
T0=$(date +%s)
python3 bench/triton_dev.py partials --apply --budget-s 120 --out "$OUT/triton_partials_h100.txt"
cp backends/triton_mla/launch.py "$OUT/launch_applied.py"
if grep -q "^PARTIAL_ROW_TOKENS = 0.0$" backends/triton_mla/launch.py; then
  echo "# default unchanged; nothing more to measure"; exit 0
fi
timeout 170 python3 -m pytest -q -rf -m gpu tests/backends/test_triton_mla.py 2>&1 | tail -15 \
  | tee "$OUT/triton_gpu_tests5_h100.txt"
python3 bench/kernels.py --dense-only --max-seconds 0.4 --time-budget-s 150 \
  --out "$OUT/kernels-h100-dense-20261122.txt" > /dev/null
python3 bench/kernels.py --sparse-only --kv-len 32768 --max-seconds 0.4 --time-budget-s 60 \
  --out "$OUT/kernels-h100-sparse-20261122.txt" > /dev/null
G=$(( 470 - ($(date +%s) - T0) ))
echo "# grid budget ${G}s"
if [ "$G" -gt 40 ]; then
  python3 bench/triton_dev.py grid --flashinfer --grid-budget-s "$G" --out "$OUT/triton_grid4_h100.txt" > /dev/null
fi
echo "# call done in $(( $(date +%s) - T0 )) s"
