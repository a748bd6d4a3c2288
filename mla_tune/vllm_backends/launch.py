"""The launches behind our vLLM backends' `forward_mqa`, free of vLLM imports.

`dense.MlaTuneTritonImpl` and `sparse.MlaTuneTritonSparseImpl` call these with
vLLM's tensors; `bench/vllm_backends.py` and the GPU tests call them with the
same layouts where vLLM itself cannot be imported (the lent GPU machines).
Only views are taken of vLLM's cache, block table and sequence lengths.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

MAX_DECODE_QUERY_LEN = 4  # query tokens per request our kernel runs in one launch


def _kv_scale(kv_cache: torch.Tensor, k_scale: torch.Tensor | None):
    """The kernel's `kv_scale`: vLLM's per-tensor `k_scale` (one value) for an e4m3 cache, None for any other (a
    16-bit cache, or fp8_ds_mla rows with their own scales)."""
    if kv_cache.dtype != torch.float8_e4m3fn:
        return None
    return k_scale.reshape(()) if k_scale is not None else 1.0


def dense_forward(q: torch.Tensor | tuple[torch.Tensor, torch.Tensor], kv_cache: torch.Tensor,
                  block_table: torch.Tensor, seq_lens: torch.Tensor, *, max_seq_len: int, scale: float,
                  kv_lora_rank: int = 512, k_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """MLA decode over vLLM's paged cache, as `MLACommonImpl.forward_mqa` is called.

    Args:
        q: `[tokens, heads, 576]`, or vLLM's `(ql_nope [tokens, heads, 512], q_pe [tokens, heads, 64])`;
            tokens = requests x query_len (uniform).
        kv_cache: `[num_blocks, block_size, 576]` bf16/fp16, or float8_e4m3fn (vLLM's fp8 view).
        block_table: int32 `[requests, max_blocks]` (vLLM's, as wide as max_model_len allows).
        seq_lens: int32 `[requests]`, including the query tokens.
        max_seq_len: the longest request (vLLM's `attn_metadata.max_seq_len`, a host int).
        k_scale: vLLM's per-tensor `layer._k_scale` (one value) for an FP8 cache.

    Returns:
        `out` `[tokens, heads, 512]` in q's dtype and `lse` float32 `[tokens, heads]` (natural log).
    """
    from mla_tune.backends.triton_mla import mla_decode

    if isinstance(q, tuple):
        q = torch.cat(q, dim=-1)  # (ql_nope, q_pe) -> [tokens, heads, 576], as vLLM's TRITON_MLA does
    tokens, num_heads, width = q.shape
    requests = seq_lens.shape[0]
    query_len, remainder = divmod(tokens, requests) if requests else (1, 0)
    if remainder:
        raise ValueError(f"non-uniform decode block: {tokens} query rows over {requests} requests")
    # Only the columns the longest request uses (a view): the kernel sizes its splits from the table's width.
    pages = -(-int(max_seq_len) // kv_cache.shape[1])
    if 0 < pages < block_table.shape[1]:
        block_table = block_table[:, :pages]
    if query_len > MAX_DECODE_QUERY_LEN:
        # One row per query token, each seeing the prefix plus the block tokens up to itself (vLLM's TRITON_MLA).
        block_table = block_table.repeat_interleave(query_len, dim=0)
        offsets = torch.arange(1 - query_len, 1, device=seq_lens.device, dtype=seq_lens.dtype)
        seq_lens = (seq_lens.unsqueeze(1) + offsets).flatten().clamp(min=0)
        requests, query_len = tokens, 1
    out, lse = mla_decode(q.view(requests, query_len, num_heads, width), kv_cache, block_table, seq_lens,
                          sm_scale=scale, kv_lora_rank=kv_lora_rank, kv_scale=_kv_scale(kv_cache, k_scale))
    return out.view(tokens, num_heads, -1), lse.view(tokens, num_heads)


class KernelLaunch(NamedTuple):
    """What `dense_forward` or `sparse_forward` hands our kernel for a batch of a problem (`kernel_launch`)."""

    problem: object          # `backends.problem.Problem` as the kernel sees it (query tokens folded into requests)
    params: object           # `LaunchParams` (its splits for the requests the kernel sees)
    table_stride: int        # the block table's row stride: the pages of max_seq_len, 0 for the sparse identity row
    kv_scale_is_ptr: bool    # vLLM's k_scale is passed as a tensor (an e4m3 cache)


def kernel_launch(problem, batch: int, *, max_seq_len: int | None, num_sms: int, cc_major: int | None) -> KernelLaunch:
    """What `dense_forward` (vLLM's `max_seq_len`) or `sparse_forward` launches for `batch` requests of `problem`
    (`backends.problem.Problem`), for the pre-build to list."""
    from dataclasses import replace

    from mla_tune.backends.triton_mla.splits import params_for

    kv_fp8 = problem.kv_cache_dtype in ("fp8_e4m3", "fp8_ds_mla")
    if problem.sparse:   # every query token is a request of its own
        requests, query_len, max_items, stride = batch * problem.q_len, 1, problem.topk, 0
    else:
        folded = problem.q_len > MAX_DECODE_QUERY_LEN
        requests, query_len = (batch * problem.q_len, 1) if folded else (batch, problem.q_len)
        stride = -(-int(max_seq_len) // problem.page_size)
        max_items = stride * problem.page_size
    params = params_for(None, num_heads=problem.num_heads, q_len=query_len, batch=requests, max_items=max_items,
                        num_sms=num_sms, sparse=problem.sparse, kv_fp8=kv_fp8, cc_major=cc_major,
                        ds_mla=problem.kv_cache_dtype == "fp8_ds_mla")
    return KernelLaunch(replace(problem, q_len=query_len), params, stride,
                        kv_scale_is_ptr=problem.kv_cache_dtype == "fp8_e4m3")


class IdentityPages:
    """The page table `[tokens, num_pages]` (one arange row read with stride 0) and `[tokens]` lengths that let
    our kernel read global cache rows; allocated once per cache size for up to `max_tokens` tokens."""

    def __init__(self, max_tokens: int):
        self.max_tokens = max_tokens
        self._rows = -1
        self._table: torch.Tensor | None = None
        self._lengths: torch.Tensor | None = None

    def get(self, num_pages: int, page_rows: int, tokens: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        if self._rows != num_pages * page_rows or self._table.device != torch.device(device) \
                or tokens > self.max_tokens:
            self.max_tokens = max(self.max_tokens, tokens)
            self._table = torch.arange(num_pages, dtype=torch.int32, device=device)
            self._lengths = torch.full((self.max_tokens,), num_pages * page_rows, dtype=torch.int32, device=device)
            self._rows = num_pages * page_rows
        # stride 0 at every batch (expand gives one row the page count's stride): one kernel build for all
        return self._table.as_strided((tokens, num_pages), (0, 1)), self._lengths[:tokens]


def sparse_forward(q: torch.Tensor | tuple[torch.Tensor, torch.Tensor], kv_cache: torch.Tensor,
                   topk_rows: torch.Tensor, *, block_size: int, scale: float, identity: IdentityPages,
                   kv_lora_rank: int = 512, k_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k MLA over vLLM's paged cache, as `SparseMLACommonImpl._forward_mqa_kernel` is called.

    Args:
        q: `[tokens, heads, 576]` or `(ql_nope, q_pe)`; every token is one kernel row.
        kv_cache: `[num_blocks, block_size, row]` (blocks may be spaced further apart than block_size rows):
            bf16 rows of 576, float8_e4m3fn rows of 576 (vLLM's fp8 view, with `k_scale`), or vLLM's fp8_ds_mla
            rows, uint8 of 656 bytes (their own scales), read in place.
        topk_rows: int32 `[tokens, topk]` global cache rows (`block x block_stride_rows + offset`, vLLM's
            `triton_convert_req_index_to_global_index`), -1 for none.
        k_scale: vLLM's per-tensor `layer._k_scale` (one value) for a float8_e4m3fn cache.
    """
    from mla_tune.backends.triton_mla import mla_decode

    if isinstance(q, tuple):
        q = torch.cat(q, dim=-1)
    tokens, num_heads, width = q.shape
    row_stride = kv_cache.shape[-1]
    if kv_cache.stride(0) == block_size * row_stride:
        pages = kv_cache  # contiguous blocks: global row // block_size is the block
    else:  # blocks spaced apart: one row per page (vLLM's flat_kv_row_view)
        rows = (kv_cache.shape[0] - 1) * (kv_cache.stride(0) // row_stride) + block_size
        pages = kv_cache.as_strided((rows, 1, row_stride), (row_stride, row_stride, 1))
    table, lengths = identity.get(pages.shape[0], pages.shape[1], tokens, q.device)
    out, lse = mla_decode(q.view(tokens, 1, num_heads, width), pages, table, lengths, sm_scale=scale,
                          kv_lora_rank=kv_lora_rank, kv_scale=_kv_scale(kv_cache, k_scale),
                          topk_indices=topk_rows[:tokens].unsqueeze(1))
    return out.view(tokens, num_heads, -1), lse.view(tokens, num_heads)
