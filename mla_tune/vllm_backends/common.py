"""What our dense and sparse vLLM backends share: capabilities declared to vLLM, reasons, the launch.

Imports vLLM and torch; only vLLM imports this module (through the class paths the
plugin registers), never `mla_tune` itself.
"""

from __future__ import annotations

import logging
from typing import ClassVar

import torch
from mla_tune.vllm_backends.capabilities import VllmBackendCapabilities, refusal_reasons

logger = logging.getLogger("mla_tune.vllm_backends")

# vLLM's bare reasons that our sentences replace (each of these checks is also in `refusal_reasons`).
_GENERIC_REASONS = frozenset({
    "head_size not supported", "dtype not supported", "kv_cache_dtype not supported", "block_size not supported",
    "compute capability not supported", "sparse not supported", "non-sparse not supported",
})
_TORCH_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}


def heads_per_rank() -> int | None:
    """Query heads per tensor-parallel rank of the model vLLM is configuring, or None outside a config."""
    from vllm.config import get_current_vllm_config_or_none

    config = get_current_vllm_config_or_none()
    if config is None or config.model_config is None:
        return None
    try:
        return int(config.model_config.get_num_attention_heads(config.parallel_config))
    except Exception:  # a partial config (tests, tools) has no head count; vLLM checks the rest
        return None


class DeclaredCapabilities:
    """Mixin for an `AttentionBackend`: vLLM's capability classmethods answered from `capabilities`.

    vLLM's selector calls `validate_configuration`; ours returns vLLM's own reasons for
    what we do not model, and our sentences (with the observed values) for the rest.
    """

    capabilities: ClassVar[VllmBackendCapabilities]

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return [cls.capabilities.head_size]

    @classmethod
    def supports_compute_capability(cls, capability) -> bool:
        return (capability.major, capability.minor) >= cls.capabilities.min_capability

    @classmethod
    def is_mla(cls) -> bool:
        return True

    @classmethod
    def is_sparse(cls) -> bool:
        return cls.capabilities.sparse

    @classmethod
    def supports_combination(cls, head_size, dtype, kv_cache_dtype, block_size, use_mla, has_sink, use_sparse,
                             use_mm_prefix, device_capability) -> str | None:
        reasons = cls.refusals(head_size=head_size, dtype=dtype, kv_cache_dtype=kv_cache_dtype,
                               block_size=block_size, use_sparse=use_sparse, device_capability=device_capability)
        return "; ".join(reasons) or None

    @classmethod
    def refusals(cls, *, head_size, dtype, kv_cache_dtype, block_size, use_sparse, device_capability) -> list[str]:
        """Our sentences for this selector configuration (empty: we can run it)."""
        capability = None if device_capability is None else (device_capability.major, device_capability.minor)
        return refusal_reasons(cls.capabilities, head_size=head_size, model_dtype=str(dtype),
                               kv_cache_dtype=kv_cache_dtype, block_size=block_size, sparse=use_sparse,
                               capability=capability, num_heads=heads_per_rank())

    @classmethod
    def validate_configuration(cls, head_size, dtype, kv_cache_dtype, block_size, use_mla, has_sink, use_sparse,
                               use_mm_prefix, use_per_head_quant_scales, device_capability, attn_type,
                               **more) -> list[str]:
        generic = super().validate_configuration(  # type: ignore[misc]
            head_size, dtype, kv_cache_dtype, block_size, use_mla, has_sink, use_sparse, use_mm_prefix,
            use_per_head_quant_scales, device_capability, attn_type, **more)
        ours = cls.refusals(head_size=head_size, dtype=dtype, kv_cache_dtype=kv_cache_dtype, block_size=block_size,
                            use_sparse=use_sparse, device_capability=device_capability)
        # supports_combination already put our sentences in `generic` as one string; list them one by one.
        combined = "; ".join(ours)
        return ours + [r for r in generic if r not in _GENERIC_REASONS and r != combined]


def torch_dtypes(caps: VllmBackendCapabilities) -> list[torch.dtype]:
    """The model dtypes of `caps` as torch dtypes (vLLM's `supported_dtypes`)."""
    return [_TORCH_DTYPES[name] for name in caps.model_dtypes]
