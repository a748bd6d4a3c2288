"""MLA_TUNE_TRITON_SPARSE: mla-tune's Triton MLA kernel as a vLLM 0.33 sparse (DeepSeek-V3.2) backend.

vLLM's FLASH_ATTN_MLA_SPARSE is the template: vLLM's sparse MLA layer runs the
indexer, converts each token's top-k positions to global cache rows (shared by
the layers of an index group) and calls `_forward_mqa_kernel`, which here only
launches our kernel. Every query token (decode or prefill) is one kernel row
that gathers its top-k rows of the bf16 cache `[num_blocks, block_size, 576]`
in place: the kernel's page table is the identity over the cache's blocks, so
a global row `block x block_size + offset` is read where vLLM wrote it.

FP8 caches are read in place too: `fp8`/`fp8_e4m3` as vLLM's e4m3 view with the
layer's `k_scale`, and `fp8_ds_mla` as its uint8 rows of 656 bytes (512 e4m3
values, 4 float32 scales, 64 bf16 RoPE values; see `capabilities.SPARSE`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from vllm.config.cache import CacheDType
from vllm.model_executor.layers.attention.sparse_mla_attention import (
    SparseMLACommonImpl, SparseMLACommonMetadata, SparseMLACommonMetadataBuilder)
from vllm.v1.attention.backend import AttentionBackend, AttentionCGSupport, AttentionLayer, MultipleOf
from vllm.v1.attention.backends.mla.sparse_utils import align_blocks_to_rows
from vllm.v1.attention.ops.metadata import compute_token_to_req_indices
from vllm.v1.kv_cache_interface import AttentionSpec

from mla_tune.vllm_backends.capabilities import SPARSE
from mla_tune.vllm_backends.common import DeclaredCapabilities, torch_dtypes
from mla_tune.vllm_backends.launch import IdentityPages, sparse_forward


@dataclass
class MlaTuneTritonSparseMetadata(SparseMLACommonMetadata):
    pass


class MlaTuneTritonSparseMetadataBuilder(SparseMLACommonMetadataBuilder[MlaTuneTritonSparseMetadata]):
    """vLLM's sparse MLA metadata (block table, token-to-request map), planned once per step."""

    metadata_cls = MlaTuneTritonSparseMetadata
    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport[SPARSE.cudagraph_support]

    def __init__(self, kv_cache_spec: AttentionSpec, layer_names: list[str], vllm_config, device: torch.device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self._init_reorder_batch_threshold(1, supports_spec_as_decode=True)
        self.supports_draft_decode_metadata_update = self.dcp_world_size == 1

    def update_draft_decode_metadata(self, metadata: SparseMLACommonMetadata) -> None:
        if metadata.num_decode_tokens:
            compute_token_to_req_indices(metadata.query_start_loc, metadata.req_id_per_token,
                                         metadata.num_decode_tokens, metadata.num_decode_tokens)


class MlaTuneTritonSparseBackend(DeclaredCapabilities, AttentionBackend):
    """Capabilities as vLLM's selector reads them (from `capabilities.SPARSE`)."""

    capabilities = SPARSE
    supported_dtypes: ClassVar[list[torch.dtype]] = torch_dtypes(SPARSE)
    supported_kv_cache_dtypes: ClassVar[list[CacheDType]] = list(SPARSE.kv_cache_dtypes)

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list[int | MultipleOf]:
        return [MultipleOf(SPARSE.block_size_multiple)]

    @classmethod
    def customize_spec(cls, spec: AttentionSpec) -> AttentionSpec:
        return align_blocks_to_rows(spec)

    @staticmethod
    def get_name() -> str:
        return SPARSE.name

    @staticmethod
    def get_impl_cls() -> type[MlaTuneTritonSparseImpl]:
        return MlaTuneTritonSparseImpl

    @staticmethod
    def get_builder_cls() -> type[MlaTuneTritonSparseMetadataBuilder]:
        return MlaTuneTritonSparseMetadataBuilder


class MlaTuneTritonSparseImpl(SparseMLACommonImpl[MlaTuneTritonSparseMetadata]):
    """`_forward_mqa_kernel` launches `mla_tune.backends.triton_mla.mla_decode` with top-k rows."""

    group_conversion_decode_only: ClassVar[bool] = True

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if self.kv_cache_dtype not in SPARSE.kv_cache_dtypes:
            raise NotImplementedError(f"{SPARSE.name} does not read kv_cache_dtype {self.kv_cache_dtype}: "
                                      f"{SPARSE.refused_kv_cache_dtypes.get(self.kv_cache_dtype, '')}")
        assert self.topk_indices_buffer is not None, "sparse MLA needs the indexer's top-k buffer"
        self.supports_quant_query_input = False
        self._identity = IdentityPages(self.topk_indices_buffer.shape[0])

    def _forward_mqa_kernel(self, q: torch.Tensor | tuple[torch.Tensor, torch.Tensor], kv_cache: torch.Tensor,
                            topk_indices: torch.Tensor, valid_counts: torch.Tensor, *, layer: AttentionLayer,
                            block_size: int, is_decode: bool) -> tuple[torch.Tensor, torch.Tensor]:
        return sparse_forward(q, kv_cache, topk_indices, block_size=block_size, scale=self.scale,
                              identity=self._identity, kv_lora_rank=self.kv_lora_rank,
                              k_scale=layer._k_scale)
