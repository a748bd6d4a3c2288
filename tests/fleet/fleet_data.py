"""Synthetic but plausible fleet data for the fleet tests (shaped like REFERENCE.md section 5).

Named without a `test_` prefix so pytest does not collect it; tests import it
through `conftest`-free sys.path insertion in each test module.
"""

from __future__ import annotations

import math

from mla_tune.backends.device import SoftwareFingerprint
from mla_tune.backends.engine_names import engine_best
from mla_tune.store.records import Decision, DecisionKey, Measurement, ShapeWinner

SKU = "NVIDIA H200 | 9.0 | 141GiB | 0x233510DE"
FINGERPRINT = SoftwareFingerprint(torch="2.11.0", triton="3.6.0", flashinfer="0.7.2",
                                  cuda_runtime="13.0", driver="580.95", mla_tune="0.1.0", kernel_hash="abc123")
BATCHES = (1, 4, 16, 64, 128)
KV_LENS = (1024, 4096, 16384)


def key(num_heads: int = 64, kv: str = "fp8_e4m3", sku: str = SKU) -> DecisionKey:
    return DecisionKey(sku=sku, compute_capability="9.0", query_dtype="bf16", kv_cache_dtype=kv,
                       num_heads=num_heads)


def model_ms(backend: str, num_heads: int, batch: int, kv_len: int) -> float:
    """A roofline-like time in ms: FA3 wins big shapes, FA2 small ones, our Triton kernel pays per 16 heads,
    and vLLM's FlashMLA sits between them."""
    bytes_ = batch * kv_len * 576
    base = bytes_ / 4.3e12 * 1e3
    if backend == "FLASHINFER_FA3_MLA":
        t = 0.026 + base * 4.0 * (1 + num_heads / 256)
        if num_heads == 64:
            t *= 1.6                                  # the planted anomaly
    elif backend == "FLASHINFER_FA2_MLA":
        t = 0.017 + base * 5.0 * (1 + num_heads / 256)
    elif backend == "FLASHMLA":
        t = 0.030 + base * 4.6 * (1 + num_heads / 256)
    else:
        t = 0.050 + base * 3.2 * max(1, num_heads // 16)
    return round(t, 6)


# What the tuner records for our refined Triton kernel (records.Measurement.params): the winning tile.
TRITON_PARAMS = {"tile": {"block_h": 64, "block_n": 64, "num_warps": 8, "num_stages": 2, "split_d": False,
                          "per_sm": 1, "reload_v": False, "min_split_tokens": 256, "hoist_pages": 0,
                          "fp16_math": False, "max_regs": 0, "split_scores": False, "opaque_v_cast": False,
                          "warp_specialized": True},
                 "label": "h64n64w8s2Wx2", "default_label": "h64n64w8s2Wx4", "default_median_ms": 0.5,
                 "candidates": 4, "rejected": {"h64n64w8s2dx4": "prepare or first run raised ValueError: no"}}


def measurements(k: DecisionKey, *, gpus=("GPU-aaaa",), scale: dict[str, float] | None = None,
                 failed: str | None = "MLA_TUNE_TRITON_SPARSE") -> list[Measurement]:
    out = []
    for gpu in gpus:
        factor = (scale or {}).get(gpu, 1.0)
        for backend in ("FLASHINFER_FA2_MLA", "FLASHINFER_FA3_MLA", "MLA_TUNE_TRITON", "FLASHMLA"):
            for b in BATCHES:
                for n in KV_LENS:
                    t = model_ms(backend, k.num_heads, b, n) * factor
                    out.append(Measurement(key=k, backend=backend, batch_size=b, kv_len=n, status="ok",
                                           median_ms=t, ci_low_ms=t * 0.99, ci_high_ms=t * 1.01, samples=50,
                                           rel_error=0.004, gpu_uuid=gpu, measured_at="2026-11-22T01:00:00Z",
                                           params=TRITON_PARAMS if backend == "MLA_TUNE_TRITON" else None))
        if failed:
            out.append(Measurement(key=k, backend=failed, batch_size=1, kv_len=1024, status="ineligible",
                                   reason="the key is dense and the backend is sparse-only", gpu_uuid=gpu,
                                   measured_at="2026-11-22T01:00:00Z"))
    return out


def decision(k: DecisionKey, ms: list[Measurement], *, fingerprint: SoftwareFingerprint = FINGERPRINT) -> Decision:
    times: dict[str, dict[tuple[int, int], list[float]]] = {}
    for m in ms:
        if m.status == "ok":
            times.setdefault(m.backend, {}).setdefault((m.batch_size, m.kv_len), []).append(m.median_ms)
    med = {b: {s: sorted(v)[len(v) // 2] for s, v in d.items()} for b, d in times.items()}
    shapes = sorted({s for d in med.values() for s in d})
    best = {s: min(med[b][s] for b in med) for s in shapes}
    scores = {b: math.exp(sum(math.log(med[b][s] / best[s]) for s in shapes) / len(shapes)) for b in med}
    ranked = sorted(scores, key=lambda b: (scores[b], b))
    anomalies = ()
    if k.num_heads == 64:
        anomalies = ("FLASHINFER_FA3_MLA at 64 heads is 1.6x slower relative to the best than at 32 and 128 heads",)
    return Decision(key=k, winner=ranked[0], static_choice="FLASHMLA", scores=scores, runner_up=ranked[1],
                    margin=scores[ranked[1]] / scores[ranked[0]] - 1, static_score=scores["FLASHMLA"],
                    noise_margin=0.02, per_shape=tuple(
                        ShapeWinner(b, n, min(med, key=lambda x: med[x][(b, n)]), best[(b, n)]) for b, n in shapes),
                    anomalies=anomalies,
                    failures={"MLA_TUNE_TRITON_SPARSE": "the key is dense and the backend is sparse-only"},
                    fingerprint=fingerprint, gpu_uuids=tuple(sorted({m.gpu_uuid for m in ms})),
                    decided_at="2026-11-22T01:05:00Z", engine_best=engine_best(scores))


def fleet(heads=(16, 32, 64, 128)) -> tuple[list[Decision], list[Measurement]]:
    decisions, all_ms = [], []
    for h in heads:
        k = key(h)
        ms = measurements(k)
        decisions.append(decision(k, ms))
        all_ms += ms
    return decisions, all_ms


def device(uuid: str = "GPU-aaaa", name: str = "NVIDIA H200"):
    from mla_tune.backends.device import DeviceInfo

    return DeviceInfo(name=name, compute_capability=(9, 0), uuid=uuid, memory_total_mib=144384,
                      driver_version="580.95", cuda_driver_version="13.0", max_sm_clock_mhz=1980,
                      power_limit_w=700.0, pci_device_id="0x233510DE")


def populate(store, *, node: str = "node-a", gpus=("GPU-aaaa",), heads=(16, 64), scale=None,
             fingerprint: SoftwareFingerprint = FINGERPRINT) -> list[Decision]:
    """Write a real tune's worth of records for `gpus` of one node through the Store API."""
    decisions = []
    run_ids = {}
    for gpu in gpus:
        run_ids[gpu] = store.start_run(device=device(gpu), fingerprint=fingerprint, preset="quick", node=node)
    for h in heads:
        k = key(h)
        ms = measurements(k, gpus=gpus, scale=scale)
        for m in ms:
            store.add_measurement(run_ids[m.gpu_uuid], m)
        d = decision(k, ms, fingerprint=fingerprint)
        store.save_decision(d, node=node)
        decisions.append(d)
    for run_id in run_ids.values():
        store.finish_run(run_id)
    return decisions
