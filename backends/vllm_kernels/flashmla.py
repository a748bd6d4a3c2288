"""FLASHMLA and FLASHMLA_SPARSE: vLLM's FlashMLA build, called as vLLM 0.33.0's FlashMLAImpl and FlashMLASparseImpl do.

Every call passes a preallocated `out=` (vLLM lets the op allocate; the kernel is the same) except
dense FP8, whose op has no such argument; FlashMLA's lse is the op's own tensor (inside a CUDA graph
both come from the graph's pool).

Dense bf16/fp16: `flash_mla_with_kvcache(q, k_cache[..., None, :], block_table, seq_lens, 512,
sched_meta, softmax_scale, causal=True)`; the tile scheduler is filled by the first call (in
`prepare`) and reused, as vLLM reuses one `FlashMLASchedMeta` for every layer of a step.
Dense FP8: `torch.ops._flashmla_extension_C.fwd_kvcache_mla_fp8` (what vLLM's
`flash_mla_with_kvcache_fp8` calls) with metadata from `get_mla_decoding_metadata_dense_fp8`, an
FP8 query (vLLM quantizes it with its static q scale, 1.0 by default: `run` does the same copy)
and descales q = 1, k = kv_scale.
Sparse bf16: vLLM's decode runs the sparse prefill kernel `flash_mla_sparse_fwd` on the cache
rows, heads padded to a multiple of 64, top-k as global rows with valid counts.
Sparse FP8: vLLM's fp8_ds_mla cache (656 bytes a token: 512 e4m3, 4 float32 scales, 64 bf16
RoPE), packed from our per-tensor FP8 cache by `adopt` (exact: every tile's scale is kv_scale),
heads padded to 64 or 128; below 32 heads vLLM runs the batch as one sequence of tokens
(`fp8_use_mixed_batch`), and so does this adapter.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

from mla_tune.backends.interface import BackendUnavailable, DecodeInputs
from mla_tune.backends.problem import DS_MLA_BYTES, DS_MLA_GROUP, Problem
from mla_tune.backends.vllm_kernels import check_problem, global_slots, load, not_adopted

if TYPE_CHECKING:
    import torch

HEAD_DIM_V = 512
MIN_HEADS_FOR_BF16_PREFILL = 32   # vLLM's flashmla_sparse.py: fewer heads take the mixed-batch FP8 path
SPARSE_PAGE = 64              # FlashMLA's sparse FP8 kernel reads 64-token pages


def load_flashmla(*, fp8_dense: bool = False):
    """vLLM's FlashMLA interface module (and the FP8 extension when asked); BackendUnavailable otherwise."""
    load("vllm._flashmla_C")
    if fp8_dense:
        load("vllm._flashmla_extension_C")
    return load("vllm.third_party.flashmla.flash_mla_interface")


def fp8_sparse_padded_heads(num_heads: int) -> int:
    """Heads FlashMLA's sparse FP8 decode kernel runs (vLLM's `_compute_fp8_decode_padded_heads`)."""
    return 64 if num_heads <= 64 else 128


def bf16_sparse_padded_heads(num_heads: int) -> int:
    """Heads the sparse bf16 kernel runs: a multiple of 64 (vLLM's `prefill_padding`)."""
    return -(-num_heads // 64) * 64


def _write_fp8_ds_mla(latent: "torch.Tensor", scales: "torch.Tensor", rope: "torch.Tensor",
                      out: "torch.Tensor | None") -> "torch.Tensor":
    """The 656 bytes of each token from its e4m3 latent `[..., 512]`, float32 group scales `[..., 4]` (or `[4]`)
    and bf16 RoPE `[..., 64]`: the one place that lays fp8_ds_mla rows out."""
    import torch

    lead = latent.shape[:-1]
    if out is None:
        out = torch.empty(*lead, DS_MLA_BYTES, dtype=torch.uint8, device=latent.device)
    out[..., :512].copy_(latent.view(torch.uint8))
    out[..., 512:528].copy_(scales.to(torch.float32).contiguous().view(torch.uint8).expand(*lead, 16))
    out[..., 528:].copy_(rope.to(torch.bfloat16).contiguous().view(torch.uint8))
    return out


def pack_fp8_ds_mla(kv_cache: "torch.Tensor", kv_scale: float, out: "torch.Tensor | None" = None) -> "torch.Tensor":
    """vLLM's fp8_ds_mla bytes `[num_pages, page_size, 656]` (uint8) of a per-tensor-scaled e4m3 cache.

    The 512 latent values keep their e4m3 bytes with scale `kv_scale` for each 128-value tile; the
    64 RoPE values become bf16 (stored x kv_scale).
    """
    import torch

    pages, page_size, width = kv_cache.shape
    if width != 576 or kv_cache.dtype != torch.float8_e4m3fn:
        raise ValueError(f"fp8_ds_mla packs an e4m3 [pages, page_size, 576] cache, got {kv_cache.dtype} "
                         f"{tuple(kv_cache.shape)}")
    scales = torch.full((4,), float(kv_scale), dtype=torch.float32, device=kv_cache.device)
    return _write_fp8_ds_mla(kv_cache[..., :512], scales, kv_cache[..., 512:].float() * float(kv_scale), out)


class DsMlaCopies:
    """Each rotated input set's e4m3 cache packed into fp8_ds_mla rows once, untimed (`adopt`), and found again by
    the cache's address when the timed launch reads it (`rows`)."""

    def __init__(self, backend: str):
        self.backend = backend
        self._rows: dict[int, "torch.Tensor"] = {}

    def adopt(self, inputs: DecodeInputs) -> None:
        if inputs.kv_cache.data_ptr() not in self._rows:
            self._rows[inputs.kv_cache.data_ptr()] = pack_fp8_ds_mla(inputs.kv_cache, inputs.kv_scale)

    def __len__(self) -> int:
        return len(self._rows)

    def rows(self, inputs: DecodeInputs) -> "torch.Tensor":
        rows = self._rows.get(inputs.kv_cache.data_ptr())
        if rows is None:
            raise not_adopted(self.backend)
        return rows


def quantize_fp8_ds_mla(values: "torch.Tensor", out: "torch.Tensor | None" = None) -> "torch.Tensor":
    """fp8_ds_mla bytes `[..., 656]` of float values `[..., 576]` as vLLM's cache writer stores them: each
    128-value latent group in e4m3 under the scale `amax / 448` of that token's group, RoPE in bf16."""
    import torch

    if values.shape[-1] != 576:
        raise ValueError(f"fp8_ds_mla quantises [..., 576] values, got {tuple(values.shape)}")
    groups = values[..., :512].float().unflatten(-1, (512 // DS_MLA_GROUP, DS_MLA_GROUP))
    scales = (groups.abs().amax(-1) / 448.0).clamp(min=1e-10)
    latent = (groups / scales.unsqueeze(-1)).to(torch.float8_e4m3fn).flatten(-2)
    return _write_fp8_ds_mla(latent, scales, values[..., 512:], out)


def unpack_fp8_ds_mla(rows: "torch.Tensor") -> "torch.Tensor":
    """The float32 values `[..., 576]` that fp8_ds_mla rows `[..., 656]` hold (the reference's view of them)."""
    import torch

    latent = rows[..., :512].contiguous().view(torch.float8_e4m3fn).float()
    scales = rows[..., 512:528].contiguous().view(torch.float32)
    rope = rows[..., 528:].contiguous().view(torch.bfloat16).float()
    latent = (latent.unflatten(-1, (512 // DS_MLA_GROUP, DS_MLA_GROUP)) * scales.unsqueeze(-1)).flatten(-2)
    return torch.cat([latent, rope], dim=-1)


class _PreparedDense:
    def __init__(self, problem: Problem, inputs: DecodeInputs):
        import torch

        self.problem = problem
        self.fp8 = inputs.kv_cache.dtype == torch.float8_e4m3fn
        self.fmla = load_flashmla(fp8_dense=self.fp8)
        q = inputs.q
        self.block_table, self.seq_lens, self.sm_scale = inputs.block_table, inputs.seq_lens, inputs.sm_scale
        if self.fp8:
            self.q_fp8 = torch.empty(q.shape, dtype=torch.float8_e4m3fn, device=q.device)
            self.descale_q = torch.ones(1, dtype=torch.float32, device=q.device)
            self.descale_k = torch.full((1,), float(inputs.kv_scale), dtype=torch.float32, device=q.device)
            # vLLM's FlashMLAMetadataBuilder: num_q_tokens_per_head_k = max_query_len * heads, one KV head.
            self.tile_md, self.num_splits = torch.ops._flashmla_extension_C.get_mla_decoding_metadata_dense_fp8(
                self.seq_lens, problem.q_len * problem.num_heads, 1)
        else:
            self.sched, _ = self.fmla.get_mla_metadata()
            # The op's `out` must be [batch, 1 KV head, q_len x heads, 512]: with q_len > 1 it is left to the op,
            # as vLLM leaves it (inside a CUDA graph it comes from the graph's pool).
            self.out = torch.empty(*q.shape[:-1], HEAD_DIM_V, dtype=q.dtype, device=q.device) \
                if problem.q_len == 1 else None

    def run(self, inputs: DecodeInputs):
        import torch

        k_cache = inputs.kv_cache.unsqueeze(-2)       # [pages, page_size, 1 KV head, 576], a view
        if self.fp8:
            self.q_fp8.copy_(inputs.q)               # vLLM's static per-tensor quantization, q scale 1
            out, lse = torch.ops._flashmla_extension_C.fwd_kvcache_mla_fp8(
                self.q_fp8, k_cache, HEAD_DIM_V, self.seq_lens, self.block_table, self.sm_scale, True,
                self.tile_md, self.num_splits, self.descale_q, self.descale_k)
        else:
            out, lse = self.fmla.flash_mla_with_kvcache(
                q=inputs.q, k_cache=k_cache, block_table=self.block_table, cache_seqlens=self.seq_lens,
                head_dim_v=HEAD_DIM_V, tile_scheduler_metadata=self.sched, softmax_scale=self.sm_scale,
                causal=True, is_fp8_kvcache=False, out=self.out)
        return out, lse.transpose(1, 2)              # lse [batch, heads, q_len] -> [batch, q_len, heads]


class FlashMLA:
    """FLASHMLA: vLLM's FlashMLA dense decode (bf16/fp16, or FP8 with an FP8 query)."""

    name: ClassVar[str] = "FLASHMLA"

    def prepare(self, problem: Problem, inputs: DecodeInputs) -> _PreparedDense:
        import torch

        check_problem(self.name, problem, inputs, sparse=False)
        prepared = _PreparedDense(problem, inputs)
        try:
            prepared.run(inputs)                      # fills the tile scheduler; lazy loading
            torch.cuda.synchronize(inputs.q.device)
        except (RuntimeError, ValueError, TypeError, AssertionError) as exc:
            raise BackendUnavailable(f"vLLM's FlashMLA rejected the problem: {type(exc).__name__}: {exc}") from exc
        return prepared


class _PreparedSparse:
    def __init__(self, problem: Problem, inputs: DecodeInputs):
        import torch

        self.problem = problem
        self.fmla = load_flashmla()
        q = inputs.q
        batch, q_len, heads, width = q.shape
        self.tokens = batch * q_len
        self.fp8 = inputs.kv_cache.dtype == torch.float8_e4m3fn
        slots, counts = global_slots(problem, inputs)
        self.sm_scale = inputs.sm_scale
        self.copies = DsMlaCopies("FLASHMLA_SPARSE")
        if self.fp8:
            if problem.page_size % SPARSE_PAGE:
                raise BackendUnavailable(f"FlashMLA's sparse FP8 kernel reads {SPARSE_PAGE}-token pages; "
                                         f"page_size {problem.page_size} is not a multiple")
            if heads > 128:
                raise BackendUnavailable(f"FlashMLA's sparse FP8 decode runs 64 or 128 heads; vLLM pads up to "
                                         f"them, and num_heads {heads} is above 128")
            self.padded = fp8_sparse_padded_heads(heads)
            self.mixed = heads < MIN_HEADS_FOR_BF16_PREFILL
            lead = (1, self.tokens) if self.mixed else (batch, q_len)
            self.indices = slots.view(*lead, -1)
            self.lead = lead
            # vLLM pads with new_zeros + a copy per call, and reads q as it is at 64 or 128 heads.
            self.q_pad = None if self.padded == heads else torch.zeros(
                *lead, self.padded, width, dtype=q.dtype, device=q.device)
            rows = lead[0]
            # Ignored by the kernel when indices are given; vLLM passes max_model_len and a dummy table.
            self.cache_lens = torch.full((rows,), int(inputs.seq_lens.max()), dtype=torch.int32, device=q.device)
            self.dummy_block_table = torch.zeros(rows, 1, dtype=torch.int32, device=q.device)
            self.sched, _ = self.fmla.get_mla_metadata()
            self.out = torch.empty(*lead, self.padded, HEAD_DIM_V, dtype=q.dtype, device=q.device)
        else:
            self.padded = bf16_sparse_padded_heads(heads)
            self.out = torch.empty(self.tokens, self.padded, HEAD_DIM_V, dtype=q.dtype, device=q.device)
            self.indices = slots.view(self.tokens, 1, -1)
            self.topk_length = counts.view(self.tokens).contiguous()
            self.q_pad = None if self.padded == heads else torch.zeros(
                self.tokens, self.padded, width, dtype=q.dtype, device=q.device)

    def adopt(self, inputs: DecodeInputs) -> None:
        """Pack this input set's FP8 cache into fp8_ds_mla (untimed); bf16 caches are read as they are."""
        if self.fp8:
            self.copies.adopt(inputs)

    def run(self, inputs: DecodeInputs):
        batch, q_len, heads, width = inputs.q.shape
        if self.fp8:
            packed = self.copies.rows(inputs)
            q = inputs.q.view(*self.lead, heads, width)
            if self.q_pad is not None:
                self.q_pad[..., :heads, :].copy_(q)
                q = self.q_pad
            out, lse = self.fmla.flash_mla_with_kvcache(
                q=q, k_cache=packed.view(-1, SPARSE_PAGE, 1, DS_MLA_BYTES),
                block_table=self.dummy_block_table, head_dim_v=HEAD_DIM_V, cache_seqlens=self.cache_lens,
                tile_scheduler_metadata=self.sched, is_fp8_kvcache=True, indices=self.indices,
                softmax_scale=self.sm_scale, out=self.out)
            lse = lse[:, :heads].transpose(1, 2)        # [rows, heads, seq] -> [rows, seq, heads]
            if self.mixed:                               # one row of batch x q_len tokens
                return out[0, :, :heads].unflatten(0, (batch, q_len)), lse[0].unflatten(0, (batch, q_len))
            return out[:, :, :heads], lse
        q = inputs.q.view(self.tokens, heads, width)
        if self.q_pad is not None:
            self.q_pad[:, :heads].copy_(q)
            q = self.q_pad
        kv_rows = inputs.kv_cache.view(-1, 1, width)
        out, _max_logits, _lse = self.fmla.flash_mla_sparse_fwd(
            q, kv_rows, self.indices, self.sm_scale, topk_length=self.topk_length, out=self.out)
        # The prefill kernel's lse is not what vLLM's decode returns (it returns none): not checked here.
        return out[:, :heads].unflatten(0, (batch, q_len)), None


class FlashMLASparse:
    """FLASHMLA_SPARSE: vLLM's FlashMLA sparse decode (bf16 cache, or FP8 as fp8_ds_mla)."""

    name: ClassVar[str] = "FLASHMLA_SPARSE"

    def prepare(self, problem: Problem, inputs: DecodeInputs) -> _PreparedSparse:
        import torch

        check_problem(self.name, problem, inputs, sparse=True)
        if problem.query_dtype != "bf16":
            raise BackendUnavailable(f"FlashMLA sparse reads a bf16 query, got {problem.query_dtype}")
        prepared = _PreparedSparse(problem, inputs)
        try:
            prepared.adopt(inputs)
            prepared.run(inputs)
            torch.cuda.synchronize(inputs.q.device)
        except (RuntimeError, ValueError, TypeError, AssertionError) as exc:
            raise BackendUnavailable(f"vLLM's FlashMLA sparse rejected the problem: "
                                     f"{type(exc).__name__}: {exc}") from exc
        return prepared
