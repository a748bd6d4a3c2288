"""The one place that builds decode inputs for tests, the benchmark and the tuner.

Inputs are never zeros and never a tidy layout: q and the KV cache are
random, every request's pages are scattered over a randomly permuted page
pool (pages of different requests interleave, and unused pages sit between
them), lengths are ragged and, apart from the longest, not multiples of the
page size. FP8 KV is stored as `float8_e4m3fn` with one per-tensor scale
(real value = stored value x `kv_scale`). Sparse problems get top-k token
positions: distinct, inside what each query position may see, padded with -1
when a request is shorter than top-k.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from mla_tune.backends.interface import DecodeInputs
from mla_tune.backends.problem import Problem, Shape

if TYPE_CHECKING:
    import torch

# Stored FP8 values are drawn with this standard deviation (|x| <= 448 in e4m3),
# and KV_FP8_SCALE brings them back to unit scale. Not a power of two, so a
# kernel that ignores the scale is off by a factor no rounding can hide.
_FP8_STORED_STD = 48.0
FP8_KV_SCALE = 1.0 / 48.5


def _torch_dtype(name: str) -> "torch.dtype":
    import torch

    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp8_e4m3": torch.float8_e4m3fn}[name]


def ragged_lengths(shape: Shape, *, page_size: int, min_len: int = 1, seed: int = 0,
                   ragged: bool = True) -> list[int]:
    """Per-request KV lengths: the first is `shape.kv_len`, the others ragged.

    Args:
        shape: batch size and the longest length.
        page_size: tokens per page; ragged lengths avoid its multiples.
        min_len: the shortest allowed length (q_len: the new tokens are in the cache).
        seed: random seed.
        ragged: False gives every request `shape.kv_len`.

    Returns:
        `batch_size` lengths in `[max(min_len, kv_len // 4), kv_len]`.
    """
    import random

    kv_len = shape.kv_len
    if not ragged:
        return [kv_len] * shape.batch_size
    rng = random.Random(seed)
    low = max(min_len, kv_len // 4, 1)
    lengths = [kv_len]
    for _ in range(shape.batch_size - 1):
        n = rng.randint(low, kv_len)
        if n % page_size == 0 and n - 1 >= low:
            n -= 1
        lengths.append(n)
    return lengths


def scattered_block_table(lengths: list[int], *, page_size: int, seed: int = 0,
                          spare_fraction: float = 0.125) -> tuple[list[list[int]], int]:
    """Assign each request's pages from a randomly permuted pool with spare pages.

    Args:
        lengths: tokens per request.
        page_size: tokens per page.
        seed: random seed.
        spare_fraction: unused pages added to the pool, as a fraction of the used ones.

    Returns:
        `(block_table, num_pages)`: rows padded with 0 to the longest request's
        page count (padding is never read), and the pool size.
    """
    import random

    rng = random.Random(seed + 1)
    needed = [math.ceil(n / page_size) for n in lengths]
    used = sum(needed)
    num_pages = used + max(1, int(used * spare_fraction))
    pool = list(range(num_pages))
    rng.shuffle(pool)
    max_pages = max(needed)
    table, start = [], 0
    for count in needed:
        row = pool[start:start + count]
        start += count
        table.append(row + [0] * (max_pages - count))
    return table, num_pages


def random_topk_indices(lengths: "torch.Tensor", *, q_len: int, topk: int,
                        generator: "torch.Generator") -> "torch.Tensor":
    """Distinct random token positions each query position may see, -1 padded.

    Query position i of a request of length L sees positions `[0, L - q_len + 1 + i)`.

    Args:
        lengths: int `[batch]` on the CPU.
        q_len: query tokens per request.
        topk: slots per query position.
        generator: a CPU torch generator.

    Returns:
        int32 `[batch, q_len, topk]` on the CPU; valid entries first, then -1.
    """
    import torch

    batch = lengths.shape[0]
    width = max(int(lengths.max()), topk)
    scores = torch.rand(batch, q_len, width, generator=generator)
    pos = torch.arange(width)
    visible = lengths.view(batch, 1, 1) - q_len + 1 + torch.arange(q_len).view(1, q_len, 1)
    scores = torch.where(pos.view(1, 1, width) < visible, scores, torch.full_like(scores, 2.0))
    chosen_scores, chosen = torch.topk(scores, topk, dim=-1, largest=False, sorted=True)
    return torch.where(chosen_scores < 2.0, chosen, torch.full_like(chosen, -1)).to(torch.int32)


def make_inputs(problem: Problem, shape: Shape, *, device="cpu", seed: int = 0,
                ragged: bool = True) -> DecodeInputs:
    """Random decode inputs for `problem` at `shape` (layouts in `backends/interface.py`).

    Args:
        problem: heads, dtypes, page size, top-k and q_len.
        shape: batch size and the longest KV length (`kv_len`).
        device: where the tensors live (`"cpu"`, `"cuda"`, a torch.device).
        seed: random seed; the same seed gives the same metadata on every device.
        ragged: False gives every request `kv_len` tokens.

    Returns:
        q `[batch, q_len, heads, D]` ~ N(0, 1) in the query dtype; kv_cache
        `[num_pages, page_size, D]` ~ N(0, 1) (FP8: stored ~ N(0, 48^2),
        `kv_scale` = 1/48.5); int32 block table, seq_lens and, when sparse,
        top-k indices `[batch, q_len, topk]`.
    """
    import torch

    if shape.kv_len < problem.q_len:
        raise ValueError(f"kv_len {shape.kv_len} is shorter than q_len {problem.q_len}")
    geo = problem.geometry
    lengths = ragged_lengths(shape, page_size=problem.page_size, min_len=problem.q_len,
                             seed=seed, ragged=ragged)
    table, num_pages = scattered_block_table(lengths, page_size=problem.page_size, seed=seed)
    cpu_gen = torch.Generator().manual_seed(seed)
    seq_lens = torch.tensor(lengths, dtype=torch.int32)
    topk_indices = None
    if problem.sparse:
        topk_indices = random_topk_indices(seq_lens, q_len=problem.q_len, topk=problem.topk,
                                           generator=cpu_gen).to(device)
    device = torch.device(device)
    gen = torch.Generator(device=device).manual_seed(seed + 2)
    q_dtype = _torch_dtype(problem.query_dtype)
    q = torch.randn(shape.batch_size, problem.q_len, problem.num_heads, geo.head_size,
                    generator=gen, device=device, dtype=q_dtype)
    kv_shape = (num_pages, problem.page_size, geo.head_size)
    kv_scale = None
    # fp8_ds_mla: this e4m3 cache too; the backends that read vLLM's 656-byte rows convert it untimed (`adopt`)
    if problem.kv_cache_dtype in ("fp8_e4m3", "fp8_ds_mla"):
        stored = torch.randn(kv_shape, generator=gen, device=device, dtype=torch.bfloat16)
        stored.mul_(_FP8_STORED_STD).clamp_(-448.0, 448.0)
        kv_cache = stored.to(torch.float8_e4m3fn)
        del stored
        kv_scale = FP8_KV_SCALE
    elif problem.kv_cache_dtype in ("bf16", "fp16"):
        kv_cache = torch.randn(kv_shape, generator=gen, device=device,
                               dtype=_torch_dtype(problem.kv_cache_dtype))
    else:
        raise ValueError(f"make_inputs cannot build kv_cache_dtype {problem.kv_cache_dtype!r}; "
                         "supported: bf16, fp16, fp8_e4m3, fp8_ds_mla")
    return DecodeInputs(
        q=q, kv_cache=kv_cache,
        block_table=torch.tensor(table, dtype=torch.int32, device=device),
        seq_lens=seq_lens.to(device), sm_scale=geo.sm_scale, kv_scale=kv_scale,
        topk_indices=topk_indices)


def clone_data(inputs: DecodeInputs, copies: int) -> list[DecodeInputs]:
    """`copies` input sets: the original first, then fresh copies of q and the KV cache.

    Metadata (block table, lengths, top-k) is shared, so a backend prepared on
    the original runs on any of them; rotating through the copies keeps L2 cold.
    """
    if copies < 1:
        raise ValueError(f"copies must be at least 1, got {copies}")
    sets = [inputs]
    for _ in range(copies - 1):
        sets.append(inputs.with_data(inputs.q.clone(), inputs.kv_cache.clone()))
    return sets


def input_set_bytes(inputs: DecodeInputs) -> int:
    """Bytes of one input set's q and KV cache (what each L2-rotation copy costs)."""
    return sum(t.numel() * t.element_size() for t in (inputs.q, inputs.kv_cache))


def bytes_touched(inputs: DecodeInputs) -> int:
    """Bytes of q and of distinct KV rows one decode step reads: what an L2 rotation has to add up.

    Dense: every token of every request. Sparse: the distinct rows a request's valid top-k slots name (its MTP
    positions share rows), not the whole cache a set allocates.
    """
    import torch

    q_bytes = inputs.q.numel() * inputs.q.element_size()
    row_bytes = inputs.kv_cache.shape[-1] * inputs.kv_cache.element_size()
    idx = inputs.topk_indices
    if idx is None:
        return q_bytes + int(inputs.seq_lens.sum()) * row_bytes
    request = torch.arange(idx.shape[0], device=idx.device, dtype=torch.int64).view(-1, 1, 1).expand_as(idx)
    valid = idx >= 0
    keys = request[valid] * (int(idx.max()) + 1) + idx[valid].long()
    return q_bytes + int(torch.unique(keys).numel()) * row_bytes


def kv_bytes_read(inputs: DecodeInputs) -> int:
    """Bytes of KV a decode step must read at least once (roofline numerator).

    Dense: every token of every request; sparse: the valid top-k slots, counted
    per query position (exact for q_len 1, an overcount when MTP positions share tokens).
    """
    row_bytes = inputs.kv_cache.shape[-1] * inputs.kv_cache.element_size()
    if inputs.topk_indices is not None:
        return int((inputs.topk_indices >= 0).sum()) * row_bytes
    return int(inputs.seq_lens.sum()) * row_bytes
