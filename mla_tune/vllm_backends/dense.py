"""MLA_TUNE_TRITON: mla-tune's Triton MLA decode kernel as a vLLM 0.33 attention backend (dense MLA).

vLLM's own TRITON_MLA is the template: its metadata (`MLACommonMetadata`, the
decode block table and sequence lengths) and its KV cache (`[num_blocks,
block_size, 576]`, bf16/fp16, or e4m3 with the layer's per-tensor `k_scale`)
are read as they are, without a copy or a conversion. Prefill stays on vLLM's
common MLA path. Requests of up to 4 query tokens (speculative decode) run in
one launch with the causal rule of FlashMLA; longer ones are flattened to one
row per token, as vLLM's TRITON_MLA does.

Fail-safe: if our kernel cannot be launched (a compile failure on this GPU),
the layer logs one warning and runs vLLM's Triton MLA kernel on the same cache
and metadata from then on.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from vllm.config.cache import CacheDType
from vllm.model_executor.layers.attention.mla_attention import MLACommonBackend, MLACommonMetadata, QueryLenSupport
from vllm.v1.attention.backend import AttentionCGSupport, AttentionLayer, MultipleOf
from vllm.v1.attention.backends.mla.triton_mla import TritonMLAImpl, TritonMLAMetadataBuilder

from mla_tune.vllm_backends.capabilities import DENSE
from mla_tune.vllm_backends.common import DeclaredCapabilities, logger, torch_dtypes
from mla_tune.vllm_backends.launch import dense_forward


class MlaTuneTritonMetadataBuilder(TritonMLAMetadataBuilder):
    """vLLM's common MLA metadata, planned once per step; uniform multi-token decode batches allowed."""

    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport[DENSE.cudagraph_support]
    query_len_support: ClassVar[QueryLenSupport] = QueryLenSupport.UNIFORM
    supports_non_causal_multi_token_decode: ClassVar[bool] = False

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        # TritonMLAMetadataBuilder's parent, not its own __init__: our kernel sizes its split workspace per
        # launch, so vLLM's Triton workspace (up to GBs at 128 heads) is reserved only if the fallback runs.
        super(TritonMLAMetadataBuilder, self).__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.supports_draft_decode_metadata_update = self.dcp_world_size == 1


class MlaTuneTritonBackend(DeclaredCapabilities, MLACommonBackend):
    """Capabilities as vLLM's selector reads them (from `capabilities.DENSE`)."""

    capabilities = DENSE
    supported_dtypes: ClassVar[list[torch.dtype]] = torch_dtypes(DENSE)
    supported_kv_cache_dtypes: ClassVar[list[CacheDType]] = list(DENSE.kv_cache_dtypes)

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list[int | MultipleOf]:
        return [MultipleOf(DENSE.block_size_multiple)]

    @staticmethod
    def get_name() -> str:
        return DENSE.name

    @staticmethod
    def get_impl_cls() -> type[MlaTuneTritonImpl]:
        return MlaTuneTritonImpl

    @staticmethod
    def get_builder_cls() -> type[MlaTuneTritonMetadataBuilder]:
        return MlaTuneTritonMetadataBuilder


class MlaTuneTritonImpl(TritonMLAImpl):
    """`forward_mqa` launches `mla_tune.backends.triton_mla.mla_decode` on vLLM's cache and metadata."""

    can_return_lse_for_decode: bool = True
    supports_dcp: bool = False     # our LSE is not in the form vLLM's DCP merge reads; not offered

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)  # vLLM's checks: no alibi/sliding window/soft cap, FP8 needs SM89+
        self.fallback_reason: str | None = None

    def reserve_workspace(self) -> None:
        """Nothing to reserve: our kernel allocates its split workspace per launch (see `launch.py`)."""

    def forward_mqa(self, q: torch.Tensor | tuple[torch.Tensor, torch.Tensor], kv_c_and_k_pe_cache: torch.Tensor,
                    attn_metadata: MLACommonMetadata, layer: AttentionLayer) -> tuple[torch.Tensor, torch.Tensor]:
        if self.fallback_reason is None:
            try:
                return self._forward_ours(q, kv_c_and_k_pe_cache, attn_metadata, layer)
            except Exception as exc:
                if q_capturing(q):
                    raise  # a failed launch inside a CUDA-graph capture cannot be repaired here
                self.fallback_reason = f"{type(exc).__name__}: {exc}"
                logger.warning("mla-tune: %s could not launch (%s); this layer runs vLLM's TRITON_MLA kernel "
                               "from now on", DENSE.name, self.fallback_reason.splitlines()[0][:500])
                super().reserve_workspace()
        return super().forward_mqa(q, kv_c_and_k_pe_cache, attn_metadata, layer)

    def _forward_ours(self, q, kv_cache: torch.Tensor, attn_metadata: MLACommonMetadata,
                      layer: AttentionLayer) -> tuple[torch.Tensor, torch.Tensor]:
        decode = attn_metadata.decode
        return dense_forward(q, kv_cache, decode.block_table, decode.seq_lens, max_seq_len=attn_metadata.max_seq_len,
                             scale=self.scale, kv_lora_rank=self.kv_lora_rank,
                             k_scale=layer._k_scale)


def q_capturing(q) -> bool:
    """Whether q's device stream is being captured into a CUDA graph."""
    tensor = q[0] if isinstance(q, tuple) else q
    return tensor.is_cuda and torch.cuda.is_current_stream_capturing()
