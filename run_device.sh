set -u
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target .site .whl/*.whl >/dev/null 2>&1
python3 bench/vllm_site.py >/dev/null
export PYTHONPATH=$PWD/.vsite:$PWD/.site:${PYTHONPATH:-}
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . >/dev/null 2>&1
timeout 120 python3 -m pytest -q -p no:cacheprovider -m gpu -x tests/backends/test_triton_mla_fp8_query.py 2>&1 | tail -2
G="python3 bench/kernels.py --dense-only --kv-dtype fp8_e4m3 --backends MLA_TUNE_TRITON,MLA_TUNE_TRITON_FP8Q,FLASHMLA --max-seconds 0.2"
timeout 160 $G --ragged --time-budget-s 120 > $OUT/grid_ragged.txt 2>$OUT/grid_ragged.err; echo rc=$?
timeout 150 $G --time-budget-s 110 > $OUT/grid_uniform.txt 2>$OUT/grid_uniform.err; echo rc=$?
python3 bench/kernels_summary.py --ours MLA_TUNE_TRITON,MLA_TUNE_TRITON_FP8Q $OUT/grid_ragged.txt 2>&1 | tail -25
python3 bench/kernels_summary.py --ours MLA_TUNE_TRITON,MLA_TUNE_TRITON_FP8Q $OUT/grid_uniform.txt 2>&1 | tail -25
cd bench
timeout 120 python3 forms_ab.py --form any --dense-only --max-seconds 0.15 --ours MLA_TUNE_TRITON_FP8Q --others FLASHMLA --kv-dtype fp8_e4m3 --heads 16 --batch 4,16,64,128 --kv-len 1024,2048,4096,16384 --time-budget-s 90 --set "FP8_QUERY_WIDE_MIN_WORK={**FP8_QUERY_WIDE_MIN_WORK, 16: 1 << 21}" --set "FP8_QUERY_WIDE_MIN_WORK={**FP8_QUERY_WIDE_MIN_WORK, 16: 1 << 20}" --out $OUT/ab_threshold16.txt > /dev/null 2>&1; echo rc=$?
grep "^#.*A / \|geomean" $OUT/ab_threshold16.txt | tail -20
