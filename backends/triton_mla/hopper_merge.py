"""The merge in stage 1: the last program of a request's splits merges their partials, in place of the combine.

Each program of a split launch writes its `(out, lse)` partial, then counts itself done on its (request, row
block)'s counter (a barrier, then one release add at GPU scope, as CUTLASS's semaphore does). The program that
counts last resets the counter for the next launch and merges every split's partial into the output exactly as
`combine._mla_combine_kernel` does. Where it runs is `dispatch.merges_in_stage1`; the narrow form only.
"""

# No `from __future__ import annotations`: the aggregate checks its fields against real annotation types.
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.language.core import _aggregate as aggregate
from triton.language.core import base_value

from mla_tune.backends.triton_mla.hopper_common import Program, _partition_barrier, _rows, _value

MERGE_COLS = gl.constexpr(128)  # output columns merged at a time: a row's 128 fp32 values are one warp's 16-byte loads


@aggregate
class Merge:
    """Where a program counts itself done and, if last, writes the merged output: `count_ptr` (int32, one counter
    per request and row block, zero between launches), the final `out_ptr` / `lse_ptr` and their strides, and
    `n_splits`, the programs that count on this counter. `ON`: whether the launch merges in stage 1 at all."""

    count_ptr: base_value
    out_ptr: base_value
    lse_ptr: base_value
    stride_ob: base_value
    stride_ot: base_value
    stride_oh: base_value
    stride_lb: base_value
    stride_lt: base_value
    stride_lh: base_value
    n_splits: base_value
    ON: gl.constexpr

    @gluon.constexpr_function
    def __init__(self, count_ptr, out_ptr, lse_ptr, stride_ob, stride_ot, stride_oh, stride_lb, stride_lt, stride_lh,
                 n_splits, ON):
        self.count_ptr = _value(count_ptr)
        self.out_ptr = _value(out_ptr)
        self.lse_ptr = _value(lse_ptr)
        self.stride_ob = _value(stride_ob)
        self.stride_ot = _value(stride_ot)
        self.stride_oh = _value(stride_oh)
        self.stride_lb = _value(stride_lb)
        self.stride_lt = _value(stride_lt)
        self.stride_lh = _value(stride_lh)
        self.n_splits = _value(n_splits)
        self.ON = gl.constexpr(ON)


@gluon.jit
def _merge_if_last(merge: Merge, prog: Program):
    """Count this program's partial (written by this partition) done; the last of its request's `n_splits` merges
    them all into the output and LSE."""
    _partition_barrier()  # every thread's partial stores come before the release add
    count = merge.count_ptr + prog.b * gl.num_programs(0) + prog.pid_m
    done = gl.atomic_add(count, 1, sem="acq_rel", scope="gpu")
    if done == merge.n_splits - 1:
        gl.store(count, 0)
        _merge_splits(merge, prog)


@gluon.jit
def _merge_splits(merge: Merge, prog: Program):
    """`combine._mla_combine_kernel` over the program's rows: `lse = logsumexp(lse_s)`, `out = sum_s exp(lse_s -
    lse) out_s`; splits with `lse_s = -inf` wrote no partial and are not read. The partials are read from L2
    (`.cg`): other SMs wrote them."""
    N_ROWS: gl.constexpr = prog.N_ROWS
    layout: gl.constexpr = gl.BlockedLayout([1, 4], [1, 32], [gl.num_warps(), 1], [1, 0])
    rows_l: gl.constexpr = gl.SliceLayout(1, layout)
    qi, h, ok = _rows(prog.pid_m, prog.num_heads, rows_l, prog.Q_LEN, prog.SPARSE, N_ROWS)
    b = prog.b.to(gl.int64)
    lse_part = prog.lse_ptr + b * prog.stride_lb + qi * prog.stride_lt + h * prog.stride_lh
    m = gl.full([N_ROWS], float("-inf"), gl.float32, rows_l)
    for s in range(merge.n_splits):
        m = gl.maximum(m, gl.load(lse_part + s * prog.stride_ls, mask=ok, other=float("-inf"), cache_modifier=".cg"))
    m_safe = gl.where(m == float("-inf"), 0.0, m)
    total = gl.zeros([N_ROWS], gl.float32, rows_l)
    for s in range(merge.n_splits):
        total += gl.exp(gl.load(lse_part + s * prog.stride_ls, mask=ok, other=float("-inf"), cache_modifier=".cg")
                        - m_safe)
    inv_total = gl.where(total > 0.0, 1.0 / gl.where(total > 0.0, total, 1.0), 0.0)
    o_part = prog.o_ptr + b * prog.stride_ob + qi * prog.stride_ot + h * prog.stride_oh
    out_row = merge.out_ptr + b * merge.stride_ob + qi * merge.stride_ot + h * merge.stride_oh
    for c in gl.static_range(512 // MERGE_COLS):
        cols = c * MERGE_COLS + gl.arange(0, MERGE_COLS, layout=gl.SliceLayout(0, layout))
        acc = gl.zeros([N_ROWS, MERGE_COLS], gl.float32, layout)
        for s in range(merge.n_splits):
            lse_s = gl.load(lse_part + s * prog.stride_ls, mask=ok, other=float("-inf"), cache_modifier=".cg")
            weight = gl.exp(lse_s - m_safe) * inv_total
            written = ok & (lse_s > float("-inf"))
            part = gl.load(o_part[:, None] + s * prog.stride_os + cols[None, :], mask=written[:, None], other=0.0,
                           cache_modifier=".cg")
            acc += weight[:, None] * part
        gl.store(out_row[:, None] + cols[None, :], acc.to(merge.out_ptr.dtype.element_ty), mask=ok[:, None])
    lse = gl.where(total > 0.0, m_safe + gl.log(gl.where(total > 0.0, total, 1.0)), float("-inf"))
    gl.store(merge.lse_ptr + b * merge.stride_lb + qi * merge.stride_lt + h * merge.stride_lh, lse, mask=ok)
