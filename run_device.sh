#!/bin/bash
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target .site .whl/*.whl >/dev/null 2>&1
python3 bench/vllm_site.py >/dev/null
export PYTHONPATH=$PWD/.vsite:$PWD/.site:${PYTHONPATH:-}
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . >/dev/null 2>&1
NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu | head -1)
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
case "$1" in
tests)
  timeout 300 python3 -m pytest -q -m gpu -p no:cacheprovider -x tests/backends/test_triton_mla_fp8_query.py 2>&1 | tail -15
  ;;
ptests)
  timeout 300 python3 -m pytest -q -m gpu -p no:cacheprovider -x tests/backends/test_triton_mla_fp8_query.py -k "persistent or edge" 2>&1 | tail -3
  ;;
ncu)
  shift
  cd bench && $NCU --clock-control none --metrics gpu__time_duration.sum -c 12 --csv python3 profile_one.py MLA_TUNE_TRITON_FP8Q --launches 3 "$@" 2>/dev/null | grep '^"[0-9]' | awk -F'","' '{printf "%s | %s\n", substr($5,1,40), $NF}'
  ;;
ab)
  shift
  cd bench && timeout 400 python3 forms_ab.py --form fp8_query_wide --ours MLA_TUNE_TRITON_FP8Q --others FLASHMLA --dense-only --kv-dtype fp8_e4m3 --max-seconds 0.15 "$@" 2>&1 | tail -40
  ;;
esac
