"""The split model: how many programs share one request's KV range (flash-decoding), and the resulting launch.

A tile becomes `LaunchParams` once its split count is chosen for a shape: from the per-request lengths where they
are known (`balanced_splits`, in `prepare`; a dense launch then runs its splits longest first, `launch_order`),
otherwise from the batch, rows and SMs over the block table's capacity (`choose_splits`, no host sync). Without
lengths a dense launch sizes each request's splits on the device from its own length (`split_per_request`), so a
CUDA graph captured for a wide block table follows every step's lengths. Either way
`batch x num_splits <= batch + 4 x SMs`, which bounds the workspace (`workspace.py`).
"""

from __future__ import annotations

import heapq

from mla_tune.backends.triton_mla import dispatch
from mla_tune.backends.triton_mla.config import MAX_SPLITS, LaunchParams, Tile, packed_rows
from mla_tune.backends.triton_mla.dispatch import default_tile


def cdiv(a: int, b: int) -> int:
    """Ceiling division of ints; `triton.cdiv` costs about 100x more, and `balanced_splits` loops over lengths."""
    return -(-a // b)

def choose_splits(*, batch: int, m_blocks: int, max_items: int, num_sms: int,
                  min_split_tokens: int = 256, waves: int = 2) -> int:
    """Flash-decoding split count: about `waves` waves of programs, splits >= min_split_tokens."""
    programs = batch * m_blocks
    wanted = (waves * num_sms) // programs
    by_length = max(1, max_items // min_split_tokens)
    return int(max(1, min(wanted, by_length, MAX_SPLITS)))


def balanced_splits(*, lengths: list[int], m_blocks: int, num_sms: int, per_sm: int, block_n: int,
                    min_split_tokens: int, block_h: int = 64, model: str = "longest_first",
                    partial_row_tokens: float | None = None) -> tuple[int, int]:
    """(num_splits, split_items) that minimise the modelled makespan of a ragged batch.

    Splits have a fixed size `s` (a multiple of block_n), so long requests get more of them. With `model`
    "longest_first" the programs run longest first (`launch_order`) on `num_sms x per_sm` slots, each taken by the
    next program as it frees (`_longest_first_makespan`), and with more than one split a packed row's partial costs
    `partial_row_tokens` (PARTIAL_ROW_KV_TOKENS) twice: its program writes it, on its own slot, and the combine
    reads it, spread over all slots. With "waves" the programs run in waves that last as long as their longest
    program (`waves x s`) and each partial row adds `partial_row_tokens` (PARTIAL_ROW_TOKENS) to the whole. Ties go
    to the larger `s` (fewer partials to combine).
    """
    batch, max_len = len(lengths), max(max(lengths), 1)
    cap = max(1, min(MAX_SPLITS, (batch + 4 * num_sms) // batch))
    slots = num_sms * per_sm
    longest_first = model == "longest_first"
    if partial_row_tokens is None:
        partial_row_tokens = dispatch.PARTIAL_ROW_KV_TOKENS if longest_first else dispatch.PARTIAL_ROW_TOKENS
    lo = cdiv(max(min_split_tokens, block_n), block_n) * block_n
    hi = cdiv(max_len, block_n) * block_n
    best_cost, best_s = None, cdiv(cdiv(max_len, cap), block_n) * block_n
    for s in _split_sizes(lo, max(hi, lo), block_n, fewer=longest_first):
        if cdiv(max_len, s) > cap:
            continue
        programs = m_blocks * sum(max(1, cdiv(n, s)) for n in lengths)
        partial = partial_row_tokens * block_h if cdiv(max_len, s) > 1 else 0.0
        if longest_first:
            cost = _longest_first_makespan(lengths, s, m_blocks=m_blocks, slots=slots,
                                           overhead=dispatch.PROGRAM_TOKENS + partial) + partial * programs / slots
        else:
            cost = cdiv(programs, slots) * s + partial * programs
        if best_cost is None or cost <= best_cost:
            best_cost, best_s = cost, s
    best_s = max(best_s, cdiv(cdiv(max_len, cap), block_n) * block_n)
    return cdiv(max_len, best_s), best_s


def _split_sizes(lo: int, hi: int, block_n: int, *, fewer: bool) -> range | list[int]:
    """The split sizes the model weighs, multiples of block_n from lo to hi: with `fewer` (each costs a simulated
    launch) every one up to 64 of them, else about 64 spread evenly in log scale (the makespan changes by few percent
    between neighbours); otherwise every one, or up to about 256 evenly spaced."""
    if not fewer:
        return range(lo, hi + 1, block_n * max(1, (hi // block_n) // 256))
    if (hi - lo) // block_n < 64:
        return range(lo, hi + 1, block_n)
    ratio = (hi / lo) ** (1 / 63)
    return sorted({min(hi, cdiv(int(lo * ratio ** i), block_n) * block_n) for i in range(64)} | {hi})


def _longest_first_makespan(lengths: list[int], s: int, *, m_blocks: int, slots: int,
                            overhead: float | None = None) -> float:
    """Tokens the busiest slot streams when every program costs its tokens plus `overhead` (PROGRAM_TOKENS by
    default) and the programs start longest first, each on the first free slot: the full splits spread evenly, then
    the rest (largest first) on the least loaded slot."""
    overhead = dispatch.PROGRAM_TOKENS if overhead is None else overhead
    full = m_blocks * sum(n // s for n in lengths)
    rows, extra = divmod(full, slots)
    loads = [(rows + 1) * (s + overhead)] * extra + [rows * (s + overhead)] * (slots - extra)
    heapq.heapify(loads)
    for rest in sorted((n % s for n in lengths if n % s or n == 0), reverse=True):
        for _ in range(m_blocks):
            heapq.heapreplace(loads, loads[0] + rest + overhead)
    return max(loads)


def launch_order(lengths: list[int], *, split_items: int) -> list[int]:
    """The programs of a `longest_first` launch: each split of `split_items` that holds tokens (and split 0 of an
    empty request, which stores its zeros) as `split << 16 | request`, the longest first (ties: split, request), so
    the short last splits fill the SMs that free up last. Splits past a request's end are not launched at all: the
    combine takes each request's split count from its length."""
    num_splits = max(1, cdiv(max(lengths), split_items))
    if len(lengths) >= 1 << 16 or num_splits >= 1 << 15:
        raise ValueError(f"launch_order packs requests in 16 bits and splits in 15: {len(lengths)} requests, "
                         f"{num_splits} splits")
    pieces = [(min(split_items, n - j * split_items), j, b)
              for b, n in enumerate(lengths) for j in range(max(1, cdiv(n, split_items)))]
    pieces.sort(key=lambda piece: (-piece[0], piece[1], piece[2]))
    return [j << 16 | b for _, j, b in pieces]


def m_blocks_of(params: LaunchParams | Tile, *, num_heads: int, q_len: int, sparse: bool) -> int:
    """Programs along the query axis of one request (grid dimension 0)."""
    rows = packed_rows(num_heads, q_len, sparse=sparse)
    return cdiv(rows, params.block_h) * (q_len if sparse else 1)


def params_from_tile(tile: Tile, *, num_heads: int, q_len: int, batch: int, max_items: int, num_sms: int,
                     sparse: bool = False, lengths: list[int] | None = None,
                     partial_row_tokens: float | None = None) -> LaunchParams:
    """Launch parameters for `tile`, the splits chosen for this shape.

    With `lengths` (the per-request lengths, known in `prepare`) splits follow `balanced_splits`; without them
    (no host sync allowed) the split count comes from `choose_splits` over `max_items`, the block table's capacity
    (top-k for sparse), and a dense request's splits are sized on the device from its length (`split_per_request`,
    none shorter than the tile's `min_split_tokens`).
    """
    fixed = tile.launch_fields()
    m_blocks = m_blocks_of(tile, num_heads=num_heads, q_len=q_len, sparse=sparse)
    if lengths is not None:
        splits, split_items = balanced_splits(lengths=lengths, m_blocks=m_blocks, num_sms=num_sms,
                                              per_sm=tile.per_sm, block_n=tile.block_n,
                                              min_split_tokens=tile.min_split_tokens, block_h=tile.block_h,
                                              model=dispatch.SPLIT_MODEL["sparse" if sparse else "dense"],
                                              partial_row_tokens=partial_row_tokens)
        # a grid that fits the slots at once starts every program at once, whatever their order
        ordered = (not sparse and dispatch.LAUNCH_ORDER == "longest_first"
                   and m_blocks * batch * splits > num_sms * tile.per_sm)
        return LaunchParams(num_splits=splits, split_items=split_items, longest_first=ordered, **fixed)
    splits = choose_splits(batch=batch, m_blocks=m_blocks, max_items=max_items, num_sms=num_sms,
                           min_split_tokens=tile.min_split_tokens, waves=min(tile.per_sm, 4))
    if sparse or splits == 1:  # top-k slots are every sparse request's length; one split covers any length
        return LaunchParams(num_splits=splits, **fixed)
    shortest = cdiv(max(tile.min_split_tokens, tile.block_n), tile.block_n) * tile.block_n
    return LaunchParams(num_splits=splits, split_items=shortest, split_per_request=True, **fixed)


def params_for(tile: Tile | None, *, num_heads: int, q_len: int, batch: int, max_items: int, num_sms: int,
               sparse: bool = False, kv_fp8: bool = False, lengths: list[int] | None = None,
               cc_major: int | None = None, ds_mla: bool = False, fp8_query: bool = False) -> LaunchParams:
    """`tile` (None: `dispatch.default_tile`) with its splits for this shape (`lengths`: the per-request lengths
    (dense) or top-k per request (sparse), when known; `ds_mla`: the cache is vLLM's fp8_ds_mla rows; `fp8_query`:
    the FP8-query backend's tile)."""
    if tile is None:
        tile = default_tile(num_heads=num_heads, q_len=q_len, batch=batch, max_items=max_items, sparse=sparse,
                            kv_fp8=kv_fp8, cc_major=cc_major, ds_mla=ds_mla, fp8_query=fp8_query)
    return params_from_tile(tile, num_heads=num_heads, q_len=q_len, batch=batch, max_items=max_items,
                            num_sms=num_sms, sparse=sparse, lengths=lengths)


def default_params(*, num_heads: int, q_len: int, batch: int, max_items: int, num_sms: int,
                   sparse: bool = False, kv_fp8: bool = False, lengths: list[int] | None = None,
                   cc_major: int | None = None, ds_mla: bool = False) -> LaunchParams:
    """The heuristic's launch: `default_tile` with its splits."""
    return params_for(None, num_heads=num_heads, q_len=q_len, batch=batch, max_items=max_items, num_sms=num_sms,
                      sparse=sparse, kv_fp8=kv_fp8, lengths=lengths, cc_major=cc_major, ds_mla=ds_mla)
