"""Compile the stage-1 kernel for an NVIDIA GPU on a machine without one (Triton's bundled ptxas).

Gives the PTX that GPU would run, so CPU tests can check what Triton makes of a
variant (which shared-memory loads feed the MMAs) and what it refuses to compile.
"""

from __future__ import annotations

import inspect

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from mla_tune.backends.triton_mla.kernel import _mla_split_kernel

_POINTERS = {"q_ptr": "*bf16", "block_table_ptr": "*i32", "seq_lens_ptr": "*i32", "topk_ptr": "*i32",
             "kv_scale_ptr": "*fp32", "o_ptr": "*fp32", "lse_ptr": "*fp32"}
_FLOATS = {"sm_scale_log2", "kv_scale", "q_scale"}


def kernel_ptx(*, block_h: int, block_n: int, num_warps: int, num_stages: int, fp8: bool = True, arch: int = 90,
               **flags) -> str:
    """PTX for sm_`arch` of a dense, page-size-64, q_len-1 launch of `_mla_split_kernel` with these constexprs."""
    # constexprs without a value here take the kernel's defaults
    const = {p.name: p.default for p in _mla_split_kernel.params
             if p.is_constexpr and p.default is not inspect.Parameter.empty}
    const.update(Q_LEN=1, PAGE_SIZE=64, D_LATENT=512, D_ROPE=64, BLOCK_H=block_h, BLOCK_N=block_n, SPARSE=False,
                 KV_CAST=fp8, KV_SCALE_IS_PTR=False, DOT_UPCAST=False, SPLIT_D=True, RELOAD_V=False,
                 p_scratch_ptr=None)
    const.update(flags)
    signature, attrs = {}, {}
    for i, name in enumerate(_mla_split_kernel.arg_names):
        if name in const:
            signature[name] = "constexpr"
        elif name in _POINTERS or name == "kv_ptr":
            signature[name] = "*fp8e4nv" if name == "kv_ptr" and fp8 else _POINTERS.get(name, "*bf16")
            attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            signature[name] = "fp32" if name in _FLOATS else "i32"
            if name.startswith("stride") and name != "stride_qh":
                attrs[(i,)] = [["tt.divisibility", 16]]
    source = ASTSource(_mla_split_kernel, signature, constexprs=const, attrs=attrs)
    compiled = triton.compile(source, target=GPUTarget("cuda", arch, 32),
                              options={"num_warps": num_warps, "num_stages": num_stages})
    return compiled.asm["ptx"]
