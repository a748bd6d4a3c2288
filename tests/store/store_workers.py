"""Worker processes for the concurrency test (a module of its own so that `spawn` can import it)."""

from __future__ import annotations

import sys
import traceback

from store_samples import FP, H100, decision, key, measurement

SHARED_HEADS = (8, 16, 32, 64)
MEASUREMENTS_PER_WORKER = 30


def write_concurrently(url: str, worker: int, barrier) -> None:
    """Open the (maybe unmigrated) store at once with the others, then write overlapping rows."""
    from mla_tune.store.repository import Store

    try:
        barrier.wait(timeout=60)
        with Store.open(url, busy_timeout_s=30) as store:
            run_id = store.start_run(device=H100, fingerprint=FP, preset="quick", node=f"node-{worker}")
            for i in range(MEASUREMENTS_PER_WORKER):
                heads = SHARED_HEADS[i % len(SHARED_HEADS)]
                store.add_measurement(run_id, measurement(key(num_heads=heads), f"W{worker}",
                                                          kv_len=1024 * (i + 1), median_ms=0.01 * (i + 1)))
                if i % 3 == 0:
                    store.save_decision(decision(key(num_heads=heads), f"W{worker}"), node=f"node-{worker}")
            store.save_decision(decision(key(num_heads=1000 + worker), f"W{worker}"))
            store.finish_run(run_id, "done")
    except BaseException:
        traceback.print_exc()
        sys.exit(1)
