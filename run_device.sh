set -u
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target .site .whl/*.whl >/dev/null 2>&1
python3 bench/vllm_site.py >/dev/null
export PYTHONPATH=$PWD/.vsite:$PWD/.site:${PYTHONPATH:-}
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . >/dev/null 2>&1
timeout 120 python3 -m pytest -q -p no:cacheprovider -m gpu -x tests/backends/test_triton_mla_fp8_query.py 2>&1 | tail -2
cd bench
AB="python3 forms_ab.py --form fp8_query_wide --dense-only --max-seconds 0.15 --ours MLA_TUNE_TRITON_FP8Q --others FLASHMLA --kv-dtype fp8_e4m3 --set FP8Q_WIDE_ROW_AHEAD=False"
timeout 200 $AB --heads 16,32,64,128 --batch 16,64,128 --kv-len 4096,16384 --uniform --time-budget-s 150 --out $OUT/ab_uniform.txt > /dev/null 2>&1; echo rc=$?
timeout 110 $AB --heads 64,128 --batch 16,64,128 --kv-len 4096,16384 --time-budget-s 80 --out $OUT/ab_ragged.txt > /dev/null 2>&1; echo rc=$?
for f in $OUT/ab_*.txt; do echo "== $f"; grep "A / B" $f | tail -30; grep -c " ok" $f; done
