"""Our vLLM backends' launch (`mla_tune.vllm_backends.launch`) against vLLM 0.33's FlashMLA, side by side.

Both sides get vLLM's layouts: a `[num_blocks, 64, 576]` cache (bf16, or e4m3 with a per-tensor `k_scale`), a
randomly permuted block table as wide as vLLM's (max_model_len / 64 columns), int32 sequence lengths; sparse
tokens get 2048 top-k positions turned into global cache rows as vLLM's index conversion does. Our side runs
the exact functions our `forward_mqa` / `_forward_mqa_kernel` call; FlashMLA is called as vLLM's
`FlashMLAImpl.forward_mqa` and `FlashMLASparseImpl` call it (dense bf16 `flash_mla_with_kvcache`, dense FP8
`fwd_kvcache_mla_fp8` with an e4m3 query and descales, sparse bf16 `flash_mla_sparse_fwd` with heads padded to a
multiple of 64; sparse FP8 on vLLM's fp8_ds_mla cache, 656 bytes a token with per-token group scales, through
FlashMLA's sparse decode kernel with heads padded to 64 or 128, below 32 heads as one sequence of tokens). The
query arrives concatenated (vLLM's concat, and its FP8 query quantization, happen before forward_mqa on both
sides). Sparse FP8 times ours on the same fp8_ds_mla cache (`ours`) and on the e4m3 cache with `k_scale` that vLLM
hands our backend for `--kv-cache-dtype fp8` (`ours576`, the same values quantised per tensor).

Every output is checked against the float32 reference before anything is timed; times are CUDA-graph replays over
L2-rotated input copies, interleaved (`mla_tune.tuner.timing`). One line per case: the medians, the ratios
(FlashMLA / ours: above 1, ours is faster) and the errors. Dense cases time ours twice: `ours` with vLLM's
max_seq_len the batch's longest request (an eager step), `ours_cg` with max_seq_len = max_model_len, as vLLM
captures its full CUDA graphs. Both size each request's splits on the device from its length; what the block
table's capacity still decides is fixed at capture: the tile (short requests take the tl kernel) and the split
count's bound. `--spread wide` draws the other requests' lengths from 1..kv_len instead of the top eighth.

vLLM cannot be installed on the lent GPU (torch 2.11); its Python files and FlashMLA extensions can be loaded
(REFERENCE.md section 6):

    ../shared/tools/vllm-kernels   # .vllm/*.tar.xz, every vllm/*.py (importing vllm needs more than third_party/)
    mkdir -p .vsite && tar -xJf .vllm/vllm-0.33.0-kernels.tar.xz -C .vsite
    PYTHONPATH=$PWD/.vsite python3 bench/vllm_backends.py --grid quick --out $OUT/vllm_backends.txt
    PYTHONPATH=$PWD/.vsite python3 bench/vllm_backends.py --grid cg   # dense only, ours against ours_cg

Without CUDA it runs our side only, at toy sizes, in Triton's interpreter (TRITON_INTERPRET=1), as a check.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from dataclasses import dataclass

import torch

BLOCK = 64                 # FlashMLA's page size; vLLM's default MLA block size on Hopper
MAX_MODEL_LEN = 163840     # DeepSeek-V3's: the width of vLLM's block table
TOPK = 2048
GRIDS = {
    # (kind, heads, batch, kv_len)
    "quick": [(k, h, b, n) for k in ("dense-bf16", "dense-fp8") for h in (16, 128) for b in (1, 16, 128)
              for n in (1024, 8192, 32768)]
             + [(k, h, b, 32768) for k in ("sparse-bf16", "sparse-fp8") for h in (16, 32, 64, 128)
                for b in (1, 16, 128)],
    "full": [(k, h, b, n) for k in ("dense-bf16", "dense-fp8") for h in (16, 32, 64, 128) for b in (1, 4, 16, 64, 128)
             for n in (1024, 4096, 16384, 32768)]
            + [(k, h, b, 32768) for k in ("sparse-bf16", "sparse-fp8") for h in (16, 32, 64, 128)
               for b in (1, 4, 16, 64, 128)],
    # ours against ours_cg below batch 128 (from 128 both take one split), dense only
    "cg": [(k, h, b, n) for k in ("dense-bf16", "dense-fp8") for h in (16, 128) for b in (1, 16, 64)
           for n in (1024, 8192)],
    "cpu": [("dense-bf16", 5, 3, 100), ("dense-fp8", 3, 2, 130), ("sparse-bf16", 3, 2, 300),
            ("sparse-fp8", 19, 2, 300)],
}
TOLERANCE = {"bf16": 2e-2, "fp8": 1e-1}   # max abs error over the reference's largest |value| (at least 1)


@dataclass
class Case:
    kind: str
    heads: int
    batch: int
    kv_len: int

    @property
    def sparse(self) -> bool:
        return self.kind.startswith("sparse")

    @property
    def fp8(self) -> bool:
        return self.kind.endswith("fp8")

    def label(self) -> str:
        return f"{self.kind:<11} h{self.heads:<3} b{self.batch:<3} kv{self.kv_len:<6}"


def make_inputs(case: Case, device, seed: int = 0, *, spread: str = "eighth") -> dict:
    """vLLM-layout inputs: cache, permuted block table, lengths, query, and for sparse the top-k rows."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    topk = min(TOPK, case.kv_len) if case.sparse else 0
    # Ragged lengths: one request at kv_len, the others up to 1/8 shorter, or (wide) 1..kv_len tokens (a sparse one
    # keeps >= top-k tokens).
    most = case.kv_len if spread == "wide" else max(2, case.kv_len // 8)
    shorter = torch.randint(1, most, (case.batch,), generator=g).tolist()
    lengths = [case.kv_len] + [max(topk, case.kv_len - cut) for cut in shorter[1:]]
    needed = [-(-n // BLOCK) for n in lengths]
    num_blocks = sum(needed) + 4
    order = torch.randperm(num_blocks, generator=g).to(torch.int32)
    table = torch.zeros(case.batch, MAX_MODEL_LEN // BLOCK, dtype=torch.int32)
    start = 0
    for row, count in enumerate(needed):
        table[row, :count] = order[start:start + count]
        start += count
    kv = torch.randn(num_blocks, BLOCK, 576, generator=g) * (2.0 if case.fp8 else 1.0)
    q = torch.randn(case.batch, case.heads, 576, generator=g).to(torch.bfloat16)
    out = {"q": q.to(device), "block_table": table.to(device), "lengths": lengths,
           "seq_lens": torch.tensor(lengths, dtype=torch.int32, device=device), "k_scale": None}
    if case.sparse and case.fp8:  # vLLM's fp8_ds_mla rows (per-token group scales), and the e4m3 cache of ours576
        from mla_tune.backends.vllm_kernels.flashmla import quantize_fp8_ds_mla

        kv[..., :512] *= torch.exp(torch.randn(num_blocks, BLOCK, 1, generator=g) * 0.5)
        out["kv"] = quantize_fp8_ds_mla(kv).to(device)
        out["k_scale"] = torch.tensor([0.5], dtype=torch.float32, device=device)
        out["kv576"] = (kv / 0.5).to(torch.float8_e4m3fn).to(device)
    elif case.fp8:
        out["kv"] = kv.to(torch.float8_e4m3fn).to(device)
        out["k_scale"] = torch.tensor([0.5], dtype=torch.float32, device=device)   # vLLM's layer._k_scale
    else:
        out["kv"] = kv.to(torch.bfloat16).to(device)
    if case.sparse:
        logical = torch.stack([torch.randperm(n, generator=g)[:topk] for n in lengths]).to(torch.int32)
        blocks = table.long().gather(1, (logical // BLOCK).long())
        out["logical"] = logical.to(device)
        out["rows"] = (blocks * BLOCK + logical % BLOCK).to(torch.int32).to(device)
        out["valid"] = torch.full((case.batch,), topk, dtype=torch.int32, device=device)
    return out


def reference(case: Case, x: dict, scale: float, *, e4m3: bool = False) -> torch.Tensor:
    """The float32 reference on `x["kv"]` (sparse FP8: the fp8_ds_mla rows dequantised; with `e4m3`, on
    `x["kv576"]` with `k_scale`)."""
    from mla_tune.backends.reference import mla_reference
    from mla_tune.backends.vllm_kernels.flashmla import unpack_fp8_ds_mla

    k_scale = float(x["k_scale"]) if x["k_scale"] is not None else None
    topk = x["logical"].unsqueeze(1) if case.sparse else None
    kv = x["kv"]
    if e4m3:
        kv = x["kv576"]
    elif kv.dtype == torch.uint8:
        kv, k_scale = unpack_fp8_ds_mla(kv), None
    out, _ = mla_reference(x["q"], kv, x["block_table"], x["seq_lens"], sm_scale=scale, kv_scale=k_scale,
                           topk_indices=topk)
    return out


def ours(case: Case, x: dict, scale: float, *, max_seq_len: int | None = None, e4m3: bool = False):
    """A callable running our forward_mqa launch on `x` (no allocation beyond what forward_mqa allocates).

    `max_seq_len`: what vLLM's metadata says; None = the batch's longest request (an eager step). vLLM captures
    its full CUDA graphs with max_model_len: the captured launch keeps the tile and split count chosen for it, and
    sizes each request's splits from its length on the device.
    `e4m3` (sparse FP8): the e4m3 cache with `k_scale` instead of the fp8_ds_mla rows.
    """
    from mla_tune.vllm_backends.launch import IdentityPages, dense_forward, sparse_forward

    if case.sparse:
        identity = IdentityPages(case.batch)
        kv, k_scale = (x["kv576"], x["k_scale"]) if e4m3 else (x["kv"], None)
        return lambda: sparse_forward(x["q"], kv, x["rows"], block_size=BLOCK, scale=scale, identity=identity,
                                      k_scale=k_scale)[0]
    longest = max_seq_len or max(x["lengths"])
    return lambda: dense_forward(x["q"], x["kv"], x["block_table"], x["seq_lens"], max_seq_len=longest,
                                 scale=scale, k_scale=x["k_scale"])[0]


def flashmla(case: Case, x: dict, scale: float):
    """A callable running vLLM's FlashMLA the way vLLM's FlashMLA backends call it, or a reason it cannot."""
    try:
        from vllm.third_party.flashmla import flash_mla_interface as fmi
    except Exception as exc:  # noqa: BLE001 - reported, not fatal
        return f"vLLM's FlashMLA is not loadable here ({type(exc).__name__}: {exc})"
    q, kv, heads = x["q"], x["kv"], case.heads
    if case.kind == "dense-bf16":
        sched, _ = fmi.get_mla_metadata()
        return lambda: fmi.flash_mla_with_kvcache(
            q=q.unsqueeze(1), k_cache=kv.unsqueeze(-2), block_table=x["block_table"], cache_seqlens=x["seq_lens"],
            head_dim_v=512, tile_scheduler_metadata=sched, softmax_scale=scale, causal=True,
            is_fp8_kvcache=False)[0].squeeze(1)
    if case.kind == "dense-fp8":
        try:
            import vllm._flashmla_extension_C  # noqa: F401 - registers torch.ops._flashmla_extension_C
        except Exception as exc:  # noqa: BLE001
            return f"vLLM's dense FP8 FlashMLA is not loadable here ({type(exc).__name__}: {exc})"
        ext = torch.ops._flashmla_extension_C
        tile_md, splits = ext.get_mla_decoding_metadata_dense_fp8(x["seq_lens"], heads, 1)
        q_fp8 = q.unsqueeze(1).to(torch.float8_e4m3fn)     # vLLM's static query quantization, q_scale 1
        descale_q = torch.ones(1, dtype=torch.float32, device=q.device)
        return lambda: ext.fwd_kvcache_mla_fp8(q_fp8, kv.unsqueeze(-2), 512, x["seq_lens"], x["block_table"], scale,
                                               True, tile_md, splits, descale_q, x["k_scale"])[0].squeeze(1)
    if case.kind == "sparse-bf16":
        padded = -(-heads // 64) * 64                        # vLLM's prefill_padding for the bf16 kernel
        rows = kv.view(-1, 1, 576)
        indices = x["rows"].view(case.batch, 1, -1)

        def run():
            q_pad = q.new_empty(case.batch, padded, 576)   # vLLM allocates and copies per call
            q_pad[:, :heads] = q
            return fmi.flash_mla_sparse_fwd(q_pad, rows, indices, scale, topk_length=x["valid"])[0][:, :heads]
        return run
    if case.kind == "sparse-fp8":
        return _flashmla_sparse_fp8(fmi, case, x, scale)
    raise ValueError(f"no FlashMLA path for {case.kind}")


def _flashmla_sparse_fp8(fmi, case: Case, x: dict, scale: float):
    """FlashMLA's sparse FP8 decode on the fp8_ds_mla rows as vLLM's FlashMLASparseImpl calls it: heads padded to
    64 or 128 (a zero-padded copy per call), below 32 heads the batch as one sequence of tokens."""
    q, heads, batch = x["q"], case.heads, case.batch
    padded = 64 if heads <= 64 else 128
    lead = (1, batch) if heads < 32 else (batch, 1)
    indices = x["rows"].view(*lead, -1)
    cache_lens = torch.full((lead[0],), max(x["lengths"]), dtype=torch.int32, device=q.device)
    dummy_table = torch.zeros(lead[0], 1, dtype=torch.int32, device=q.device)
    sched, _ = fmi.get_mla_metadata()
    k_cache = x["kv"].view(-1, BLOCK, 1, x["kv"].shape[-1])

    def run():
        q_pad = q.new_zeros(*lead, padded, 576)
        q_pad[..., :heads, :] = q.view(*lead, heads, 576)
        out, _ = fmi.flash_mla_with_kvcache(q=q_pad, k_cache=k_cache, block_table=dummy_table, head_dim_v=512,
                                            cache_seqlens=cache_lens, tile_scheduler_metadata=sched,
                                            is_fp8_kvcache=True, indices=indices, softmax_scale=scale)
        return out[0, :, :heads] if lead[0] == 1 and batch > 1 else out[:, 0, :heads]
    return run


def rotation_sets(case: Case, x: dict) -> list[dict]:
    """`x` and copies of its query and cache, enough that one pass over them reads several times the L2."""
    from mla_tune.tuner.timing import l2_rotation_copies

    element = x["kv"].element_size()
    width = x["kv"].shape[-1]
    read = (case.batch * min(TOPK, case.kv_len) if case.sparse else sum(x["lengths"])) * width * element
    free, _ = torch.cuda.mem_get_info()
    per_copy = x["kv"].numel() * element + (x["kv576"].numel() if "kv576" in x else 0)
    copies = l2_rotation_copies(read, free_bytes=free // 2, bytes_per_copy=per_copy)
    extra = lambda: {"kv576": x["kv576"].clone()} if "kv576" in x else {}  # noqa: E731
    return [x] + [dict(x, q=x["q"].clone(), kv=x["kv"].clone(), **extra()) for _ in range(copies - 1)]


def run_case(case: Case, device, *, timed: bool, spread: str = "eighth") -> str:
    scale = 1.0 / math.sqrt(192)
    x = make_inputs(case, device, spread=spread)
    refs = {"ref": reference(case, x, scale)}
    factories = {"ours": lambda xi: ours(case, xi, scale),
                 "flashmla": (lambda xi: flashmla(case, xi, scale)) if device.type == "cuda"
                 else (lambda xi: "FlashMLA needs CUDA")}
    if not case.sparse:  # as vLLM's full CUDA graph replays it: max_seq_len = max_model_len at capture
        factories["ours_cg"] = lambda xi: ours(case, xi, scale, max_seq_len=MAX_MODEL_LEN)
    if "kv576" in x:  # what vLLM hands our backend for --kv-cache-dtype fp8, checked against its own reference
        factories["ours576"] = lambda xi: ours(case, xi, scale, e4m3=True)
        refs["ours576"] = reference(case, x, scale, e4m3=True)
    working, notes, errors = [], [], {}
    for name, factory in factories.items():
        step = factory(x)
        if isinstance(step, str):
            notes.append(step)
            continue
        ref = refs.get(name, refs["ref"])
        tol = TOLERANCE["fp8" if case.fp8 else "bf16"] * max(1.0, ref.abs().max().item())
        try:
            err = (step().float() - ref).abs().max().item()
        except Exception as exc:  # noqa: BLE001 - a failure is data
            notes.append(f"{name} failed: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}")
            continue
        errors[name] = err
        if not err <= tol:
            notes.append(f"{name} WRONG: max error {err:.3g} > {tol:.3g}")
            continue
        working.append(name)
    line = case.label()
    if timed and working:
        from mla_tune.tuner.timing import capture_graph, time_interleaved

        sets = rotation_sets(case, x)
        graphs = {}
        for name in working:
            per_set = [factories[name](xi) for xi in sets]
            graphs[name] = capture_graph(lambda per_set=per_set: [step() for step in per_set],
                                         iterations_per_replay=len(sets))
        timings = time_interleaved(graphs, rel_ci_target=0.01, max_seconds=3.0)
        for name in ("ours", "ours_cg", "ours576", "flashmla"):
            if name in timings:
                line += f"  {name} {timings[name].median_ms * 1e3:8.1f} us"
        if "ours" in timings and "ours576" in timings:
            line += f"  ours/ours576 {timings['ours'].median_ms / timings['ours576'].median_ms:5.2f}"
        for name in ("ours", "ours_cg"):
            if name in timings and "flashmla" in timings:
                line += f"  flashmla/{name} {timings['flashmla'].median_ms / timings[name].median_ms:5.2f}"
        line += f"  sets {len(sets)}"
    line += "  err " + " ".join(f"{name} {err:.2g}" for name, err in errors.items())
    return line + ("  | " + "; ".join(notes) if notes else "")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--grid", choices=sorted(GRIDS), default=None, help="default: quick on CUDA, cpu otherwise")
    ap.add_argument("--kinds", default="",
                    help="comma-separated subset of dense-bf16,dense-fp8,sparse-bf16,sparse-fp8")
    ap.add_argument("--spread", choices=("eighth", "wide"), default="eighth",
                    help="the other requests' lengths: up to 1/8 shorter than kv_len (default) or 1..kv_len")
    ap.add_argument("--out", default=None, help="also write the lines to this file")
    args = ap.parse_args(argv)
    cuda = torch.cuda.is_available()
    if not cuda:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    device = torch.device("cuda" if cuda else "cpu")
    grid = GRIDS[args.grid or ("quick" if cuda else "cpu")]
    kinds = set(filter(None, args.kinds.split(",")))
    lines = []
    if cuda:
        import triton

        lines.append(f"# {torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__}, "
                     f"lengths spread {args.spread}")
    for kind, heads, batch, kv_len in grid:
        if kinds and kind not in kinds:
            continue
        started = time.perf_counter()
        line = run_case(Case(kind, heads, batch, kv_len), device, timed=cuda, spread=args.spread)
        lines.append(f"{line}  ({time.perf_counter() - started:.0f} s)")
        print(lines[-1], flush=True)
        if args.out:  # rewritten after every case, so a run cut short keeps what it measured
            with open(args.out, "w") as fh:
                fh.write("\n".join(lines) + "\n")
    return 1 if any("WRONG" in line or "failed" in line for line in lines) else 0


if __name__ == "__main__":
    sys.exit(main())
