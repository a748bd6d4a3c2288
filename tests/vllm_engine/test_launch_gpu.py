"""On a GPU (marker `gpu`): our vLLM backends' launches with vLLM's layouts, against the float32 reference and
vLLM's FlashMLA where its extensions load (no vLLM install needed: `mla_tune.vllm_backends.launch` imports none).

    PYTHONPATH=$PWD/.vsite python3 -m pytest -m gpu tests/vllm_engine/test_launch_gpu.py -q
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

CASES = [(kind, heads, batch, kv_len) for kind in ("dense-bf16", "dense-fp8") for heads in (16, 128)
         for batch, kv_len in ((1, 1000), (33, 4097))] + \
        [(kind, heads, batch, 8191) for kind in ("sparse-bf16", "sparse-fp8") for heads in (16, 128)
         for batch in (1, 33)] + [("sparse-fp8", 19, 5, 5000), ("sparse-fp8", 64, 16, 3000)]


@pytest.mark.parametrize("kind, heads, batch, kv_len", CASES)
def test_launch_matches_reference_and_flashmla(kind, heads, batch, kv_len):
    import torch
    import vllm_backends as bench

    case = bench.Case(kind, heads, batch, kv_len)
    x = bench.make_inputs(case, torch.device("cuda"), seed=heads + batch)
    scale = 1.0 / math.sqrt(192)
    ref = bench.reference(case, x, scale)
    tol = bench.TOLERANCE["fp8" if case.fp8 else "bf16"] * max(1.0, ref.abs().max().item())
    ours = bench.ours(case, x, scale)()
    assert (ours.float() - ref).abs().max().item() <= tol
    if case.kind == "sparse-fp8":  # the e4m3 cache with k_scale (vLLM's fp8 for our backend), its own reference
        ref576 = bench.reference(case, x, scale, e4m3=True)
        assert (bench.ours(case, x, scale, e4m3=True)().float() - ref576).abs().max().item() <= \
            bench.TOLERANCE["fp8"] * max(1.0, ref576.abs().max().item())
    flashmla = bench.flashmla(case, x, scale)
    if isinstance(flashmla, str):
        pytest.skip(flashmla)
    torch.testing.assert_close(ours.float(), flashmla().float(), atol=2 * tol, rtol=0)


def test_dense_launch_is_cuda_graph_safe():
    import torch
    import vllm_backends as bench

    from mla_tune.tuner.timing import capture_graph

    case = bench.Case("dense-bf16", 64, 8, 3000)
    x = bench.make_inputs(case, torch.device("cuda"))
    step = bench.ours(case, x, 1.0 / math.sqrt(192))
    graph = capture_graph(step, min_replay_ms=0)
    graph()
    torch.cuda.synchronize()
    captured = graph._keepalive[0][0]
    torch.testing.assert_close(captured, step(), atol=0, rtol=0)
