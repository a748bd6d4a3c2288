#!/usr/bin/env bash
# The tuner end to end on one GPU node: cold and warm wall time, decision stability, resume.
#
# Run from the repository root on a GPU machine with mla-tune[gpu] installed (wheels in .whl/ are
# installed first when present, for machines without network access):
#     OUT=out bash bench/tuner_e2e.sh
# Everything lands under $OUT:
#     e2e.log            all output, with the printed decision tables
#     timings.txt        wall seconds of each stage (cold JIT, warm, --quick, resume)
#     show_first.json    `mla-tune show --json` after the first (cold) default tune
#     show_second.json   the same after the second (warm) default tune, a separate store
#     stability.txt      bench/tuner_stability.py on the two (2% / 95% / noise criteria)
#     show_quick.json    `mla-tune show --json` of the --quick tune
#     show_multi_gpu.json  the same for `--gpus all` (stage 5, two or more GPUs)
#
# Stages (each guarded by `timeout`; 1-4 together take at most 525 s):
#  1. cold: fresh FlashInfer and Triton caches, `mla-tune tune --budget-s 255` (the default
#     preset; the budget makes an over-long run stop and say so instead of being killed) into store 1;
#  2. warm: same caches, the no-argument main job `mla-tune` into store 2 (a separate store, so
#     nothing is skipped as already tuned): the JIT-warm time and the decision-stability re-run;
#  3. quick: `mla-tune tune --quick` warm, into store 3;
#  4. resume: a 2-key quick tune with `--budget-s 20` into store 4 (stops early), then `--resume`
#     finishes it; prints how many (key, backend, shape) were measured twice (must be 0);
#  5. (only with 2+ GPUs) `--gpus all --quick` into store 5: parallel workers, one shared
#     decision per key from both GPUs, a slower GPU reported.
# STAGES (default "1 2 3 4 5") picks stages; 2 needs 1's show_first.json for the stability check.
set -uo pipefail
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
LOG=$OUT/e2e.log
exec > >(tee -a "$LOG") 2>&1

if [ -d .whl ] && ! python3 -c "import flashinfer, sqlalchemy" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target .site .whl/*.whl
fi
export PYTHONPATH=$PWD/.site:${PYTHONPATH:-}
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . >/dev/null
export FLASHINFER_CUDA_ARCH_LIST=${FLASHINFER_CUDA_ARCH_LIST:-9.0a} MAX_JOBS=${MAX_JOBS:-16} PYTHONUNBUFFERED=1
MLA="python3 -c 'from mla_tune.cli.main import main; main()'"
python3 -c "import mla_tune.cli.main" || exit 1
command -v mla-tune >/dev/null && MLA=mla-tune
mla() { eval "$MLA" '"$@"'; }
export -f mla; export MLA

WORK=$(mktemp -d /tmp/mla-tune-e2e.XXXX)
export FLASHINFER_WORKSPACE_BASE=$WORK/flashinfer TRITON_CACHE_DIR=$WORK/triton MLA_TUNE_LOCK_DIR=$WORK/locks
mkdir -p "$FLASHINFER_WORKSPACE_BASE" "$TRITON_CACHE_DIR"
TIMES=$OUT/timings.txt
: > "$TIMES"

stage() {  # stage NAME LIMIT_S MLA-TUNE-ARGS...
  local name=$1 limit=$2; shift 2
  echo; echo "=== $name: mla-tune $* (limit ${limit} s) ==="
  local t0 t1 rc i
  # Workers of a stage that was cut short may still be exiting; mla-tune refuses a busy GPU.
  for i in $(seq 30); do
    [ -z "$(nvidia-smi --query-compute-apps=pid --format=csv,noheader 2>/dev/null)" ] && break
    sleep 1
  done
  t0=$(date +%s%N)
  timeout --signal=INT --kill-after=10 "$limit" bash -c 'mla "$@"' mla "$@"
  rc=$?
  t1=$(date +%s%N)
  printf '%-32s %6d.%01d s  exit %d\n' "$name" $(( (t1 - t0) / 1000000000 )) $(( (t1 - t0) / 100000000 % 10 )) "$rc" \
    | tee -a "$TIMES"
  return 0
}

nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv | tee -a "$TIMES"
python3 -c "import torch, triton, flashinfer; print('torch', torch.__version__, 'triton', triton.__version__, 'flashinfer', flashinfer.__version__)" | tee -a "$TIMES"
mla probe

STAGES=" ${STAGES:-1 2 3 4 5} "
want() { [[ "$STAGES" == *" $1 "* ]]; }

if want 1; then
  stage "1 cold default tune" 270 --db "sqlite:///$WORK/first.db" tune --budget-s 255
  mla --db "sqlite:///$WORK/first.db" show --json > "$OUT/show_first.json"
fi

if want 2; then
  stage "2 warm main job (mla-tune)" 120 --db "sqlite:///$WORK/second.db"
  mla --db "sqlite:///$WORK/second.db" show --json > "$OUT/show_second.json"
  if [ -s "$OUT/show_first.json" ]; then
    python3 bench/tuner_stability.py "$OUT/show_first.json" "$OUT/show_second.json" | tee "$OUT/stability.txt"
  fi
fi

if want 3; then
  stage "3 warm --quick tune" 60 --db "sqlite:///$WORK/quick.db" tune --quick
  mla --db "sqlite:///$WORK/quick.db" show --json > "$OUT/show_quick.json"
fi

if want 4; then
  stage "4a 2-key quick, --budget-s 20" 35 --db "sqlite:///$WORK/resume.db" tune --quick --tp 2,8 \
    --kv-cache-dtype bf16 --budget-s 20
  stage "4b the same with --resume" 40 --db "sqlite:///$WORK/resume.db" tune --quick --tp 2,8 \
    --kv-cache-dtype bf16 --resume
  python3 - "$WORK/resume.db" <<'EOF' | tee -a "$TIMES"
import collections, sys
from mla_tune.store.repository import Store
with Store.open("sqlite:///" + sys.argv[1], create=False) as store:
    rows = [m for m in store.measurements() if m.status != "ineligible"]
    twice = [k for k, n in collections.Counter((m.key, m.backend, m.batch_size, m.kv_len, m.gpu_uuid)
                                               for m in rows).items() if n > 1]
    print(f"resume: {len(rows)} measurements, {len(twice)} (key, backend, shape) measured twice, "
          f"{len(store.decisions())} decisions, runs {[r.status for r in store.runs()]}")
EOF
fi

if want 5 && [ "$(nvidia-smi -L | wc -l)" -ge 2 ]; then
  stage "5 --gpus all --quick" 200 --db "sqlite:///$WORK/multi.db" tune --quick --gpus all
  mla --db "sqlite:///$WORK/multi.db" show --json > "$OUT/show_multi_gpu.json"
fi

echo; cat "$TIMES"
