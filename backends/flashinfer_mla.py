"""FlashInfer's `BatchMLAPagedAttentionWrapper` (fa2, fa3): dense and sparse MLA decode.

Dense: the block table and lengths become FlashInfer's CSR metadata (one
query segment of q_len tokens per request, causal when q_len > 1, so query
position i sees the first L - q_len + 1 + i keys). Sparse: the cache is
viewed with page size 1 and every query position becomes its own segment of
one token whose "pages" are its top-k token slots, translated through the
block table (slot = block_table[b, pos // page_size] * page_size +
pos % page_size); -1 slots and positions the query may not see are dropped.
The translation runs on the host in `prepare`, so it is not timed.

FP8 KV (e4m3, SM90 only, bf16 q) passes the per-tensor scale as `ckv_scale`
and `kpe_scale` to `run`. `plan()` synchronises and JIT-compiles; it happens
in `prepare` with one warm-up launch, and any library error there becomes a
`BackendUnavailable` carrying FlashInfer's message.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from mla_tune.backends.interface import BackendUnavailable, DecodeInputs, check_inputs
from mla_tune.backends.problem import Problem

if TYPE_CHECKING:
    import torch

WORKSPACE_BYTES = 128 * 1024 * 1024


@dataclass(frozen=True)
class CsrMetadata:
    """FlashInfer's CSR plan metadata, int32 CPU tensors.

    Attributes:
        qo_indptr: `[segments + 1]` query-token offsets.
        kv_indptr: `[segments + 1]` offsets into `kv_indices`.
        kv_indices: `[total_pages]` page ids (token slots when page size is 1).
        kv_len_arr: `[segments]` KV tokens each segment attends to.
        page_size: tokens per page of the cache view the kernel reads.
        causal: whether the segments use the bottom-right causal mask.
    """

    qo_indptr: "torch.Tensor"
    kv_indptr: "torch.Tensor"
    kv_indices: "torch.Tensor"
    kv_len_arr: "torch.Tensor"
    page_size: int
    causal: bool


def _offsets(counts: "torch.Tensor") -> "torch.Tensor":
    import torch

    return torch.cat([torch.zeros(1, dtype=torch.int64), counts.cumsum(0)]).to(torch.int32)


def dense_csr(block_table: "torch.Tensor", seq_lens: "torch.Tensor", *, page_size: int,
              q_len: int) -> CsrMetadata:
    """CSR metadata for dense decode: request b reads its first ceil(L_b / page_size) pages.

    Args:
        block_table: int `[batch, max_pages]` (any device; read on the host).
        seq_lens: int `[batch]`, the q_len new tokens included.
        page_size: tokens per page.
        q_len: query tokens per request.

    Raises:
        ValueError: a length is shorter than q_len or needs more pages than the table row holds.
    """
    import torch

    lens = seq_lens.detach().to("cpu", torch.int64)
    table = block_table.detach().to("cpu", torch.int64)
    if int(lens.min()) < q_len:
        raise ValueError(f"seq_lens has a length {int(lens.min())} shorter than q_len {q_len}")
    pages = (lens + page_size - 1) // page_size
    if int(pages.max()) > table.shape[1]:
        raise ValueError(f"block_table has {table.shape[1]} columns but a request of "
                         f"{int(lens.max())} tokens needs {int(pages.max())} pages of {page_size}")
    used = torch.arange(table.shape[1]).unsqueeze(0) < pages.unsqueeze(1)
    batch = lens.shape[0]
    return CsrMetadata(
        qo_indptr=torch.arange(0, (batch + 1) * q_len, q_len, dtype=torch.int32),
        kv_indptr=_offsets(pages),
        kv_indices=table[used].to(torch.int32),
        kv_len_arr=lens.to(torch.int32),
        page_size=page_size, causal=q_len > 1)


def sparse_token_slots(block_table: "torch.Tensor", seq_lens: "torch.Tensor",
                       topk_indices: "torch.Tensor", *, page_size: int
                       ) -> tuple["torch.Tensor", "torch.Tensor"]:
    """Translate top-k token positions into global token slots of the paged cache.

    Args:
        block_table: int `[batch, max_pages]`.
        seq_lens: int `[batch]`.
        topk_indices: int `[batch, q_len, topk]` positions in each request, -1 unused.
        page_size: tokens per page.

    Returns:
        `(slots, valid)`: int64 `[batch, q_len, topk]` slots (block_table[b, pos //
        page_size] * page_size + pos % page_size; -1 where invalid) and the bool mask
        of slots that are >= 0 and visible to their query position (pos <
        L - q_len + 1 + i), all on the host.
    """
    import torch

    idx = topk_indices.detach().to("cpu", torch.int64)
    lens = seq_lens.detach().to("cpu", torch.int64)
    table = block_table.detach().to("cpu", torch.int64)
    batch, q_len, _ = idx.shape
    visible = lens.view(batch, 1, 1) - q_len + 1 + torch.arange(q_len).view(1, q_len, 1)
    valid = (idx >= 0) & (idx < visible)
    pos = torch.where(valid, idx, torch.zeros_like(idx))
    page_col = pos // page_size
    if int(page_col.max()) >= table.shape[1]:
        raise ValueError(f"topk_indices points past the block table ({table.shape[1]} pages)")
    pages = torch.gather(table, 1, page_col.view(batch, -1)).view_as(idx)
    slots = torch.where(valid, pages * page_size + pos % page_size, torch.full_like(idx, -1))
    return slots, valid


def sparse_csr(block_table: "torch.Tensor", seq_lens: "torch.Tensor",
               topk_indices: "torch.Tensor", *, page_size: int) -> CsrMetadata:
    """CSR metadata for sparse decode over the page-size-1 view of the cache.

    Each (request, query position) is one segment of one query token; its pages
    are its valid token slots (see `sparse_token_slots`). Segments follow the
    row-major order of q `[batch, q_len]`.

    Raises:
        ValueError: a query position has no valid top-k slot (FlashInfer cannot
            attend to an empty set).
    """
    import torch

    slots, valid = sparse_token_slots(block_table, seq_lens, topk_indices, page_size=page_size)
    counts = valid.sum(-1).flatten()
    if int(counts.min()) == 0:
        flat = int(torch.nonzero(counts == 0)[0])
        raise ValueError(f"query position {divmod(flat, slots.shape[1])} (request, position) has "
                         "no valid top-k index; FlashInfer cannot attend to an empty set")
    segments = counts.shape[0]
    return CsrMetadata(
        qo_indptr=torch.arange(segments + 1, dtype=torch.int32),
        kv_indptr=_offsets(counts),
        kv_indices=slots[valid].to(torch.int32),
        kv_len_arr=counts.to(torch.int32),
        page_size=1, causal=False)


def kv_cache_view(kv_cache: "torch.Tensor", *, sparse: bool) -> "torch.Tensor":
    """The cache as the kernel reads it: `[num_pages, page_size, D]`, or `[slots, 1, D]` when sparse."""
    if not sparse:
        return kv_cache
    return kv_cache.view(kv_cache.shape[0] * kv_cache.shape[1], 1, kv_cache.shape[2])


class _PreparedFlashInfer:
    """A planned wrapper plus preallocated out/lse; `run` launches only the kernel."""

    def __init__(self, problem: Problem, wrapper, out: "torch.Tensor", lse: "torch.Tensor",
                 *, sparse: bool, kv_scale: float | None):
        self.problem = problem
        self.wrapper = wrapper
        self.sparse = sparse
        self._out, self._lse = out, lse
        self._scales = {} if kv_scale is None else {"ckv_scale": kv_scale, "kpe_scale": kv_scale}
        self.out = out.view(-1, problem.q_len, problem.num_heads, out.shape[-1])
        self.lse = lse.view(-1, problem.q_len, problem.num_heads)

    def run(self, inputs: DecodeInputs):
        q = inputs.q
        if tuple(q.shape[:1]) != tuple(self.out.shape[:1]):
            raise ValueError(f"q has batch {q.shape[0]}; this backend was prepared for "
                             f"batch {self.out.shape[0]}")
        self.wrapper.run(query=q.reshape(-1, q.shape[2], q.shape[3]),
                         kv_cache=kv_cache_view(inputs.kv_cache, sparse=self.sparse),
                         out=self._out, lse=self._lse, return_lse=True,
                         return_lse_base_on_e=True, **self._scales)
        return self.out, self.lse


class _FlashInferMLA:
    """Shared adapter code; subclasses set the stable name, FlashInfer backend and sparsity."""

    name: ClassVar[str]
    backend: ClassVar[str]
    sparse: ClassVar[bool] = False

    def prepare(self, problem: Problem, inputs: DecodeInputs) -> _PreparedFlashInfer:
        import torch

        check_inputs(problem, inputs)
        if problem.sparse != self.sparse:
            kind = "sparse" if problem.sparse else "dense"
            raise BackendUnavailable(f"{self.name} does not run {kind} problems")
        if not inputs.q.is_cuda:
            raise BackendUnavailable(f"{self.name} needs CUDA tensors, got q on {inputs.q.device}")
        try:
            from flashinfer.mla import BatchMLAPagedAttentionWrapper, MLAPlanMetadata
        except Exception as exc:  # ImportError, or a broken install raising anything
            raise BackendUnavailable(f"flashinfer cannot be imported ({exc})") from exc
        if self.sparse:
            meta = sparse_csr(inputs.block_table, inputs.seq_lens, inputs.topk_indices,
                              page_size=problem.page_size)
        else:
            meta = dense_csr(inputs.block_table, inputs.seq_lens, page_size=problem.page_size,
                             q_len=problem.q_len)
        geo = problem.geometry
        q, kv = inputs.q, inputs.kv_cache
        tokens = q.shape[0] * q.shape[1]
        try:
            workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=q.device)
            wrapper = BatchMLAPagedAttentionWrapper(workspace, backend=self.backend)
            wrapper.plan(
                metadata=MLAPlanMetadata.csr(meta.qo_indptr, meta.kv_indptr, meta.kv_indices,
                                             meta.kv_len_arr),
                num_heads=problem.num_heads, head_dim_ckv=geo.kv_lora_rank,
                head_dim_kpe=geo.qk_rope_head_dim, page_size=meta.page_size, causal=meta.causal,
                sm_scale=inputs.sm_scale, q_data_type=q.dtype, kv_data_type=kv.dtype,
                lse_mode="basee")
            out = torch.empty(tokens, problem.num_heads, geo.kv_lora_rank, dtype=q.dtype,
                              device=q.device)
            lse = torch.empty(tokens, problem.num_heads, dtype=torch.float32, device=q.device)
            prepared = _PreparedFlashInfer(problem, wrapper, out, lse, sparse=self.sparse,
                                           kv_scale=inputs.kv_scale)
            prepared.run(inputs)          # first launch: lazy loading, launch errors
            torch.cuda.synchronize(q.device)
        except (RuntimeError, ValueError, TypeError, NotImplementedError, OSError) as exc:
            raise BackendUnavailable(f"FlashInfer {self.backend} rejected the problem: "
                                     f"{type(exc).__name__}: {exc}") from exc
        return prepared


class FlashInferFA2(_FlashInferMLA):
    name: ClassVar[str] = "FLASHINFER_FA2_MLA"
    backend: ClassVar[str] = "fa2"


class FlashInferFA3(_FlashInferMLA):
    name: ClassVar[str] = "FLASHINFER_FA3_MLA"
    backend: ClassVar[str] = "fa3"


class FlashInferFA2Sparse(_FlashInferMLA):
    name: ClassVar[str] = "FLASHINFER_FA2_MLA_SPARSE"
    backend: ClassVar[str] = "fa2"
    sparse: ClassVar[bool] = True


class FlashInferFA3Sparse(_FlashInferMLA):
    name: ClassVar[str] = "FLASHINFER_FA3_MLA_SPARSE"
    backend: ClassVar[str] = "fa3"
    sparse: ClassVar[bool] = True


def csr_page_counts_match(meta: CsrMetadata) -> bool:
    """FlashInfer's silent requirement: each segment's page count is ceil(kv_len / page_size)."""
    counts = (meta.kv_indptr[1:] - meta.kv_indptr[:-1]).tolist()
    return all(c == math.ceil(n / meta.page_size) for c, n in zip(counts, meta.kv_len_arr.tolist()))
