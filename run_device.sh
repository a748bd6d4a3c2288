set -u
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target .site .whl/*.whl >/dev/null 2>&1
python3 bench/vllm_site.py >/dev/null
export PYTHONPATH=$PWD/.vsite:$PWD/.site:${PYTHONPATH:-}
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . >/dev/null 2>&1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/tuner/test_engine_launch_gpu.py tests/tuner/test_prewarm_gpu.py tests/vllm_engine/test_launch_gpu.py tests/vllm_engine/test_forward.py 2>&1 | tail -4
OUT=$OUT STAGES="1" timeout 300 bash bench/tuner_e2e.sh > $OUT/e2e_stdout.txt 2>&1
grep -E "^1 |Measured|Time went|Note: JIT" $OUT/timings.txt $OUT/e2e.log | cut -c1-600 | head
C=$(ls -d /tmp/mla-tune-e2e.*/triton | head -1)
python3 - "$C" <<'PY' | tee $OUT/cache_times.txt
import os, sys
root = sys.argv[1]
files = []
for d, _, fs in os.walk(root):
    for f in fs:
        if f.endswith(".json") and not f.startswith("__grp__"):
            files.append((os.path.getmtime(os.path.join(d, f)), f))
t0 = min(t for t, _ in files)
hop = sorted(t - t0 for t, f in files if f.startswith("_mla_hopper_kernel"))
print("hopper kernel builds:", len(hop), "written at s:", " ".join(f"{t:.0f}" for t in hop))
other = sorted((t - t0, f) for t, f in files if not f.startswith("_mla_hopper_kernel"))
print("other kernels:", len(other), "last at", f"{other[-1][0]:.0f}" if other else "-")
PY
