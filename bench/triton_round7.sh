#!/usr/bin/env bash
# Device call 26 of the Triton MLA work (round 7): the FP8 V reload cast by an opaque inline-asm cvt. First its
# GPU correctness tests, then the same-process A/Bs (winners written into launch.py by the 0.97 / 1.10 rule),
# then, if anything changed, the kernel's whole GPU test file on the applied table.
# Usage (device root, after installing the wheels): OUT=dir bash bench/triton_round7.sh
set -uo pipefail
T0=$(date +%s)
timeout 150 python3 -m pytest -q -rf -m gpu -p no:cacheprovider tests/backends/test_triton_mla.py -k opaque 2>&1 \
  | tail -4 | tee "$OUT/triton_gpu_tests_opaque_h100.txt"
grep -q " passed" "$OUT/triton_gpu_tests_opaque_h100.txt" && ! grep -q "failed" "$OUT/triton_gpu_tests_opaque_h100.txt" \
  || { echo "# opaque cast not correct: no A/B"; exit 1; }
cp backends/triton_mla/launch.py /tmp/launch_before.py
python3 bench/triton_dev.py vcast --apply --budget-s 110 --out "$OUT/triton_vcast_h100.txt" > /dev/null
python3 bench/triton_dev.py vcast_sparse --apply --budget-s 80 --out "$OUT/triton_vcast_sparse_h100.txt" > /dev/null
grep -h "^# hoist" "$OUT/triton_vcast_h100.txt" "$OUT/triton_vcast_sparse_h100.txt"
echo "# A/B done at $(( $(date +%s) - T0 )) s"
if cmp -s /tmp/launch_before.py backends/triton_mla/launch.py; then echo "# nothing applied"; exit 0; fi
cp backends/triton_mla/launch.py "$OUT/launch_applied.py"
timeout $(( 560 - ($(date +%s) - T0) )) python3 -m pytest -q -rf -m gpu -p no:cacheprovider \
  tests/backends/test_triton_mla.py 2>&1 | tail -6 | tee "$OUT/triton_gpu_tests18_h100.txt"
echo "# call done in $(( $(date +%s) - T0 )) s"
