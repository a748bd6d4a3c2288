"""The decision rule's engine part: each engine's fastest own backend, and a static choice that loses."""

from __future__ import annotations

from mla_tune.store.records import DecisionKey, Measurement
from mla_tune.tuner.decide import decide, with_anomalies

KEY = DecisionKey(sku="NVIDIA H100 80GB HBM3 | 9.0 | 80GiB | 0x2330", compute_capability="9.0",
                  query_dtype="bf16", kv_cache_dtype="fp8_e4m3", num_heads=64, topk=2048)


def _times(**ms_by_backend) -> list[Measurement]:
    return [Measurement(key=KEY, backend=backend, batch_size=b, kv_len=32768, status="ok", median_ms=ms * b,
                        ci_low_ms=ms * b * 0.995, ci_high_ms=ms * b * 1.005, samples=20)
            for backend, ms in ms_by_backend.items() for b in (1, 16, 128)]


def test_engine_best_is_the_fastest_backend_the_engine_runs_under_its_own_name():
    d = decide(KEY, _times(MLA_TUNE_TRITON_SPARSE=1.0, FLASHMLA_SPARSE=1.45, FLASH_ATTN_MLA_SPARSE=1.2,
                           FLASHINFER_FA3_MLA_SPARSE=1.1), static_choice="FLASHMLA_SPARSE")
    assert d.winner == "MLA_TUNE_TRITON_SPARSE"          # the fastest kernel overall
    assert d.engine_best["vllm"] == "FLASH_ATTN_MLA_SPARSE"   # ours and FlashInfer's wrapper are not vLLM's


def test_a_static_choice_slower_than_vllms_own_best_is_an_anomaly():
    d = decide(KEY, _times(MLA_TUNE_TRITON_SPARSE=1.0, FLASHMLA_SPARSE=1.45, FLASH_ATTN_MLA_SPARSE=1.2),
               static_choice="FLASHMLA_SPARSE")
    (flagged,) = with_anomalies([d])
    assert any("vLLM's static choice FLASHMLA_SPARSE takes 1.21x the time of vLLM's fastest backend "
               "FLASH_ATTN_MLA_SPARSE at 64 heads" in a for a in flagged.anomalies)
    close = decide(KEY, _times(MLA_TUNE_TRITON_SPARSE=1.0, FLASHMLA_SPARSE=1.25, FLASH_ATTN_MLA_SPARSE=1.2),
                   static_choice="FLASHMLA_SPARSE")
    assert not with_anomalies([close])[0].anomalies       # 4% is not worth an operator's attention
