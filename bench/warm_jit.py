"""Build FlashInfer's fa2/fa3 MLA modules (bf16 and fp8 KV) in parallel before tests or benchmarks.

Each (backend, KV dtype) pair JIT-compiles for ~25 s on first use; building
the four in separate processes at once overlaps them. The modules land in
FlashInfer's cache ($FLASHINFER_WORKSPACE_BASE/.cache/flashinfer), which later
processes reuse.

    python3 bench/warm_jit.py
"""

from __future__ import annotations

import subprocess
import sys
import time

PAIRS = [(name, kv) for name in ("FLASHINFER_FA2_MLA", "FLASHINFER_FA3_MLA") for kv in ("bf16", "fp8_e4m3")]


def build_one(name: str, kv: str) -> None:
    from mla_tune.backends.inputs import make_inputs
    from mla_tune.backends.problem import Problem, Shape
    from mla_tune.backends.registry import load_adapter

    problem = Problem(num_heads=16, kv_cache_dtype=kv, page_size=64)
    load_adapter(name)().prepare(problem, make_inputs(problem, Shape(1, 100), device="cuda"))


def main() -> int:
    if len(sys.argv) == 3:
        build_one(sys.argv[1], sys.argv[2])
        return 0
    t0 = time.perf_counter()
    procs = {pair: subprocess.Popen([sys.executable, __file__, *pair]) for pair in PAIRS}
    failed = [pair for pair, proc in procs.items() if proc.wait() != 0]
    print(f"warm_jit: built {len(PAIRS) - len(failed)}/{len(PAIRS)} modules in "
          f"{time.perf_counter() - t0:.0f} s; failed: {failed or 'none'}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
