"""MLA_TUNE_TRITON_SPARSE: mla-tune's Triton MLA kernel as a vLLM 0.33 sparse (DeepSeek-V3.2) backend.

vLLM's FLASH_ATTN_MLA_SPARSE is the template: vLLM's sparse MLA layer runs the
indexer, converts each token's top-k positions to global cache rows (shared by
the layers of an index group) and calls `_forward_mqa_kernel`, which here only
launches our kernel. Every query token (decode or prefill) is one kernel row
that gathers its top-k rows of the bf16 cache `[num_blocks, block_size, 576]`
in place: the kernel's page table is the identity over the cache's blocks, so
a global row `block x block_size + offset` is read where vLLM wrote it.

The fp8_ds_mla cache (656 bytes per token) is refused with a reason; see
`capabilities.SPARSE`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from vllm.config.cache import CacheDType
from vllm.model_executor.layers.attention.sparse_mla_attention import (
    SparseMLACommonImpl, SparseMLACommonMetadata, SparseMLACommonMetadataBuilder)
from vllm.v1.attention.backend import AttentionBackend, AttentionCGSupport, AttentionLayer, MultipleOf
from vllm.v1.attention.backends.mla.sparse_utils import align_blocks_to_rows, flat_kv_row_view
from vllm.v1.attention.ops.metadata import compute_token_to_req_indices
from vllm.v1.kv_cache_interface import AttentionSpec

from mla_tune.vllm_backends.capabilities import SPARSE
from mla_tune.vllm_backends.common import DeclaredCapabilities, torch_dtypes


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
        self._identity: tuple[int, torch.Tensor, torch.Tensor] | None = None

    def _identity_table(self, num_pages: int, page_rows: int, tokens: int,
                        device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The page table `[tokens, num_pages]` (arange, one row shared with stride 0) and `[tokens]` lengths,
        allocated once per cache size for the largest batch the top-k buffer holds."""
        max_tokens = self.topk_indices_buffer.shape[0]
        if self._identity is None or self._identity[0] != num_pages * page_rows:
            table = torch.arange(num_pages, dtype=torch.int32, device=device)
            lengths = torch.full((max_tokens,), num_pages * page_rows, dtype=torch.int32, device=device)
            self._identity = (num_pages * page_rows, table, lengths)
        _, table, lengths = self._identity
        return table.expand(tokens, num_pages), lengths[:tokens]

    def _forward_mqa_kernel(self, q: torch.Tensor | tuple[torch.Tensor, torch.Tensor], kv_cache: torch.Tensor,
                            topk_indices: torch.Tensor, valid_counts: torch.Tensor, *, layer: AttentionLayer,
                            block_size: int, is_decode: bool) -> tuple[torch.Tensor, torch.Tensor]:
        from mla_tune.backends.triton_mla import mla_decode

        if isinstance(q, tuple):
            q = torch.cat(q, dim=-1)  # (ql_nope, q_pe) -> [tokens, heads, 576]
        tokens, num_heads, width = q.shape
        if kv_cache.stride(0) == block_size * kv_cache.shape[-1]:
            pages = kv_cache  # contiguous blocks: global row // block_size is the block
        else:
            rows, _ = flat_kv_row_view(kv_cache, block_size)  # blocks spaced apart: one row per page
            pages = rows.unsqueeze(1)
        table, lengths = self._identity_table(pages.shape[0], pages.shape[1], tokens, q.device)
        out, lse = mla_decode(q.view(tokens, 1, num_heads, width), pages, table, lengths, sm_scale=self.scale,
                              kv_lora_rank=self.kv_lora_rank, topk_indices=topk_indices[:tokens].unsqueeze(1))
        return out.view(tokens, num_heads, -1), lse.view(tokens, num_heads)
