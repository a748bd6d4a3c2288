"""The correctness gate: a backend's output must agree with the float32 reference before it is timed.

Relative error is ||out - ref|| / ||ref|| over the whole output (Frobenius,
in float32). bf16/fp16 caches: 1e-2 (a bf16 output alone rounds at ~4e-3).
FP8 caches: 2e-2 against the reference run on the dequantised cache, since
backends may dequantise in a different order or convert q to fp8. The
log-sum-exp is checked too (max absolute difference, natural log), because
engines merge partial attention with it.
"""

from __future__ import annotations

from dataclasses import dataclass

REL_ERROR_LIMIT = {"bf16": 1e-2, "fp16": 1e-2}
FP8_REL_ERROR_LIMIT = 2e-2
LSE_ABS_LIMIT = 5e-2
# A kernel that also quantizes q to e4m3 (vLLM's FlashMLA FP8, trtllm-gen FP8): rounding q alone to 3 mantissa
# bits moves the output by about 3.7 % and the lse by about 0.033 against the reference (CPU, 16-128 heads).
FP8_QUERY_REL_ERROR_LIMIT = 6e-2
FP8_QUERY_LSE_ABS_LIMIT = 1e-1


@dataclass(frozen=True)
class GateResult:
    ok: bool
    rel_error: float | None
    reason: str = ""          # empty when ok


def rel_error_limit(kv_cache_dtype: str, *, fp8_query: bool = False) -> float:
    """The relative-error threshold for a KV-cache dtype (canonical name); looser when q is quantized to e4m3."""
    if fp8_query and kv_cache_dtype.startswith("fp8"):
        return FP8_QUERY_REL_ERROR_LIMIT
    return REL_ERROR_LIMIT.get(kv_cache_dtype, FP8_REL_ERROR_LIMIT)


def quantizes_query(backend: str, kv_cache_dtype: str) -> bool:
    """True when `backend` rounds q to e4m3 with this KV dtype (its capabilities say so)."""
    from mla_tune.backends.registry import BACKENDS

    info = BACKENDS.get(backend)
    return bool(info and info.capabilities.fp8_quantizes_query and kv_cache_dtype.startswith("fp8"))


def check_output(out, lse, ref_out, ref_lse, *, kv_cache_dtype: str, fp8_query: bool = False) -> GateResult:
    """Compare a backend's (out, lse) with the reference's.

    Args:
        out: `[batch, q_len, heads, kv_lora_rank]` from the backend.
        lse: `[batch, q_len, heads]` fp32 (natural log) from the backend, or None.
        ref_out: the reference output, same shape (any float dtype).
        ref_lse: the reference lse, same shape.
        kv_cache_dtype: canonical dtype, selects the threshold.
        fp8_query: the backend quantizes q to e4m3 (`quantizes_query`): looser thresholds.
    """
    import torch

    limit = rel_error_limit(kv_cache_dtype, fp8_query=fp8_query)
    lse_limit = FP8_QUERY_LSE_ABS_LIMIT if fp8_query and kv_cache_dtype.startswith("fp8") else LSE_ABS_LIMIT
    if tuple(out.shape) != tuple(ref_out.shape):
        return GateResult(False, None, f"output has shape {tuple(out.shape)}; the reference has "
                                       f"{tuple(ref_out.shape)}")
    got = out.detach().float()
    want = ref_out.detach().float().to(got.device)
    if not torch.isfinite(got).all():
        bad = int((~torch.isfinite(got)).sum())
        return GateResult(False, None, f"output has {bad} non-finite values (NaN or inf)")
    denom = float(torch.linalg.vector_norm(want))
    rel = float(torch.linalg.vector_norm(got - want)) / max(denom, 1e-30)
    if rel > limit:
        return GateResult(False, rel, f"relative error {rel:.3g} against the reference exceeds {limit:g} "
                                      f"for a {kv_cache_dtype} KV cache")
    if lse is not None and ref_lse is not None:
        if tuple(lse.shape) != tuple(ref_lse.shape):
            return GateResult(False, rel, f"lse has shape {tuple(lse.shape)}; the reference has "
                                          f"{tuple(ref_lse.shape)}")
        diff = (lse.detach().float() - ref_lse.detach().float().to(got.device)).abs()
        worst = float(diff.max()) if diff.numel() else 0.0
        if not worst <= lse_limit:   # also catches NaN
            return GateResult(False, rel, f"lse differs from the reference by up to {worst:.3g} "
                                          f"(limit {lse_limit:g}, natural log)")
    return GateResult(True, rel)
