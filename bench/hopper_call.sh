#!/usr/bin/env bash
# One device call for the warp-specialised Hopper kernel: install, smoke test under a timeout (a deadlocked
# pipeline must not eat the call), then what the variables ask for: the official grids (GRID=1), a same-process A/B
# against the shipped tl tiles (AB_ARGS), measurement modes (DEBUG_MODES), the kernel's GPU tests (TEST_K; "all":
# every one).
# Usage (device root): OUT=dir NAME=h100-call37 [FORM=wide_ks] [GRID=1] [AB_ARGS="..."] [DEBUG_MODES="..."] \
#   [TEST_K="..."] bash bench/hopper_call.sh
# FORM: the form the smoke cases run in (`_params`' form, "wide" by default; "wide_ks" for the k-split form).
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target .site .whl/*.whl
export PYTHONPATH=$PWD/.site${PYTHONPATH:+:$PYTHONPATH}
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . >/dev/null 2>&1
export FLASHINFER_CUDA_ARCH_LIST=9.0a MAX_JOBS=16 PYTHONUNBUFFERED=1
NAME=${NAME:-h100}
{
  echo "# $(date -u +%Y-%m-%dT%H:%MZ) $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader)"
  python3 -c "import torch, triton; print('# torch', torch.__version__, 'triton', triton.__version__)"
} | tee "$OUT/env-$NAME.txt"
timeout ${SMOKE_S:-150} python3 - <<'PY' 2>&1 | tee "$OUT/smoke-$NAME.txt"
import os, sys, time
import pytest
sys.path.insert(0, "tests/backends")
import torch
from test_triton_mla import _run_case
from test_triton_mla_hopper import _params
from mla_tune.backends.problem import Problem, Shape
cases = [("bf16", 64, 1, 64, None), ("fp8_e4m3", 64, 1, 64, None), ("bf16", 20, 2, 16, None),
         ("fp8_e4m3", 3, 2, 128, None), ("bf16", 128, 1, 1, 2048), ("fp8_e4m3", 16, 2, 64, 2048)]
for kv, heads, q_len, page, topk in cases:
    t = time.time()
    lens = [1, 15, 16, 17, 1000, 0, 5000, 777]
    batch = len(lens)
    try:
        params = _params(kv, heads=heads, q_len=q_len, batch=batch, max_items=topk or 5000,
                         lengths=[topk] * batch if topk else [max(n, q_len) if n else 0 for n in lens],
                         sparse=bool(topk), form=os.environ.get("FORM", "wide"))
    except pytest.skip.Exception as exc:  # the form does not take this case
        print(kv, heads, q_len, page, topk, "skipped:", exc, flush=True)
        continue
    problem = Problem(num_heads=heads, kv_cache_dtype=kv, page_size=page, q_len=q_len, topk=topk)
    r = _run_case(problem, Shape(batch, 5000), device="cuda", params=params,
                  seq_lens=None if topk else [max(n, q_len) if n else 0 for n in lens])
    print(kv, heads, q_len, page, topk, params.label(), r, f"{time.time() - t:.1f}s", flush=True)
PY
if [ -n "${GRID:-}" ]; then  # the official grids with FlashInfer, on the shipped defaults
  timeout ${GRID_S:-400} bash bench/final_grid.sh "$NAME" 2>&1 | tail -30 | tee "$OUT/grid-summary-$NAME.txt"
fi
if [ -n "${AB_ARGS:-}" ]; then
  timeout ${AB_S:-260} python3 bench/hopper_dev.py --out "$OUT/ab-$NAME.txt" ${AB_ARGS} 2>&1 | tail -3
fi
for mode in ${DEBUG_MODES:-}; do
  timeout ${DEBUG_S:-60} python3 bench/hopper_dev.py --debug $mode --shapes big --heads 16,64,128 ${DEBUG_ARGS:-} \
    --out "$OUT/debug-$NAME.txt" 2>&1 | tail -1
done
if [ -n "${TEST_K:-}" ]; then
  [ "$TEST_K" = all ] && TEST_K=""
  timeout ${TEST_S:-150} python3 -m pytest -q -m gpu -p no:cacheprovider tests/backends/test_triton_mla_hopper.py \
    ${TEST_K:+-k "$TEST_K"} 2>&1 | tail -25 > "$OUT/tests-$NAME.txt"
  tail -3 "$OUT/tests-$NAME.txt"
fi
if [ -f "$OUT/ab-$NAME.txt" ]; then grep "^#" "$OUT/ab-$NAME.txt" | tail -8; fi
