#!/usr/bin/env bash
# The H200 evidence in one device call on `nvidia-h200-x2` (two H200s), from the repository root:
#   1. the official kernel benchmark on REFERENCE.md section 5's shapes and the dense grid (GPU 0),
#   2. the tuner end to end: the default preset cold (stage 1), warm again for stability (stage 2),
#      and `--gpus all --quick` over both GPUs (stage 5),
#   3. the tuner's GPU test.
# Carry [".whl"]; everything lands under $OUT.
set -uo pipefail
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target .site .whl/*.whl || exit 1
export PYTHONPATH=$PWD/.site:${PYTHONPATH:-}
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . >/dev/null || exit 1
export FLASHINFER_CUDA_ARCH_LIST=9.0a MAX_JOBS=16 PYTHONUNBUFFERED=1
nvidia-smi -L
CUDA_VISIBLE_DEVICES=0 timeout 150 python3 bench/kernels.py --reference-shapes --max-seconds 0.4 \
  --out "$OUT/kernels-h200-reference-shapes.txt" 2>&1 | tail -25
STAGES="${STAGES:-1 2 5}" timeout 330 bash bench/tuner_e2e.sh > /dev/null 2>&1
cat "$OUT/timings.txt" "$OUT/stability.txt" 2>/dev/null
grep -E "slower|Measured|Time went" "$OUT/e2e.log" | head
timeout 90 python3 -m pytest -m gpu -q -p no:cacheprovider tests/tuner/test_tune_gpu.py 2>&1 | tail -3
