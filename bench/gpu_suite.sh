#!/usr/bin/env bash
# Every GPU test (`pytest -m gpu`) on the lent machine, with the GPU and software versions on top.
# Usage (device root, after installing the wheels): OUT=dir COMMIT=abc1234 bash bench/gpu_suite.sh NAME
set -uo pipefail
F="$OUT/gpu-suite-$1.txt"
{
  echo "# command: python3 -m pytest -m gpu -q -rs tests/   ($(date -u +%Y-%m-%dT%H:%MZ), commit ${COMMIT:-unknown})"
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | sed 's/^/# gpu /'
  python3 -c "import torch, triton, flashinfer; print('# torch', torch.__version__, 'triton', triton.__version__, 'flashinfer', flashinfer.__version__)"
} > "$F"
timeout 555 python3 -m pytest -m gpu -q -rs -p no:cacheprovider tests/ 2>&1 | tail -60 >> "$F"
tail -5 "$F"
