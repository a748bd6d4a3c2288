"""Splits sized per request on the device (`split_per_request`): one launch, planned without the lengths for a wide
block table, must be right for whatever lengths each step brings, as a CUDA graph captured by vLLM is replayed.

CPU: the launch is prepared once (parameters, outputs, workspace) and re-run after each step's lengths and pages are
written into the same tensors, under the Triton interpreter in a subprocess (the interpreter must be on before triton
is imported); every step against the float32 reference. GPU (marker `gpu`): the same with a real CUDA graph captured
once through the vLLM backend's launch (`dense_forward`) with a max_model_len-wide block table, then replayed.
"""

from __future__ import annotations

import json
import math
import re
import sys

import pytest
from interpreted import interpreted_worker

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from mla_tune.backends.reference import mla_reference  # noqa: E402

BF16_TOL, FP8_TOL = 1e-2, 2e-2
FP8_SCALE = 1 / 48.5

# name -> (heads, q_len, kv dtype, page size, capacity in pages, per-step lengths, LaunchParams keywords or None for
# the product's own choice without lengths (`splits.params_from_tile`, 4 interpreter "SMs"))
CASES = {
    # short splits (one 16-token tile), many of them: lengths off the page size, an empty request, a 1-token one
    "bf16_h3_edge_lengths": (3, 1, "bf16", 16, 48, [[1, 15, 17, 0, 700], [700, 1, 16, 33, 0], [64, 65, 63, 2, 5]],
                             dict(block_h=16, block_n=16, num_warps=4, num_stages=1, num_splits=6, split_items=16)),
    # odd heads over two 16-row blocks, two query tokens (causal inside the block), latent in four column blocks
    "bf16_h20_qlen2_two_mblocks": (20, 2, "bf16", 16, 24, [[2, 300, 45], [380, 2, 99]],
                                   dict(block_h=16, block_n=16, num_warps=4, num_stages=1, num_splits=5,
                                        split_items=32, split_d=True)),
    # FP8 in fp16 math, block-table entries held in registers (chunks start mid-page: splits are 16-token multiples)
    "fp8_h5_hoisted_fp16_math": (5, 1, "fp8", 32, 16, [[500, 3, 129], [17, 511, 260]],
                                 dict(block_h=16, block_n=16, num_warps=4, num_stages=2, num_splits=4, split_items=16,
                                      split_d=True, reload_v=True, hoist_pages=4, fp16_math=True)),
    # the score matmul split between warpgroups (per-program scratch indexed by the split count)
    "bf16_h7_split_scores": (7, 1, "bf16", 16, 20, [[300, 1, 77], [5, 319, 160]],
                             dict(block_h=16, block_n=16, num_warps=4, num_stages=2, num_splits=3, split_items=16,
                                  split_d=True, split_scores=True)),
    # the product's own launch without lengths (the default tile, its split count over the capacity)
    "bf16_h16_default_launch": (16, 1, "bf16", 16, 40, [[640, 1, 100, 333], [2, 639, 0, 64]], None),
}
# A batch whose lengths run from 1 to several thousand tokens in one launch (seconds in the interpreter).
SLOW_CASES = {
    "bf16_h3_one_to_thousands": (3, 1, "bf16", 16, 256, [[1, 3000, 40, 777], [4090, 2, 1, 1500]],
                                 dict(block_h=16, block_n=32, num_warps=4, num_stages=1, num_splits=8,
                                      split_items=64, split_d=True)),
    "fp8_h16_default_launch_thousands": (16, 1, "fp8", 64, 64, [[4000, 1], [3, 4096]], None),
}


def _rel_err(out, ref) -> float:
    return float((out.float() - ref).norm() / ref.norm().clamp_min(1e-30))


class Steps:
    """One batch's tensors as a graph sees them: a KV pool, a `capacity_pages`-wide block table and lengths, rewritten
    in place every step. Table entries past a request's pages point at a page of NaNs, so a read past the end shows."""

    def __init__(self, *, heads: int, q_len: int, kv: str, page_size: int, capacity_pages: int, steps: list[list[int]],
                 device, seed: int = 0):
        batch = len(steps[0])
        self.gen = torch.Generator().manual_seed(seed)
        self.page_size, self.q_len = page_size, q_len
        pool = max(sum(-(-n // page_size) for n in lengths) for lengths in steps) + 3
        kv_cache = torch.randn(pool, page_size, 576, generator=self.gen)
        kv_cache[0] = float("nan")  # the poison page
        if kv == "fp8":
            self.kv_cache = (kv_cache * 48).clamp(-448, 448).to(torch.float8_e4m3fn).to(device)
            self.kv_scale = FP8_SCALE
        else:
            self.kv_cache = kv_cache.to(torch.bfloat16).to(device)
            self.kv_scale = None
        self.q = torch.randn(batch, q_len, heads, 576, generator=self.gen).to(torch.bfloat16).to(device)
        self.block_table = torch.zeros(batch, capacity_pages, dtype=torch.int32, device=device)
        self.seq_lens = torch.zeros(batch, dtype=torch.int32, device=device)

    def write(self, lengths: list[int]) -> None:
        """This step's lengths and freshly permuted pages, into the same tensors."""
        pages = [-(-n // self.page_size) for n in lengths]
        order = torch.randperm(self.kv_cache.shape[0] - 1, generator=self.gen) + 1
        table = torch.zeros(self.block_table.shape, dtype=torch.int32)
        start = 0
        for row, count in enumerate(pages):
            table[row, :count] = order[start:start + count]
            start += count
        self.block_table.copy_(table)
        self.seq_lens.copy_(torch.tensor(lengths, dtype=torch.int32))
        self.q.copy_(torch.randn(self.q.shape, generator=self.gen).to(torch.bfloat16))

    def check(self, out, lse, *, scale: float) -> dict:
        ref_out, ref_lse = mla_reference(self.q, self.kv_cache, self.block_table, self.seq_lens, sm_scale=scale,
                                         kv_scale=self.kv_scale)
        out, lse = out.view(ref_out.shape).cpu(), lse.view(ref_lse.shape).cpu()
        ref_out, ref_lse = ref_out.cpu(), ref_lse.cpu()
        seen = torch.isfinite(ref_lse)
        return {"rel_err": _rel_err(out[seen], ref_out[seen]) if seen.any() else 0.0,
                "lse_err": float((lse[seen] - ref_lse[seen]).abs().max()) if seen.any() else 0.0,
                "nan": bool(out.isnan().any() or lse.isnan().any()),
                "unseen_rows_ok": bool((out[~seen] == 0).all() and (lse[~seen] == -math.inf).all())}


def _interpreted_case(heads, q_len, kv, page_size, capacity_pages, steps, params) -> dict:
    """The launch prepared once for a `capacity_pages`-wide table, re-run on each step's lengths (interpreter)."""
    from mla_tune.backends.triton_mla import _interpreter
    from mla_tune.backends.triton_mla.config import D_LATENT, LaunchParams
    from mla_tune.backends.triton_mla.launcher import launch
    from mla_tune.backends.triton_mla.splits import default_params
    from mla_tune.backends.triton_mla.workspace import Workspace

    _interpreter.apply()
    s = Steps(heads=heads, q_len=q_len, kv=kv, page_size=page_size, capacity_pages=capacity_pages, steps=steps,
              device="cpu")
    batch = len(steps[0])
    if params is None:
        params = default_params(num_heads=heads, q_len=q_len, batch=batch, max_items=capacity_pages * page_size,
                                num_sms=4, kv_fp8=kv == "fp8")
    else:
        params = LaunchParams(**params, split_per_request=True)
    out = torch.empty(batch, q_len, heads, D_LATENT, dtype=torch.bfloat16)
    lse = torch.empty(batch, q_len, heads)
    workspace = Workspace.for_launch(params, batch=batch, q_len=q_len, num_heads=heads, sparse=False, device="cpu")
    results = []
    for lengths in steps:
        s.write(lengths)
        out.fill_(float("nan"))
        launch(s.q, s.kv_cache, s.block_table, s.seq_lens, out, lse, sm_scale=0.1, kv_scale=s.kv_scale,
               topk_indices=None, params=params, workspace=workspace)
        results.append(s.check(out, lse, scale=0.1))
    return {"label": params.label(), "split_per_request": params.split_per_request, "steps": results}


def _worker(group: str) -> None:
    cases = SLOW_CASES if group == "slow" else CASES
    print(json.dumps({name: _interpreted_case(*case) for name, case in cases.items()}))


def _run_worker(group: str) -> dict:
    return interpreted_worker(__file__, group)


@pytest.fixture(scope="module")
def interpreted():
    return _run_worker("fast")


@pytest.fixture(scope="module")
def interpreted_slow():
    return _run_worker("slow")


def _assert_steps(result: dict, kv: str) -> None:
    tol = FP8_TOL if kv == "fp8" else BF16_TOL
    assert result["split_per_request"], result["label"]
    for step in result["steps"]:
        assert not step["nan"] and step["unseen_rows_ok"], step
        assert step["rel_err"] < tol and step["lse_err"] < 1e-2, step


@pytest.mark.parametrize("case", sorted(CASES))
def test_one_launch_is_right_for_every_steps_lengths(interpreted, case):
    _assert_steps(interpreted[case], CASES[case][2])


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(SLOW_CASES))
def test_one_launch_is_right_for_lengths_from_one_to_thousands(interpreted_slow, case):
    _assert_steps(interpreted_slow[case], SLOW_CASES[case][2])


# ---------------------------------------------------------------------------------------- the plan (no kernel)

def test_without_lengths_a_dense_launch_sizes_its_splits_per_request():
    from mla_tune.backends.triton_mla.dispatch import TILE_TABLE
    from mla_tune.backends.triton_mla.splits import params_from_tile

    tile = TILE_TABLE[("16bit", 16)]
    graph = params_from_tile(tile, num_heads=16, q_len=1, batch=4, max_items=163840, num_sms=132)
    assert graph.split_per_request and graph.num_splits > 1 and graph.label().endswith("L")
    assert graph.split_items == max(tile.min_split_tokens, tile.block_n), "split_items is the shortest split"
    # the split count depends on the capacity only through its bound (capacity / shortest split)
    wider = params_from_tile(tile, num_heads=16, q_len=1, batch=4, max_items=2 * 163840, num_sms=132)
    assert wider == graph
    known = params_from_tile(tile, num_heads=16, q_len=1, batch=4, max_items=4096, num_sms=132, lengths=[4096] * 4)
    assert not known.split_per_request, "with the lengths on the host the balanced plan stays"
    sparse = params_from_tile(tile, num_heads=16, q_len=1, batch=4, max_items=2048, num_sms=132, sparse=True)
    assert not sparse.split_per_request and sparse.split_items == 0, "a sparse request's length is its top-k"
    one = params_from_tile(TILE_TABLE[("16bit", 128)], num_heads=128, q_len=1, batch=128, max_items=163840,
                           num_sms=132)
    assert one.num_splits == 1 and not one.split_per_request, "one split covers any length as it is"


def test_a_sparse_launch_refuses_per_request_splits():
    from mla_tune.backends.triton_mla.config import LaunchParams
    from mla_tune.backends.triton_mla.launcher import launch

    q = torch.zeros(1, 1, 16, 576, dtype=torch.bfloat16)
    params = LaunchParams(block_h=16, block_n=16, num_warps=4, num_splits=2, split_items=16, split_per_request=True)
    with pytest.raises(ValueError, match="split_per_request sizes dense splits"):
        launch(q, torch.zeros(2, 16, 576, dtype=torch.bfloat16), torch.zeros(1, 2, dtype=torch.int32),
               torch.ones(1, dtype=torch.int32), torch.empty(1, 1, 16, 512, dtype=torch.bfloat16),
               torch.empty(1, 1, 16), sm_scale=0.1, kv_scale=None, topk_indices=torch.zeros(1, 1, 16, dtype=torch.int32),
               params=params, workspace=None)


def test_hopper_programs_get_the_longest_split_a_full_table_allows(monkeypatch):
    # the loader-ahead switch needs the most tiles a program may have: under per-request splits, a full table's
    from mla_tune.backends.triton_mla import dispatch, launcher
    from mla_tune.backends.triton_mla.config import LaunchParams
    from mla_tune.backends.triton_mla.workspace import Workspace

    seen = {}
    monkeypatch.setattr(launcher, "_launch_hopper", lambda args, grid, common, **kw: seen.update(kw, **common))
    monkeypatch.setattr(launcher, "_combine", lambda *a, **k: None)
    params = LaunchParams(**dispatch.HOPPER_QK1_TILE.launch_fields(), num_splits=4, split_items=128,
                          split_per_request=True)
    q = torch.zeros(2, 1, 64, 576, dtype=torch.bfloat16)
    table = torch.zeros(2, 2560, dtype=torch.int32)  # 163,840 tokens of 64-token pages
    launcher.launch(q, torch.zeros(1, 64, 576, dtype=torch.float8_e4m3fn), table, torch.ones(2, dtype=torch.int32),
                    torch.empty(2, 1, 64, 512, dtype=torch.bfloat16), torch.empty(2, 1, 64), sm_scale=0.1,
                    kv_scale=1.0, topk_indices=None, params=params,
                    workspace=Workspace.for_launch(params, batch=2, q_len=1, num_heads=64, sparse=False, device="cpu"))
    assert seen["SPLIT_PER_REQUEST"] and seen["tiles"] == 163840 // 4 // 64


@pytest.mark.slow
@pytest.mark.parametrize("rows,qk1,kv", [(64, False, "bf16"), (16, False, "fp8"), (64, True, "fp8")])
def test_the_hopper_forms_compile_per_request_splits_for_sm90a(rows, qk1, kv):
    from offline_compile import hopper_compile

    ptx, _, report = hopper_compile(kv=kv, rows=rows, qk1=qk1, SPLIT_PER_REQUEST=True, PARTIAL_EVICT_LAST=True)
    plain, _, _ = hopper_compile(kv=kv, rows=rows, qk1=qk1, PARTIAL_EVICT_LAST=True)
    assert "nctaid.z" in ptx and "nctaid.z" not in plain, "the split count is read from the grid only per request"
    assert sum(int(n) for n in re.findall(r"(\d+) bytes spill stores", report)) <= 64, report


@pytest.mark.slow
def test_the_tl_kernel_compiles_per_request_splits_and_the_default_is_unchanged():
    from offline_compile import kernel_ptx

    tile = dict(block_h=16, block_n=32, num_warps=4, num_stages=2, RELOAD_V=True, HOIST_PAGES=64, FP16_MATH=True)
    assert kernel_ptx(**tile) == kernel_ptx(**tile, SPLIT_PER_REQUEST=False)
    assert "nctaid.z" in kernel_ptx(**tile, SPLIT_PER_REQUEST=True)


# ------------------------------------------------------------------------- GPU: one capture, many replays

GRAPH_CASES = [  # (heads, kv, batch): the tl tile, the narrow, token-split and qk1 Hopper forms on an H100
    (16, "bf16", 4), (16, "fp8", 4), (128, "bf16", 2), (64, "bf16", 16), (128, "fp8", 16), (20, "bf16", 3)]
MAX_MODEL_LEN = 163840


def _graph_steps(batch: int) -> list[list[int]]:
    """Per-step lengths: short, long, a spread from 1 to tens of thousands, empty and uniform."""
    spread = [1, 30000, 7, 4097, 64, 65, 999, 12345]
    return [[1 + i for i in range(batch)], [20000 - 1000 * i for i in range(batch)],
            (spread * batch)[:batch], [0] + [1024] * (batch - 1), [3000] * batch]


@pytest.mark.gpu
@pytest.mark.parametrize("heads,kv,batch", GRAPH_CASES)
def test_gpu_a_graph_captured_once_follows_every_steps_lengths(heads, kv, batch):
    from mla_tune.vllm_backends.launch import dense_forward

    steps = _graph_steps(batch)
    s = Steps(heads=heads, q_len=1, kv=kv, page_size=64, capacity_pages=MAX_MODEL_LEN // 64, steps=steps,
              device="cuda", seed=heads + batch)
    k_scale = torch.tensor([FP8_SCALE], device="cuda") if kv == "fp8" else None
    q = s.q.view(batch, heads, 576)
    s.write(steps[0])
    run = lambda: dense_forward(q, s.kv_cache, s.block_table, s.seq_lens, max_seq_len=MAX_MODEL_LEN,  # noqa: E731
                                scale=0.1, k_scale=k_scale)
    run()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = run()
    for lengths in steps:
        s.write(lengths)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        r = s.check(out, lse, scale=0.1)
        assert not r["nan"] and r["unseen_rows_ok"], (lengths, r)
        assert r["rel_err"] < (FP8_TOL if kv == "fp8" else BF16_TOL) and r["lse_err"] < 1e-2, (lengths, r)


if __name__ == "__main__" and sys.argv[1:2] == ["--worker"]:
    _worker(sys.argv[2])
