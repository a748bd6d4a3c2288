"""vLLM's own kernels through their adapters on the GPU, against the float32 reference (marker `gpu`).

tests/backends/test_backends_gpu.py runs every adapter over its common cases; these add what only vLLM's
paths have: FlashMLA's sparse FP8 head padding on both sides of vLLM's mixed-batch threshold (32 heads),
multi-token decode, the fp8_ds_mla conversion of rotated input sets, and a run on an unconverted set.
Inputs are random with permuted page tables and ragged, odd lengths (backends/inputs.py).
FP8 FlashMLA rounds q to e4m3 first, which alone moves the output by about 3.7 %: those cases are gated
with the gate's FP8-query limits (tuner/gate.py), the others with the usual ones.
"""

from __future__ import annotations

import pytest

from mla_tune.backends.problem import DeviceSpec, Problem, Shape

pytestmark = pytest.mark.gpu

CASES = [
    # (backend, heads, kv dtype, topk, q_len, batch, kv_len)
    ("FLASHMLA", 16, "bf16", None, 1, 5, 1037),
    ("FLASHMLA", 128, "fp8_e4m3", None, 1, 3, 2049),
    ("FLASHMLA", 64, "fp8_e4m3", None, 2, 3, 777),
    ("FLASHMLA", 32, "bf16", None, 2, 4, 901),
    ("FLASHMLA_SPARSE", 16, "fp8_e4m3", 2048, 1, 3, 5000),     # mixed batch, padded to 64
    ("FLASHMLA_SPARSE", 20, "fp8_e4m3", 256, 1, 4, 700),
    ("FLASHMLA_SPARSE", 64, "fp8_e4m3", 2048, 1, 2, 3001),     # separate decode, no padding
    ("FLASHMLA_SPARSE", 96, "fp8_e4m3", 512, 1, 2, 1500),      # padded to 128
    ("FLASHMLA_SPARSE", 128, "fp8_e4m3", 2048, 2, 2, 3001),
    ("FLASHMLA_SPARSE", 16, "bf16", 2048, 1, 3, 5000),         # bf16: padded to 64 heads
    ("FLASHMLA_SPARSE", 128, "bf16", 256, 2, 2, 700),
    ("FLASH_ATTN_MLA", 16, "bf16", None, 1, 5, 1037),
    ("FLASH_ATTN_MLA", 128, "bf16", None, 2, 3, 2049),
    ("FLASH_ATTN_MLA_SPARSE", 16, "bf16", 2048, 1, 3, 5000),
    ("FLASH_ATTN_MLA_SPARSE", 128, "bf16", 256, 2, 2, 700),
    ("TRITON_MLA", 16, "bf16", None, 1, 5, 1037),
    ("TRITON_MLA", 128, "fp8_e4m3", None, 1, 3, 2049),
    ("TRITON_MLA", 64, "bf16", None, 2, 3, 777),
    ("FLASHINFER_MLA_SPARSE_SM90", 16, "bf16", 2048, 1, 3, 5000),
    ("FLASHINFER_MLA_SPARSE_SM90", 64, "fp8_e4m3", 2048, 1, 2, 3001),
    ("FLASHINFER_MLA_SPARSE_SM90", 128, "bf16", 256, 2, 2, 700),
]


def _device():
    import torch

    return DeviceSpec(torch.cuda.get_device_name(), torch.cuda.get_device_capability())


def _prepared(name, problem, inputs):
    from mla_tune.backends.registry import backend_reasons, load_adapter

    reasons = backend_reasons(name, problem, _device())
    if reasons:
        pytest.skip(f"{name} is not eligible here: {'; '.join(reasons)}")
    return load_adapter(name)().prepare(problem, inputs)


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-h{c[1]}-{c[2]}-topk{c[3]}-q{c[4]}")
def test_vllm_kernel_matches_reference_eager_and_in_a_graph_over_rotated_sets(case):
    import torch

    from mla_tune.backends.inputs import clone_data, make_inputs
    from mla_tune.backends.interface import adopt_rotation
    from mla_tune.backends.reference import TorchReference
    from mla_tune.tuner.gate import check_output, quantizes_query
    from mla_tune.tuner.timing import capture_graph

    name, heads, kv, topk, q_len, batch, kv_len = case
    problem = Problem(heads, kv_cache_dtype=kv, topk=topk, q_len=q_len)
    inputs = make_inputs(problem, Shape(batch, kv_len), device="cuda", seed=heads + kv_len)
    prepared = _prepared(name, problem, inputs)
    fp8_query = quantizes_query(name, problem.kv_cache_dtype)
    ref = TorchReference().prepare(problem, inputs).run(inputs)
    out, lse = prepared.run(inputs)
    torch.cuda.synchronize()
    verdict = check_output(out, lse, *ref, kv_cache_dtype=kv, fp8_query=fp8_query)
    assert verdict.ok, f"{name}: {verdict.reason}"

    sets = clone_data(inputs, 3)
    for s in sets[1:]:
        s.q.normal_()
        if s.kv_cache.dtype == torch.float8_e4m3fn:
            s.kv_cache.copy_((torch.randn_like(s.kv_cache, dtype=torch.bfloat16) * 48).to(torch.float8_e4m3fn))
        else:
            s.kv_cache.normal_()
    adopt_rotation(prepared, sets)
    results = []

    def keep(out, lse):   # each launch may write the same preallocated buffer: copy it inside the graph
        return out.clone(), None if lse is None else lse.clone()

    graph = capture_graph(lambda: results.append([keep(*prepared.run(s)) for s in sets]), iterations_per_replay=3,
                          min_replay_ms=0)
    for out, _ in results[-1]:
        out.zero_()
    graph()
    torch.cuda.synchronize()
    for i, s in enumerate(sets):
        ref = TorchReference().prepare(problem, s).run(s)
        verdict = check_output(*results[-1][i], *ref, kv_cache_dtype=kv, fp8_query=fp8_query)
        assert verdict.ok, f"{name}, rotated set {i} in a CUDA graph: {verdict.reason}"


def test_flashmla_sparse_fp8_refuses_a_set_it_has_not_converted():
    from mla_tune.backends.inputs import clone_data, make_inputs

    problem = Problem(64, kv_cache_dtype="fp8_e4m3", topk=256)
    inputs = make_inputs(problem, Shape(2, 700), device="cuda")
    prepared = _prepared("FLASHMLA_SPARSE", problem, inputs)
    with pytest.raises(ValueError, match="has not converted"):
        prepared.run(clone_data(inputs, 2)[1])


def test_vllm_triton_kernel_is_a_kernel_here():
    # Without vLLM's dist-info (bench/vllm_site.py writes it) vLLM swaps Triton for placeholders.
    from mla_tune.backends.registry import backend_reasons

    if backend_reasons("TRITON_MLA", Problem(16), _device()):
        pytest.skip("vLLM's Triton kernel file is not present")
    from vllm.triton_utils import HAS_TRITON

    assert HAS_TRITON, "vllm.triton_utils disabled Triton: run bench/vllm_site.py and put .vsite on PYTHONPATH"
