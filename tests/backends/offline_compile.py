"""Compile the stage-1 kernel for an NVIDIA GPU on a machine without one (Triton's bundled ptxas).

Gives the PTX that GPU would run, so CPU tests can check what Triton makes of a
variant (which shared-memory loads feed the MMAs) and what it refuses to compile.
"""

from __future__ import annotations

import inspect

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from mla_tune.backends.triton_mla.tl_kernel import _mla_split_kernel

_POINTERS = {"q_ptr": "*bf16", "block_table_ptr": "*i32", "seq_lens_ptr": "*i32", "topk_ptr": "*i32",
             "kv_scale_ptr": "*fp32", "o_ptr": "*fp32", "lse_ptr": "*fp32"}
_FLOATS = {"sm_scale_log2", "kv_scale", "q_scale"}


def _constexpr_defaults(kernel) -> dict:
    """The kernel's constexprs that have a default, with it (a compile must not leave one as a runtime i32)."""
    return {p.name: p.default for p in kernel.params if p.is_constexpr and p.default is not inspect.Parameter.empty}


def _signature(kernel, const: dict, pointers: dict, *, divisible_strides) -> tuple[dict, dict]:
    """(signature, attrs) for `kernel`: constexprs, pointers (16-byte aligned), fp32 scales, i32 ints;
    the strides `divisible_strides(name)` accepts get divisibility 16, as Triton's launcher would find them."""
    signature, attrs = {}, {}
    for i, name in enumerate(kernel.arg_names):
        if name in const:
            signature[name] = "constexpr"
        elif name in pointers:
            signature[name] = pointers[name]
            attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            signature[name] = "fp32" if name in _FLOATS else "i32"
            if name.startswith("stride") and divisible_strides(name):
                attrs[(i,)] = [["tt.divisibility", 16]]
    return signature, attrs


def _order_pointer(const: dict, pointers: dict) -> None:
    """The launch order's pointer: an int32 array with ORDERED, else the constexpr None the launcher passes."""
    if const.get("ORDERED"):
        pointers["order_ptr"] = "*i32"
    else:
        const["order_ptr"] = None


def _kv_descriptors(const: dict, pointers: dict, block_n: int, page_size: int, tma: bool,
                    col_blocks: int | None = None, kv_type: str = "fp8e4nv") -> None:
    """The TMA descriptors of the cache (`launcher.kv_descriptors`'s boxes and layouts; `kv_type`: its element type
    as a signature names it) with `tma`, else the None the launcher passes."""
    if not tma:
        const.update(kv_lat_desc=None, kv_rope_desc=None)
        return
    from mla_tune.backends.triton_mla.launcher import _tma_layouts

    dtype = {"fp8e4nv": torch.float8_e4m3fn, "bf16": torch.bfloat16, "fp16": torch.float16}[kv_type]
    block_cols = 128 // dtype.itemsize
    box = min(page_size, block_n)
    _, lat, rope = _tma_layouts(dtype, box, box == block_n)
    pointers["kv_rope_desc"] = f"tensordesc<{kv_type}[{box}, 64],{rope!r}>"
    if box == block_n:
        blocks = col_blocks or 512 // block_cols
        pointers["kv_lat_desc"] = f"tensordesc<{kv_type}[{blocks}, {box}, {block_cols}],{lat!r}>"
    else:
        pointers["kv_lat_desc"] = f"tensordesc<{kv_type}[{box}, {block_cols}],{lat!r}>"


def kernel_ptx(*, block_h: int, block_n: int, num_warps: int, num_stages: int, fp8: bool = True, arch: int = 90,
               **flags) -> str:
    """PTX for sm_`arch` of a dense, page-size-64, q_len-1 launch of `_mla_split_kernel` with these constexprs."""
    const = _constexpr_defaults(_mla_split_kernel)
    const.update(Q_LEN=1, PAGE_SIZE=64, D_LATENT=512, D_ROPE=64, BLOCK_H=block_h, BLOCK_N=block_n, SPARSE=False,
                 KV_CAST=fp8, KV_SCALE_IS_PTR=False, DOT_UPCAST=False, SPLIT_D=True, RELOAD_V=False,
                 p_scratch_ptr=None)
    const.update(flags)
    pointers = {**_POINTERS, "kv_ptr": "*fp8e4nv" if fp8 else "*bf16"}
    _order_pointer(const, pointers)
    signature, attrs = _signature(_mla_split_kernel, const, pointers, divisible_strides=lambda n: n != "stride_qh")
    source = ASTSource(_mla_split_kernel, signature, constexprs=const, attrs=attrs)
    compiled = triton.compile(source, target=GPUTarget("cuda", arch, 32),
                              options={"num_warps": num_warps, "num_stages": num_stages})
    return compiled.asm["ptx"]


def combine_ptx(*, arch: int = 90, **flags) -> str:
    """PTX for sm_`arch` of `_mla_combine_kernel` (q_len 1, up to 16 splits loaded 4 at a time) with these
    constexprs."""
    from mla_tune.backends.triton_mla.combine import _mla_combine_kernel

    const = _constexpr_defaults(_mla_combine_kernel)
    const.update(D_LATENT=512, BLOCK_S=16, SPLITS_AT_ONCE=4, seq_lens_ptr=None, **flags)
    pointers = {"o_part_ptr": "*fp32", "lse_part_ptr": "*fp32", "out_ptr": "*bf16", "lse_ptr": "*fp32"}
    signature, attrs = _signature(_mla_combine_kernel, const, pointers, divisible_strides=lambda n: True)
    compiled = triton.compile(ASTSource(_mla_combine_kernel, signature, constexprs=const, attrs=attrs),
                              target=GPUTarget("cuda", arch, 32), options={"num_warps": 4})
    return compiled.asm["ptx"]


def round_query_ptx(*, arch: int = 90, **flags) -> str:
    """PTX for sm_`arch` of `query_e4m3._round_query_kernel` (bf16 rows of 576) with these constexprs."""
    from mla_tune.backends.triton_mla.query_e4m3 import ROWS_PER_PROGRAM, _round_query_kernel

    const = _constexpr_defaults(_round_query_kernel)
    const.update(D_LATENT=512, D_ROPE=64, BLOCK_R=ROWS_PER_PROGRAM, **flags)
    pointers = {"q_ptr": "*bf16", "q8_ptr": "*fp8e4nv", "amax_ptr": "*fp32"}
    signature, attrs = _signature(_round_query_kernel, const, pointers, divisible_strides=lambda n: True)
    compiled = triton.compile(ASTSource(_round_query_kernel, signature, constexprs=const, attrs=attrs),
                              target=GPUTarget("cuda", arch, 32), options={"num_warps": 4})
    return compiled.asm["ptx"]


def hopper_compile(*, kv: str = "bf16", sparse: bool = False, q_len: int = 1, page_size: int = 64, rows: int = 64,
                   qk1: bool = False, **overrides) -> tuple[str, int, str]:
    """(PTX, shared-memory bytes, ptxas -v report) of the warp-specialised kernel for sm_90a, `rows` per program
    (`qk1`: the qk1 form; `FP8_QUERY=True` among the overrides: the FP8-query backend's tile; `TMA_KV=True`: the
    TMA copies, given the launcher's descriptors; `ROUNDED_QUERY`: its query rounded before the launch or not,
    instead of as the dispatch says), `kv` one of bf16, fp16, fp8 and fp8_ds_mla, with the constexprs
    `dispatch.hopper_constexprs` gives a one-split launch, then `overrides`."""
    import subprocess
    import tempfile

    from triton.backends.nvidia.compiler import get_ptxas
    from triton.experimental.gluon._runtime import GluonASTSource

    from mla_tune.backends.triton_mla.config import HOPPER_MAXNREG, LaunchParams
    from mla_tune.backends.triton_mla.dispatch import (
        HOPPER_QK1_TILE, HOPPER_TILES, fp8_query_form_tile, fp8_query_tile, hopper_constexprs, rounds_query_before)
    from mla_tune.backends.triton_mla.hopper import _mla_hopper_kernel
    from mla_tune.backends.triton_mla.launcher import tma_col_blocks

    ds_mla = kv == "fp8_ds_mla"
    fp8 = kv == "fp8" or ds_mla
    tma = overrides.pop("TMA_KV", False)
    rounded_query = overrides.pop("ROUNDED_QUERY", None)
    # FP8-query: the four-slot wide form for 64 rows, the narrow form for 16-32
    if overrides.get("FP8_QUERY"):
        tile = (fp8_query_tile(num_heads=rows, q_len=1, batch=128, max_items=16384) if rows > 32
                else fp8_query_form_tile("narrow", rows))
    else:
        tile = HOPPER_QK1_TILE if qk1 else HOPPER_TILES[rows]
    params = LaunchParams(**tile.launch_fields())
    if rounded_query is None:
        rounded_query = rounds_query_before(params)
    const = _constexpr_defaults(_mla_hopper_kernel)
    const.update(Q_LEN=q_len, PAGE_SIZE=page_size, BLOCK_N=params.block_n, SPARSE=sparse, KV_SCALE_IS_PTR=False,
                 **hopper_constexprs(params, kv_fp8=fp8, sparse=sparse, ds_mla=ds_mla))
    const.update(overrides)
    q_type = "*fp16" if kv == "fp16" else "*bf16"
    pointers = {**_POINTERS, "q_ptr": q_type, "kv_ptr": "*fp8e4nv" if fp8 else q_type}
    if rounded_query:  # the query rounded before the launch and its rows' scales (query_e4m3.round_query)
        pointers.update(q_ptr="*fp8e4nv", q_amax_ptr="*fp32")
    else:
        const["q_amax_ptr"] = None
    _order_pointer(const, pointers)
    _kv_descriptors(const, pointers, params.block_n, page_size, tma, tma_col_blocks(params), pointers["kv_ptr"][1:])
    signature, attrs = _signature(_mla_hopper_kernel, const, pointers, divisible_strides=lambda n: True)
    # a descriptor takes no pointer's divisibility
    descriptors = ("kv_lat_desc", "kv_rope_desc")
    attrs = {k: v for k, v in attrs.items() if _mla_hopper_kernel.arg_names[k[0]] not in descriptors}
    source = GluonASTSource(_mla_hopper_kernel, signature, constexprs=const, attrs=attrs)
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": params.num_warps, "maxnreg": HOPPER_MAXNREG})
    ptx = compiled.asm["ptx"]
    ptxas = get_ptxas(90).path  # the one Triton itself uses for sm_90 (3.9: a newer one than bin/ptxas)
    with tempfile.TemporaryDirectory() as tmp:
        with open(f"{tmp}/k.ptx", "w") as f:
            f.write(ptx)
        report = subprocess.run([ptxas, "-arch=sm_90a", "-v", f"{tmp}/k.ptx", "-o", f"{tmp}/k.cubin"],
                                capture_output=True, text=True, check=True).stderr
    return ptx, compiled.metadata.shared, report
