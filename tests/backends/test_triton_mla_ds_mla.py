"""The sparse kernel on vLLM's fp8_ds_mla cache (656 bytes a token: 512 e4m3 values, 4 float32 group scales, 64 bf16
RoPE values), read in place, against the float32 reference on the dequantised rows.

Every case has per-token group scales spread over e^-2..e^2, permuted page tables, blocks spaced further apart
than their rows (the gap filled with bytes that decode to NaN, so a misaddressed row shows), lengths that are not
multiples of the page size, top-k lists with -1 entries and a query token whose list is all -1. CPU: under the
Triton interpreter in one subprocess (small shapes); GPU (marker `gpu`): the same at real sizes, through
`mla_decode` and through the vLLM launch (`sparse_forward`, global rows).
"""

from __future__ import annotations

import json
import math
import sys

import pytest
from interpreted import interpreted_worker

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from mla_tune.backends.reference import mla_reference  # noqa: E402
from mla_tune.backends.vllm_kernels.flashmla import DS_MLA_BYTES, quantize_fp8_ds_mla, unpack_fp8_ds_mla  # noqa: E402

REL_TOL, LSE_TOL = 2e-2, 1e-2


def make_case(*, heads: int, batch: int, topk: int, page_size: int, lengths: list[int], gap_rows: int, seed: int,
              device) -> dict:
    """Random inputs of one case: `pages` is the fp8_ds_mla cache `[num_pages, page_size, 656]` with its blocks
    `page_size + gap_rows` rows apart; `rows` the global rows of each top-k entry (vLLM's form, -1 for none)."""
    gen = torch.Generator().manual_seed(seed)
    per_request = [max(1, -(-n // page_size)) for n in lengths]
    num_pages = sum(per_request) + 3
    values = torch.randn(num_pages, page_size, 576, generator=gen)
    # per-token, per-group magnitudes: the four scales of a row differ, and so do a tile's tokens'
    spread = torch.exp(torch.randn(num_pages, page_size, 4, 1, generator=gen) * 0.7)
    values[..., :512] = (values[..., :512].unflatten(-1, (4, 128)) * spread).flatten(-2)
    block = torch.full((num_pages, page_size + gap_rows, DS_MLA_BYTES), 0xFF, dtype=torch.uint8)  # 0xFF: e4m3 NaN
    pages = block[:, :page_size]
    quantize_fp8_ds_mla(values, out=pages)
    order = torch.randperm(num_pages, generator=gen).to(torch.int32)
    table = torch.zeros(batch, max(per_request), dtype=torch.int32)
    first = 0
    for b, n in enumerate(per_request):
        table[b, :n] = order[first:first + n]
        first += n
    topk_pos = torch.full((batch, 1, topk), -1, dtype=torch.int32)
    for b, n in enumerate(lengths):
        if b == batch - 1 or n == 0:
            continue  # the last request's list is all -1: out 0, lse -inf
        picked = torch.randperm(n, generator=gen)[:topk].to(torch.int32)
        keep = torch.rand(picked.shape[0], generator=gen) > 0.15  # some -1 between valid entries
        topk_pos[b, 0, :picked.shape[0]] = torch.where(keep, picked, -1)
    q = (torch.randn(batch, 1, heads, 576, generator=gen) * 0.5).to(torch.bfloat16)
    stride_rows = page_size + gap_rows
    pos = topk_pos[:, 0].clamp(min=0).long()
    page = torch.gather(table.long(), 1, pos // page_size)
    rows = torch.where(topk_pos[:, 0] >= 0, page * stride_rows + pos % page_size, -1).to(torch.int32)
    to = dict(device=device)
    # Copy the whole block, gaps included: `.to()` of the strided view alone would make it contiguous.
    pages = block.to(**to)[:, :page_size]
    assert pages.stride(0) == stride_rows * DS_MLA_BYTES
    return dict(q=q.to(**to), pages=pages, table=table.to(**to),
                seq_lens=torch.tensor(lengths, dtype=torch.int32, **to), topk=topk_pos.to(**to), rows=rows.to(**to),
                sm_scale=1.0 / math.sqrt(192), page_size=page_size)


def reference(case: dict) -> tuple:
    return mla_reference(case["q"], unpack_fp8_ds_mla(case["pages"]), case["table"], case["seq_lens"],
                         sm_scale=case["sm_scale"], topk_indices=case["topk"])


def errors(out, lse, ref_out, ref_lse) -> dict:
    out, lse = out.float().reshape(ref_out.shape), lse.reshape(ref_lse.shape)
    seen = torch.isfinite(ref_lse)
    return {"rel_err": float((out[seen] - ref_out[seen]).norm() / ref_out[seen].norm().clamp_min(1e-30)),
            "lse_err": float((lse[seen] - ref_lse[seen]).abs().max()),
            "nan": bool(out.isnan().any() or lse.isnan().any()),
            "unseen_rows_ok": bool((out[~seen] == 0).all() and (lse[~seen] == -math.inf).all()),
            "some_unseen": bool((~seen).any())}


def run_decode(case: dict, params: dict | None, *, dense: bool = False) -> dict:
    """`mla_decode` on the paged fp8_ds_mla cache (`params` None: the dispatched tile); `dense`: every key of each
    request instead of its top-k."""
    from mla_tune.backends.triton_mla import LaunchParams, mla_decode

    topk = None if dense else case["topk"]
    out, lse = mla_decode(case["q"], case["pages"], case["table"], case["seq_lens"], sm_scale=case["sm_scale"],
                          topk_indices=topk, params=LaunchParams(**params) if params else None)
    ref = mla_reference(case["q"], unpack_fp8_ds_mla(case["pages"]), case["table"], case["seq_lens"],
                        sm_scale=case["sm_scale"], topk_indices=topk)
    return errors(out, lse, *ref)


def run_vllm(case: dict) -> dict:
    """The vLLM backend's launch (`sparse_forward`): global rows over the spaced blocks, the cache as vLLM holds it."""
    from mla_tune.vllm_backends.launch import IdentityPages, sparse_forward

    q = case["q"][:, 0]
    out, lse = sparse_forward(q, case["pages"], case["rows"], block_size=case["page_size"], scale=case["sm_scale"],
                              identity=IdentityPages(q.shape[0]))
    return errors(out, lse, *reference(case))


_TL = dict(num_warps=4, num_stages=1, split_d=True)
# name -> (make_case keywords, LaunchParams keywords, None for the dispatched tile, or "vllm" for sparse_forward)
CPU_CASES = {
    "h19_dispatched": (dict(heads=19, batch=3, topk=40, page_size=16, lengths=[37, 67, 20], gap_rows=5), None),
    "h19_block32_splits_bf16_products": (dict(heads=19, batch=2, topk=48, page_size=16, lengths=[90, 33],
                                              gap_rows=16),
                                         dict(block_h=32, block_n=16, num_splits=3, **_TL)),
    "h5_hoisted_fp16_products": (dict(heads=5, batch=3, topk=40, page_size=32, lengths=[45, 100, 7], gap_rows=32),
                                 dict(block_h=16, block_n=16, num_splits=2, hoist_pages=16, reload_v=True,
                                      fp16_math=True, **_TL)),
    "h19_vllm_global_rows": (dict(heads=19, batch=3, topk=40, page_size=16, lengths=[37, 67, 20], gap_rows=5),
                             "vllm"),
}


def _run(spec, params, *, device, seed) -> dict:
    case = make_case(**spec, seed=seed, device=device)
    return run_vllm(case) if params == "vllm" else run_decode(case, params)


def run_adapter(heads: int, batch: int, kv_len: int, topk: int, *, device) -> dict:
    """The tuner's path: an fp8_ds_mla problem's e4m3 inputs, packed by `adopt` on every rotated copy (untimed),
    against the reference on the e4m3 cache (the packing is exact up to the bf16 RoPE)."""
    from mla_tune.backends.inputs import make_inputs
    from mla_tune.backends.interface import adopt_rotation
    from mla_tune.backends.problem import Problem, Shape
    from mla_tune.backends.triton_mla.adapter import TritonMLASparse

    problem = Problem(num_heads=heads, kv_cache_dtype="fp8_ds_mla", page_size=64, topk=topk)
    inputs = make_inputs(problem, Shape(batch, kv_len), device=device, seed=5)
    rotated = inputs.with_data(inputs.q.clone(), inputs.kv_cache.clone())
    prepared = TritonMLASparse().prepare(problem, inputs)
    adopt_rotation(prepared, [inputs, rotated])
    ref = mla_reference(inputs.q, inputs.kv_cache, inputs.block_table, inputs.seq_lens, sm_scale=inputs.sm_scale,
                        kv_scale=inputs.kv_scale, topk_indices=inputs.topk_indices)
    result = errors(*prepared.run(rotated), *ref)
    result.update(tl=not prepared.params.warp_specialized, packed=len(prepared.copies), some_unseen=True)
    return result


def run_tuner() -> dict:
    """The tuner's measurement of an fp8_ds_mla key on CPU: every candidate tile run once (made-up times, the real
    kernel on the rotated, adopted copies) and gated against the float32 reference."""
    from mla_tune.backends.problem import Problem, Shape
    from mla_tune.tuner.measure import ShapeTask, measure_shape
    from mla_tune.tuner.timing import Timing

    def real_runs(steps, **_):
        return {name: (step(), Timing(1.0, 1.0, 1.0, 3, 1, ()))[1] for name, step in steps.items()}

    events = []
    problem = Problem(num_heads=19, kv_cache_dtype="fp8_ds_mla", page_size=64, topk=64)
    measure_shape(ShapeTask(problem, Shape(2, 200), ("MLA_TUNE_TRITON_SPARSE",)), events.append, device="cpu",
                  bench=real_runs)
    out = {e[1]: e[2] for e in events if e[0] == "result"}["MLA_TUNE_TRITON_SPARSE"]
    return {"status": out.status, "rel_error": out.rel_error, "reason": out.reason,
            "candidates": (out.params or {}).get("candidates"), "rejected": (out.params or {}).get("rejected")}


def _worker() -> None:
    """Subprocess entry: CPU_CASES under TRITON_INTERPRET=1, printed as JSON."""
    results = {name: _run(spec, params, device="cpu", seed=i)
               for i, (name, (spec, params)) in enumerate(CPU_CASES.items())}
    results["adapter_h19"] = run_adapter(19, 3, 300, 64, device="cpu")
    results["tuner"] = run_tuner()
    print(json.dumps(results))


@pytest.fixture(scope="module")
def interpreted_results():
    return interpreted_worker(__file__, timeout_s=900)


def _check(result: dict) -> None:
    assert not result["nan"], result
    assert result["rel_err"] < REL_TOL, result
    assert result["lse_err"] < LSE_TOL, result
    assert result["some_unseen"] and result["unseen_rows_ok"], "a token with no valid entry gives out 0, lse -inf"


@pytest.mark.parametrize("case", sorted(CPU_CASES))
def test_interpreted_ds_mla_matches_reference(interpreted_results, case):
    _check(interpreted_results[case])


def test_interpreted_adapter_times_the_packed_rows(interpreted_results):
    result = interpreted_results["adapter_h19"]
    assert not result["nan"] and result["rel_err"] < REL_TOL and result["lse_err"] < LSE_TOL, result
    assert result["tl"] and result["packed"] == 2  # every rotated copy packed once, before any timed run


def test_interpreted_tuner_gates_every_candidate_on_the_packed_rows(interpreted_results):
    result = interpreted_results["tuner"]
    assert result["status"] == "ok" and result["rel_error"] < REL_TOL, result
    assert result["candidates"] >= 2 and not result["rejected"], result


def test_sm90_gives_ds_mla_the_fp8_hopper_tiles_and_other_gpus_the_tl_tiles():
    from mla_tune.backends.triton_mla.dispatch import candidate_tiles, default_tile

    for heads in (16, 32, 64, 128):
        for batch in (1, 64):
            facts = dict(num_heads=heads, q_len=1, batch=batch, max_items=2048, sparse=True)
            assert default_tile(**facts, cc_major=9, ds_mla=True) == default_tile(**facts, cc_major=9, kv_fp8=True)
            assert default_tile(**facts, cc_major=9, ds_mla=True).warp_specialized
            assert candidate_tiles(**facts, cc_major=9, ds_mla=True) == candidate_tiles(**facts, cc_major=9,
                                                                                        kv_fp8=True)
            tl = candidate_tiles(**facts, cc_major=8, ds_mla=True)
            assert all(t.split_d and not t.split_scores and not t.warp_specialized for t in tl)


def test_misplaced_rows_and_wrong_inputs_are_refused_with_the_reason():
    from mla_tune.backends.triton_mla import LaunchParams, mla_decode

    case = make_case(heads=16, batch=2, topk=8, page_size=16, lengths=[20, 5], gap_rows=0, seed=0, device="cpu")
    args = (case["table"], case["seq_lens"])
    shifted = torch.zeros(case["pages"].numel() + 16, dtype=torch.uint8)[8:8 + case["pages"].numel()]
    with pytest.raises(ValueError, match="16-byte aligned address"):
        mla_decode(case["q"], shifted.view(case["pages"].shape), *args, sm_scale=0.1, topk_indices=case["topk"])
    padded = torch.zeros(*case["pages"].shape[:2], DS_MLA_BYTES + 16, dtype=torch.uint8)[..., :DS_MLA_BYTES]
    with pytest.raises(ValueError, match="must be contiguous"):
        mla_decode(case["q"], padded, *args, sm_scale=0.1, topk_indices=case["topk"])
    no_split_d = LaunchParams(block_h=16, block_n=16, num_warps=4, num_stages=1)
    with pytest.raises(ValueError, match="needs split_d"):
        mla_decode(case["q"], case["pages"], *args, sm_scale=0.1, topk_indices=case["topk"], params=no_split_d)
    with pytest.raises(ValueError, match="carries its own scales"):
        mla_decode(case["q"], case["pages"], *args, sm_scale=0.1, kv_scale=1.0, topk_indices=case["topk"])
    with pytest.raises(ValueError, match="needs a bf16 query"):
        mla_decode(case["q"].half(), case["pages"], *args, sm_scale=0.1, topk_indices=case["topk"])


@pytest.mark.slow
@pytest.mark.parametrize("form", [dict(rows=16), dict(rows=32), dict(rows=64), dict(qk1=True)],
                         ids=["narrow16", "narrow32", "token_split", "qk1"])
def test_every_hopper_form_reads_ds_mla_rows_16_bytes_at_a_time(form):
    # The loader's loads are 16 bytes wide (rows on 16-byte boundaries), each 128-value group is multiplied by its
    # scale two values an instruction in fp16; the narrow form keeps no FP8 staging ring for them.
    from offline_compile import hopper_compile

    from mla_tune.backends.triton_mla.hopper import hopper_smem_bytes

    ptx, smem, _ = hopper_compile(kv="fp8_ds_mla", sparse=True, **form)
    fp8_ptx, fp8_smem, _ = hopper_compile(kv="fp8", sparse=True, **form)
    assert hopper_smem_bytes(block_n=64, stages=2, rows=form.get("rows", 64), kv_fp8=True, qk1="qk1" in form,
                             ds_mla=True) <= smem
    assert ptx.count("mul.rn.f16x2") >= 8 * 2
    assert ptx.count("ld.global.v4.b32") >= 8 + 2
    assert "cp.async" not in ptx
    assert smem < fp8_smem if form.get("rows", 64) < 64 else smem == fp8_smem


def test_quantiser_round_trips_and_lays_out_vllms_656_bytes():
    values = torch.randn(3, 4, 576) * 3
    rows = quantize_fp8_ds_mla(values)
    assert rows.dtype == torch.uint8 and rows.shape == (3, 4, 656)
    scales = rows[..., 512:528].contiguous().view(torch.float32)
    torch.testing.assert_close(scales, values[..., :512].unflatten(-1, (4, 128)).abs().amax(-1) / 448)
    back = unpack_fp8_ds_mla(rows)
    assert float(((back[..., :512] - values[..., :512]).abs() / values[..., :512].abs().clamp_min(1e-2)).median()) \
        < 0.05  # e4m3: 3 mantissa bits
    torch.testing.assert_close(back[..., 512:], values[..., 512:].to(torch.bfloat16).float())


# ---------------------------------------------------------------- GPU

GPU_HEADS = (16, 19, 32, 64, 128)


@pytest.mark.gpu
@pytest.mark.parametrize("heads", GPU_HEADS)
@pytest.mark.parametrize("batch,page_size,gap_rows", [(1, 64, 0), (5, 64, 64), (33, 64, 0), (8, 128, 192)])
def test_gpu_ds_mla_topk2048(heads, batch, page_size, gap_rows):
    lengths = [(4096 + 1000 * b) % 9000 + 2100 for b in range(batch)]
    spec = dict(heads=heads, batch=batch + 1, topk=2048, page_size=page_size, lengths=lengths + [77],
                gap_rows=gap_rows)
    _check(_run(spec, None, device="cuda", seed=heads + batch))
    _check(_run(spec, "vllm", device="cuda", seed=heads + batch))


@pytest.mark.gpu
@pytest.mark.parametrize("heads", [16, 19, 32, 64, 128])
@pytest.mark.parametrize("batch", [1, 4, 64])
def test_gpu_ds_mla_adapter(heads, batch):
    result = run_adapter(heads, batch, 6000, 2048, device="cuda")
    assert not result["nan"] and result["rel_err"] < REL_TOL and result["lse_err"] < LSE_TOL, result
    assert result["tl"] is (torch.cuda.get_device_capability()[0] != 9) and result["packed"] == 2


@pytest.mark.gpu
@pytest.mark.parametrize("heads", [19, 64])
@pytest.mark.parametrize("tile", ["fp16_reload_opaque", "bf16_products", "hoisted", "wide_split"])
def test_gpu_ds_mla_every_tl_switch(heads, tile):
    params = {"fp16_reload_opaque": dict(block_h=32, block_n=32, reload_v=True, fp16_math=True, opaque_v_cast=True),
              "bf16_products": dict(block_h=16, block_n=32),
              "hoisted": dict(block_h=16, block_n=32, hoist_pages=64, reload_v=True, fp16_math=True),
              "wide_split": dict(block_h=64, block_n=64, num_warps=8, fp16_math=True)}[tile]
    params = {"num_warps": 4, "num_stages": 2, "split_d": True, "num_splits": 4, **params}
    spec = dict(heads=heads, batch=6, topk=2048, page_size=64, lengths=[3000, 2049, 9000, 2100, 4444, 50],
                gap_rows=64)
    _check(_run(spec, params, device="cuda", seed=3))


HOPPER_FORMS = {"narrow16": dict(block_h=16, num_warps=4), "narrow32": dict(block_h=32, num_warps=4),
                "token_split": dict(block_h=64, num_warps=8), "qk1": dict(block_h=64, num_warps=4)}


@pytest.mark.gpu
@pytest.mark.parametrize("form", sorted(HOPPER_FORMS))
@pytest.mark.parametrize("heads", [16, 19, 64, 128])
@pytest.mark.parametrize("dense", [False, True], ids=["sparse", "dense"])
def test_gpu_ds_mla_every_hopper_form(form, heads, dense):
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Hopper forms need SM90")
    params = dict(block_n=64, num_stages=2, warp_specialized=True, num_splits=3, **HOPPER_FORMS[form])
    spec = dict(heads=heads, batch=6, topk=2048, page_size=64, lengths=[3000, 2049, 9000, 130, 4444, 50],
                gap_rows=64)
    case = make_case(**spec, seed=heads, device="cuda")
    result = run_decode(case, params, dense=dense)
    assert not result["nan"] and result["rel_err"] < REL_TOL and result["lse_err"] < LSE_TOL, result
    if not dense:
        assert result["some_unseen"] and result["unseen_rows_ok"], result


if __name__ == "__main__" and "--worker" in sys.argv:
    from mla_tune.backends.triton_mla import _interpreter

    _interpreter.apply()
    _worker()
