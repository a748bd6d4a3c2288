"""vLLM's static MLA backend priority, and the fallback choice it implies.

Reproduces `_get_backend_priorities` in `vllm/platforms/cuda.py` at vLLM
commit 81be2e09aebf (2026-08-06) for MLA models: one list for dense and
sparse models; each backend's own validation then drops those that do not
fit, and the first valid one wins.
"""

from __future__ import annotations

from mla_tune.backends.problem import DeviceSpec, Problem, is_quantized_kv_cache, is_vllm_kv_cache_dtype
from mla_tune.backends.registry import backend_reasons

_SM100_DENSE = ["FLASHINFER_MLA", "TOKENSPEED_MLA", "CUTLASS_MLA", "FLASH_ATTN_MLA", "FLASHMLA", "TRITON_MLA"]
_SM120 = ["TRITON_MLA", "FLASHINFER_MLA_SPARSE_SM120"]
_DEFAULT = ["FLASH_ATTN_MLA", "FLASHMLA", "FLASHINFER_MLA", "TRITON_MLA", "FLASH_ATTN_MLA_SPARSE", "FLASHMLA_SPARSE"]


def static_priority(*, compute_capability, kv_cache_dtype: str = "auto",
                    num_heads: int | None = None) -> list[str]:
    """vLLM's MLA priority list, unfiltered, as vLLM enum names.

    Args:
        compute_capability: (major, minor) of the GPU.
        kv_cache_dtype: any vLLM `--kv-cache-dtype` spelling.
        num_heads: query heads per rank; None when unknown (vLLM then uses the
            "more than 16 heads" ordering for unquantized caches on SM100).

    Raises:
        ValueError: bad compute capability, dtype or head count.
    """
    from mla_tune.backends.problem import parse_compute_capability

    major, _ = parse_compute_capability(compute_capability)
    if not is_vllm_kv_cache_dtype(kv_cache_dtype):
        raise ValueError(f"unknown kv_cache_dtype {kv_cache_dtype!r}")
    if num_heads is not None and (isinstance(num_heads, bool) or not isinstance(num_heads, int) or num_heads <= 0):
        raise ValueError(f"num_heads must be a positive integer or None, got {num_heads!r}")
    if major == 10:
        if is_quantized_kv_cache(kv_cache_dtype) or (num_heads is not None and num_heads <= 16):
            tail = ["FLASHINFER_MLA_SPARSE", "FLASHMLA_SPARSE"]
        else:
            tail = ["FLASHMLA_SPARSE", "FLASHINFER_MLA_SPARSE"]
        return _SM100_DENSE + tail
    if major == 12:
        return list(_SM120)
    return list(_DEFAULT)


def static_choice(problem: Problem, device: DeviceSpec, *, kv_cache_spelling: str | None = None,
                  check_packages: bool = False) -> tuple[str | None, dict[str, list[str]]]:
    """The backend vLLM would pick: the first eligible entry of its priority list.

    Args:
        problem: the decode problem.
        device: the GPU.
        kv_cache_spelling: the user's `--kv-cache-dtype` spelling (vLLM's quantized test
            reads the raw string); defaults to the problem's canonical dtype.
        check_packages: also require the backends' packages in *this* process. Off by
            default: the caller (a CLI, an init container, the tuner) is usually not the
            engine's process, and vLLM's choice is made with vLLM's kernels installed.

    Returns:
        (name or None when nothing is eligible, {backend: reasons} for every
        entry before the winner, and for all entries when none is eligible).
    """
    order = static_priority(compute_capability=device.compute_capability,
                            kv_cache_dtype=kv_cache_spelling or problem.kv_cache_dtype,
                            num_heads=problem.num_heads)
    skipped: dict[str, list[str]] = {}
    for name in order:
        reasons = backend_reasons(name, problem, device, check_packages=check_packages)
        if not reasons:
            return name, skipped
        skipped[name] = reasons
    return None, skipped
