"""How fast is the runtime lookup a serving engine pays for at startup?

Measures, on this machine:
1. `import mla_tune` in a fresh interpreter (and that no torch/triton/flashinfer/sqlalchemy got loaded);
2. a memoised `mla_tune.lookup` call (median per call);
3. a cold lookup in a new process (interpreter start + import + open SQLite + query) against a bare
   `python -c pass`, on a real SQLite store holding decisions for several GPUs and keys;
4. the same through the `mla-tune lookup` executable, for reference.

Usage: python bench/lookup_speed.py [--runs 30] [--out bench/results/lookup_speed.txt]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

DEVICE = {"name": "NVIDIA H100 80GB HBM3", "compute_capability": (9, 0)}
HEAVY = ("torch", "triton", "flashinfer", "sqlalchemy", "alembic")


def make_store(path: Path) -> str:
    """A real store with decisions for 3 GPUs x 4 heads x 2 dtypes x dense/sparse (48 decisions)."""
    from mla_tune.backends.device import DeviceInfo
    from mla_tune.backends.problem import Problem
    from mla_tune.backends.software import current_fingerprint
    from mla_tune.store.records import Decision, DecisionKey
    from mla_tune.store.repository import Store

    url = f"sqlite:///{path}"
    gpus = [DeviceInfo("NVIDIA H100 80GB HBM3", (9, 0), memory_total_mib=81559, pci_device_id="0x233010DE"),
            DeviceInfo("NVIDIA H200", (9, 0), memory_total_mib=143771, pci_device_id="0x233510DE"),
            DeviceInfo("NVIDIA B200", (10, 0), memory_total_mib=183359, pci_device_id="0x290110DE")]
    with Store.open(url) as store:
        for gpu in gpus:
            for heads in (128, 64, 32, 16):
                for kv in ("bf16", "fp8"):
                    for topk in (None, 2048):
                        key = DecisionKey.of(gpu.sku, gpu.compute_capability,
                                             Problem(num_heads=heads, kv_cache_dtype=kv, topk=topk))
                        store.save_decision(Decision(
                            key=key, winner="TRITON_MLA", static_choice="FLASHMLA",
                            scores={"TRITON_MLA": 1.0, "FLASHINFER_FA3_MLA": 1.1}, runner_up="FLASHINFER_FA3_MLA",
                            margin=0.1, fingerprint=current_fingerprint(), decided_at="2026-11-22T00:00:00Z"))
    return url


def timed_subprocess(args: list[str], env=None) -> float:
    started = time.perf_counter()
    subprocess.run(args, check=True, capture_output=True, env=env)
    return (time.perf_counter() - started) * 1000


def median_ms(samples: list[float]) -> str:
    q = statistics.quantiles(samples, n=4)
    return f"median {statistics.median(samples):7.1f} ms  (IQR {q[0]:.1f}-{q[2]:.1f}, n={len(samples)})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    lines = [f"# lookup speed, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
             f"# {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
             f"Python {platform.python_version()}, "
             f"load average {os.getloadavg()[0]:.1f} at start (other processes share these CPUs)"]

    # 1. import cost in a fresh interpreter
    code = ("import time, sys, json; t = time.perf_counter(); import mla_tune; "
            "dt = (time.perf_counter() - t) * 1000; "
            f"print(json.dumps([dt, [m for m in {HEAVY!r} if m in sys.modules]]))")
    imports, loaded = [], set()
    for _ in range(args.runs):
        out = json.loads(subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                                        text=True).stdout)
        imports.append(out[0])
        loaded.update(out[1])
    lines.append(f"import mla_tune (in-process time, fresh interpreter): {median_ms(imports)}; "
                 f"heavy modules loaded: {sorted(loaded) or 'none'}")

    with tempfile.TemporaryDirectory() as tmp:
        url = make_store(Path(tmp) / "bench.db")

        # 2. memoised lookup, median per call over batches of 1000
        import mla_tune

        mla_tune.lookup(64, "fp8", device=DEVICE, db=url)
        batches = []
        for _ in range(300):
            started = time.perf_counter()
            for _ in range(1000):
                mla_tune.lookup(64, "fp8", device=DEVICE, db=url)
            batches.append((time.perf_counter() - started) * 1e6 / 1000)
        choice = mla_tune.lookup(64, "fp8", device=DEVICE, db=url)
        lines.append(f"memoised lookup (dict device): median {statistics.median(batches):.2f} us per call "
                     f"(min {min(batches):.2f}, 300 batches of 1000); answer {choice.backend} ({choice.source})")

        # 3. cold lookup in a new process vs python -c pass, interleaved
        lookup_code = (f"import mla_tune; c = mla_tune.lookup(64, 'fp8', device={DEVICE!r}, db={url!r}); "
                       "assert c.source == 'tuned', c.why")
        miss_code = (f"import mla_tune; c = mla_tune.lookup(24, 'fp8', device={DEVICE!r}, db={url!r}); "
                     "assert c.source == 'fallback', c.why")
        exe = str(Path(sys.executable).with_name("mla-tune"))
        cli_args = [exe, "--db", url, "lookup", "--heads", "64", "--kv-cache-dtype", "fp8",
                    "--device-name", DEVICE["name"], "--cc", "9.0", "--format", "vllm"]
        bare, hit, miss, cli = [], [], [], []
        for _ in range(args.runs):
            bare.append(timed_subprocess([sys.executable, "-c", "pass"]))
            hit.append(timed_subprocess([sys.executable, "-c", lookup_code]))
            miss.append(timed_subprocess([sys.executable, "-c", miss_code]))
            cli.append(timed_subprocess(cli_args))
        extra_hit = [h - b for h, b in zip(hit, bare)]
        extra_miss = [m - b for m, b in zip(miss, bare)]
        lines += [
            f"python -c pass:                         {median_ms(bare)}",
            f"new process, import + tuned lookup:     {median_ms(hit)}",
            f"new process, import + fallback lookup:  {median_ms(miss)}",
            f"cold tuned lookup adds (paired):        {median_ms(extra_hit)}",
            f"cold fallback lookup adds (paired):     {median_ms(extra_miss)}",
            f"`mla-tune lookup --format vllm` (CLI):  {median_ms(cli)}",
        ]
    text = "\n".join(lines) + "\n"
    print(text, end="")
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
