"""The launcher: enqueues stage 1 (the tl kernel or the Hopper kernel) and the combine (the wide FP8-query form:
the query's rounding first). No allocation, no sync."""

from __future__ import annotations

from functools import cache, partial

import torch
import triton

from mla_tune.backends.triton_mla import dispatch
from mla_tune.backends.triton_mla.combine import _mla_combine_kernel
from mla_tune.backends.triton_mla.config import (
    D_LATENT, D_ROPE, DS_MLA_BYTES, HOPPER_MAXNREG, LaunchParams, cc_major, is_ds_mla, sm_count)
from mla_tune.backends.triton_mla.dispatch import COMBINE_SPLITS_AT_ONCE, hopper_constexprs
from mla_tune.backends.triton_mla.query_e4m3 import round_query
from mla_tune.backends.triton_mla.splits import m_blocks_of
from mla_tune.backends.triton_mla.tl_kernel import Q_FP16_SCALE, _mla_split_kernel
from mla_tune.backends.triton_mla.workspace import Workspace

LOG2E = 1.4426950408889634


def kv_cache_in_words(kv_cache: torch.Tensor) -> bool:
    """Whether `kv_cache` can be read as 32-bit words: its base address and page and token strides in bytes are
    multiples of 4 (a view with an odd row stride is not; the FP8 loader ahead divides the strides by 4)."""
    size = kv_cache.element_size()
    return (kv_cache.data_ptr() % 4 == 0 and (kv_cache.stride(0) * size) % 4 == 0
            and (kv_cache.stride(1) * size) % 4 == 0)


def _destinations(out, lse, workspace: Workspace | None, splits: int) -> tuple:
    """(stage-1 output, its 4 strides, stage-1 LSE, its 4 strides): the split partials, or with one split the
    final outputs (split stride 0)."""
    if splits > 1:
        o_dst, l_dst = workspace.o_part, workspace.lse_part
        return (o_dst, (o_dst.stride(0), o_dst.stride(1), o_dst.stride(2), o_dst.stride(3)),
                l_dst, (l_dst.stride(0), l_dst.stride(1), l_dst.stride(2), l_dst.stride(3)))
    return (out, (out.stride(0), 0, out.stride(1), out.stride(2)),
            lse, (lse.stride(0), 0, lse.stride(1), lse.stride(2)))


def launch(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
           seq_lens: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, *,
           sm_scale: float, kv_scale, topk_indices: torch.Tensor | None,
           params: LaunchParams, workspace: Workspace | None, combine_variants: bool = False):
    """Enqueue stage 1 (and the combine when `params.num_splits > 1`); no allocation, no sync.

    Returns the compiled stage-1 kernel (its `n_regs`, `n_spills`, `metadata`).

    Args:
        q: `[batch, q_len, heads, 576]`, last dim contiguous.
        kv_cache: `[num_pages, page_size, 576]`, last dim contiguous; or vLLM's fp8_ds_mla rows, uint8
            `[num_pages, page_size, 656]` (the Hopper forms, or tl tiles with `split_d`; their own scales, `kv_scale`
            ignored).
        out: `[batch, q_len, heads, 512]` in q's dtype (written).
        lse: fp32 `[batch, q_len, heads]` (written).
        kv_scale: None, a float, or a 0-d fp32 tensor on q's device.
        combine_variants: also compile, without running, the combine's other launch (as stage 1's dependent or
            not): the tuner's pre-build launches at batch 1, where `_early_combine` may choose otherwise.
    """
    batch, q_len, num_heads, _ = q.shape
    page_size = kv_cache.shape[1]
    sparse = topk_indices is not None
    ds_mla = is_ds_mla(kv_cache)
    if ds_mla and params.fp8_query:
        raise ValueError("fp8_query multiplies e4m3 operands: it needs a float8_e4m3fn cache, got fp8_ds_mla rows")
    if sparse and params.fp8_query:
        raise ValueError("fp8_query runs dense decode only (no top-k indices)")
    if ds_mla:
        _check_ds_mla(params, kv_cache)
        kv_cache, kv_scale = kv_cache.view(torch.float8_e4m3fn), None  # the e4m3 bytes; scales are read per row
    if params.fp8_query and kv_cache.dtype != torch.float8_e4m3fn:
        raise ValueError(f"fp8_query multiplies e4m3 operands: it needs a float8_e4m3fn cache, got {kv_cache.dtype}")
    kv_cast = kv_cache.dtype != q.dtype
    scale_is_ptr = isinstance(kv_scale, torch.Tensor)
    scale_value = 1.0 if kv_scale is None or scale_is_ptr else float(kv_scale)
    topk = topk_indices.shape[2] if sparse else 0
    tk_strides = (topk_indices.stride(0), topk_indices.stride(1)) if sparse else (0, 0)
    if sparse and params.hoist_pages % params.block_n:
        raise ValueError(f"sparse hoist_pages {params.hoist_pages} is not a multiple of block_n {params.block_n}")
    splits = params.num_splits
    split_items, tiles = split_extent(params, capacity=topk if sparse else block_table.shape[1] * page_size)
    if params.split_per_request and sparse:
        raise ValueError("split_per_request sizes dense splits; a sparse request's length is its top-k")
    o_dst, o_strides, l_dst, l_strides = _destinations(out, lse, workspace, splits)
    q_amax = None
    if dispatch.rounds_query_before(params):
        if workspace is None or workspace.q8 is None:
            raise ValueError("an fp8_query launch rounds its query into the workspace's q8 (Workspace.for_launch)")
        round_query(q, workspace.q8, workspace.q_amax)
        q, q_amax = workspace.q8, workspace.q_amax  # stage 1 copies the rounded rows
    # FP8 tiles multiplied in fp16 with the bf16 query scaled by Q_FP16_SCALE first: the tl kernel where
    # params.fp16_math says so, the Hopper kernel always (an fp16 query needs no scale).
    fp16_math = kv_cast and q.dtype == torch.bfloat16 and (params.fp16_math or params.warp_specialized)
    # The arguments both stage-1 kernels take, in their order (the Hopper kernel has the tl kernel's signature).
    args = (q, kv_cache, block_table, seq_lens, topk_indices if sparse else seq_lens,
            kv_scale if scale_is_ptr else seq_lens, o_dst, l_dst,
            sm_scale * LOG2E, scale_value, Q_FP16_SCALE if fp16_math else 1.0,
            q.stride(0), q.stride(1), q.stride(2), kv_cache.stride(0), kv_cache.stride(1), block_table.stride(0),
            *tk_strides, *o_strides, *l_strides, num_heads, topk, split_items)
    m_blocks = m_blocks_of(params, num_heads=num_heads, q_len=q_len, sparse=sparse)
    order = workspace.order if params.longest_first else None
    grid = (m_blocks, order.numel(), 1) if params.longest_first else (m_blocks, batch, splits)
    # stage 1 lets a combine start early wherever one follows (a no-op unless the combine is launched as its
    # dependent), so that its build does not depend on the batch; the combine starts early by `_early_combine`
    lets_combine_start = splits > 1 and _dependent_launches(q)
    early_combine = splits > 1 and _early_combine(q, grid, q_len * num_heads * batch)
    common = dict(Q_LEN=q_len, PAGE_SIZE=page_size, BLOCK_N=params.block_n, SPARSE=sparse,
                  KV_SCALE_IS_PTR=scale_is_ptr, SPLIT_PER_REQUEST=params.split_per_request,
                  order_ptr=order, ORDERED=params.longest_first, LAUNCH_COMBINE_EARLY=lets_combine_start)
    if params.warp_specialized:
        compiled = _launch_hopper(args, grid, common, q=q, kv_cache=kv_cache, params=params, tiles=tiles,
                                  ds_mla=ds_mla, q_amax=q_amax)
    else:
        compiled = _mla_split_kernel[grid](
            *args, **common, D_LATENT=D_LATENT, D_ROPE=D_ROPE, BLOCK_H=params.block_h, KV_CAST=kv_cast,
            DOT_UPCAST=q.device.type != "cuda", SPLIT_D=params.split_d, RELOAD_V=params.reload_v,
            HOIST_PAGES=params.hoist_pages, FP16_MATH=fp16_math, OPAQUE_V_CAST=params.opaque_v_cast and q.is_cuda,
            p_scratch_ptr=workspace.p_scratch if params.split_scores else None, SPLIT_SCORES=params.split_scores,
            DS_MLA=ds_mla,
            num_warps=params.num_warps, num_stages=params.num_stages,
            **({"maxnreg": params.max_regs} if params.max_regs and q.is_cuda else {}))
    if splits > 1:
        combine = dict(num_heads=num_heads, splits=splits, lengths=seq_lens if params.longest_first else None,
                       split_items=split_items)
        _combine(workspace, out, lse, o_strides, l_strides, **combine, after_stage1=early_combine)
        if combine_variants and lets_combine_start:
            _combine(workspace, out, lse, o_strides, l_strides, **combine, after_stage1=not early_combine,
                     compile_only=True)
    return compiled


def split_extent(params: LaunchParams, *, capacity: int) -> tuple[int, int]:
    """(split_items, tiles): the items of a split as stage 1 is given it (`params.split_items`, or where that is 0
    the longest split of `capacity` items: a block table's tokens, or the top-k), and the most KV tiles one program
    has (with `split_per_request` a request's split may be as long as a full table's)."""
    longest_split = triton.cdiv(triton.cdiv(capacity, params.num_splits), params.block_n) * params.block_n
    split_items = params.split_items if params.split_items > 0 else longest_split
    most = max(split_items, longest_split) if params.split_per_request else split_items
    return split_items, triton.cdiv(most, params.block_n)


def _dependent_launches(q: torch.Tensor) -> bool:
    """Whether the combine may be launched as stage 1's programmatic dependent (`dispatch.COMBINE_AFTER_STAGE1`,
    SM90+)."""
    return dispatch.COMBINE_AFTER_STAGE1 and (cc_major(q.device) or 0) >= 9


def _early_combine(q: torch.Tensor, grid: tuple, combine_programs: int) -> bool:
    """Whether the combine is launched as stage 1's programmatic dependent, started by every stage-1 program at once
    (`_dependent_launches`): where the SMs stage 1's `grid` leaves idle hold the combine's programs at
    `dispatch.COMBINE_EARLY_PER_IDLE_SM` or fewer each."""
    idle_sms = sm_count(q.device) - grid[0] * grid[1] * grid[2]
    return _dependent_launches(q) and combine_programs <= dispatch.COMBINE_EARLY_PER_IDLE_SM * idle_sms


def _check_ds_mla(params: LaunchParams, kv_cache: torch.Tensor) -> None:
    """Raise ValueError where fp8_ds_mla rows cannot be read: they must lie as vLLM and FlashMLA lay them out
    (contiguous rows from a 16-byte aligned address, page stride a multiple of 16 bytes: the Hopper loader reads
    16 bytes at a time), and a tl tile needs `split_d` (its four column blocks are the row's four scale groups)."""
    if kv_cache.data_ptr() % 16 or kv_cache.stride(0) % 16 or kv_cache.stride(1) != DS_MLA_BYTES \
            or kv_cache.stride(2) != 1:
        raise ValueError(f"fp8_ds_mla rows must be contiguous ({DS_MLA_BYTES} bytes apart) from a 16-byte aligned "
                         f"address, with a page stride that is a multiple of 16 bytes: got address "
                         f"{kv_cache.data_ptr()} and strides {tuple(kv_cache.stride())} bytes")
    if not params.warp_specialized and (not params.split_d or params.split_scores):
        raise ValueError(f"fp8_ds_mla on the tl kernel needs split_d (one column block per scale group) without "
                         f"split_scores; got split_d={params.split_d}, split_scores={params.split_scores}")


def _combine(workspace: Workspace, out, lse, o_strides, l_strides, *, num_heads: int, splits: int,
             lengths: torch.Tensor | None = None, split_items: int = 0, after_stage1: bool = False,
             compile_only: bool = False) -> None:
    """Stage 2: merge the split partials into `out` / `lse`; with `lengths` only each request's splits of
    `split_items` that hold tokens (a `longest_first` launch runs no other); `after_stage1`: launched as stage 1's
    programmatic dependent, waiting in the kernel for stage 1's writes; `compile_only`: compiled, not run."""
    batch, q_len = out.shape[0], out.shape[1]
    grid = (q_len * num_heads, batch)
    kernel = partial(_mla_combine_kernel.warmup, grid=grid) if compile_only else _mla_combine_kernel[grid]
    kernel(
        workspace.o_part, workspace.lse_part, out, lse,
        *o_strides, *l_strides,
        out.stride(0), out.stride(1), out.stride(2),
        lse.stride(0), lse.stride(1), lse.stride(2),
        num_heads, splits, lengths, split_items,
        D_LATENT=D_LATENT, BLOCK_S=triton.next_power_of_2(splits),
        SPLITS_AT_ONCE=min(triton.next_power_of_2(splits), COMBINE_SPLITS_AT_ONCE),
        SPLITS_OF_LENGTHS=lengths is not None, AFTER_STAGE1=after_stage1,
        LOADS_AHEAD=triton.next_power_of_2(splits) <= dispatch.COMBINE_AHEAD_MAX_SPLITS, num_warps=4,
        **({"launch_pdl": True} if after_stage1 else {}),
    )


def _launch_hopper(args: tuple, grid: tuple, common: dict, *, q, kv_cache, params: LaunchParams, tiles: int,
                   ds_mla: bool = False, q_amax: torch.Tensor | None = None):
    """Stage 1 on the warp-specialised Hopper kernel (`hopper.py`); `tiles`: the most KV tiles a program has;
    `ds_mla`: `kv_cache` is fp8_ds_mla rows (viewed as e4m3); `q_amax`: the FP8-query rows' scales, when `q` is
    the query rounded by `query_e4m3.round_query`."""
    if not q.is_cuda:
        raise ValueError("warp_specialized runs on a CUDA GPU only (Gluon has no interpreter)")
    from mla_tune.backends.triton_mla import hopper

    form = hopper_constexprs(params, kv_fp8=kv_cache.dtype == torch.float8_e4m3fn, sparse=common["SPARSE"],
                             tiles=tiles, kv_words=kv_cache_in_words(kv_cache), ds_mla=ds_mla,
                             query_rows=q.shape[1] * q.shape[2])
    by_tma = dispatch.copies_by_tma(params, kv_fp8=kv_cache.dtype == torch.float8_e4m3fn or ds_mla,
                                    sparse=common["SPARSE"], page_size=kv_cache.shape[1],
                                    query_rows=q.shape[1] * q.shape[2])
    descriptors = kv_descriptors(kv_cache, params.block_n, col_blocks=tma_col_blocks(params)) if by_tma else None
    if descriptors is not None:
        form.update(kv_lat_desc=descriptors[0], kv_rope_desc=descriptors[1])
    if q_amax is not None:
        form.update(q_amax_ptr=q_amax, **({"launch_pdl": True} if dispatch.FP8Q_ROUNDED_QUERY_PDL else {}))
    return hopper._mla_hopper_kernel[grid](*args, **common, **form, num_warps=params.num_warps,
                                           maxnreg=HOPPER_MAXNREG)


def tma_col_blocks(params: LaunchParams) -> int | None:
    """The 128-byte latent column blocks one TMA box of a tile takes: half of the four e4m3 ones in the wide
    FP8-query form (each p @ v warpgroup copies its half), all of them (None) elsewhere."""
    return 2 if params.kernel_form == "fp8_query_wide" else None


def kv_descriptors(kv_cache: torch.Tensor, block_n: int, col_blocks: int | None = None) -> tuple | None:
    """TMA descriptors (latent, rope) of an e4m3 or 16-bit cache's rows as one `[pages x page_size, 576]` matrix:
    boxes of a page's rows (a tile's, for pages as long or longer) by the 64 rope columns, and by a 128-byte block
    of latent columns (128 e4m3 or 64 16-bit ones) or, a tile's rows, by `col_blocks` such blocks (None: all) as
    `[col_blocks, rows, 128 bytes]` (the 128-byte swizzled slot's byte order; half the e4m3 blocks for the wide
    form, whose p @ v warpgroups copy half the columns each); None where TMA cannot read it that way: pages not
    back to back, rows not 16-byte aligned, pages other than a multiple of 8 rows that divides a tile or is divided
    by it."""
    pages, page_size, width = kv_cache.shape
    element_bytes = kv_cache.element_size()
    box = min(page_size, block_n)
    if (kv_cache.stride(2) != 1 or kv_cache.stride(0) != page_size * kv_cache.stride(1)
            or kv_cache.stride(1) * element_bytes % 16 or kv_cache.data_ptr() % 16 or box % 8
            or max(page_size, block_n) % box):
        return None
    rows, row_stride = pages * page_size, kv_cache.stride(1)
    block_cols = 128 // element_bytes
    all_blocks = (width - 64) // block_cols
    descriptor, lat_layout, rope_layout = _tma_layouts(kv_cache.dtype, box, box == block_n)
    rope = descriptor(kv_cache, [rows, width], [row_stride, 1], [box, 64], rope_layout)
    if box == block_n:  # a tile's 512 latent columns as one [column block, row, 128 bytes] box
        lat = descriptor(kv_cache, [all_blocks, rows, block_cols], [block_cols, row_stride, 1],
                         [col_blocks or all_blocks, box, block_cols], lat_layout)
    else:
        lat = descriptor(kv_cache, [rows, width], [row_stride, 1], [box, block_cols], lat_layout)
    return lat, rope


@cache
def _tma_layouts(kv_dtype: torch.dtype, box: int, whole_tile: bool) -> tuple:
    """(TensorDescriptor, latent box layout, rope box layout) of `kv_descriptors`, made once per kind of box: made
    at every launch, they took most of its host time (bench/results/qk1-h200.txt 13)."""
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    dtype = {torch.float8_e4m3fn: gl.float8e4nv, torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}[kv_dtype]
    block_cols = 1024 // dtype.primitive_bitwidth  # 128 bytes
    if whole_tile:
        lat = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=dtype.primitive_bitwidth, rank=3)
    else:
        lat = gl.NVMMASharedLayout.get_default_for([box, block_cols], dtype)
    return TensorDescriptor, lat, gl.NVMMASharedLayout.get_default_for([box, 64], dtype)
