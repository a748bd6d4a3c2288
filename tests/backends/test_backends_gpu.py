"""Every runnable backend against the float32 reference on the GPU (marker `gpu`).

Parametrized from the registry: each backend with an adapter meets random
problems (heads 1, 16, 20, 64, 128; bf16 and fp8 KV; dense and sparse;
ragged lengths, permuted pages). A backend the local GPU cannot run is
skipped with its eligibility reasons; one that is eligible must build, match
the reference within the correctness gate, and survive CUDA-graph capture.
"""

from __future__ import annotations

import pytest

from mla_tune.backends.problem import Problem, Shape
from mla_tune.backends.registry import BACKENDS

pytestmark = pytest.mark.gpu

RUNNABLE = sorted(name for name, info in BACKENDS.items()
                  if info.adapter is not None and name != "TORCH_REFERENCE")

CASES = [
    # (heads, kv dtype, topk, q_len, batch, kv_len)
    (1, "bf16", None, 1, 3, 700),
    (16, "bf16", None, 1, 4, 1000),
    (20, "fp8_e4m3", None, 1, 4, 700),
    (64, "fp8_e4m3", None, 1, 3, 1500),
    (128, "bf16", None, 1, 2, 900),
    (128, "fp8_e4m3", None, 1, 2, 900),
    (16, "bf16", None, 2, 3, 500),
    (16, "bf16", 256, 1, 4, 700),          # some requests shorter than top-k: -1 padding
    (20, "fp8_e4m3", 256, 1, 3, 700),
    (128, "bf16", 2048, 1, 2, 3000),
    (64, "fp8_e4m3", 2048, 1, 2, 3000),
    (16, "bf16", 256, 2, 3, 600),
]


def _device_spec():
    import torch

    from mla_tune.backends.problem import DeviceSpec

    return DeviceSpec(torch.cuda.get_device_name(), torch.cuda.get_device_capability())


def _problem(heads, kv, topk, q_len):
    return Problem(num_heads=heads, kv_cache_dtype=kv, topk=topk, q_len=q_len, page_size=64)


def _eligible_or_skip(name, problem):
    from mla_tune.backends.registry import backend_reasons

    reasons = backend_reasons(name, problem, _device_spec())
    if reasons:
        pytest.skip(f"{name} is not eligible here: {'; '.join(reasons)}")


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"h{c[0]}-{c[1]}-topk{c[2]}-q{c[3]}")
@pytest.mark.parametrize("name", RUNNABLE)
def test_backend_matches_reference_and_captures(name, case):
    import torch

    from mla_tune.backends.inputs import clone_data, make_inputs
    from mla_tune.backends.interface import adopt_rotation
    from mla_tune.backends.reference import TorchReference
    from mla_tune.backends.registry import load_adapter
    from mla_tune.tuner.gate import check_output, quantizes_query
    from mla_tune.tuner.timing import capture_graph

    heads, kv, topk, q_len, batch, kv_len = case
    problem = _problem(heads, kv, topk, q_len)
    _eligible_or_skip(name, problem)
    inputs = make_inputs(problem, Shape(batch, kv_len), device="cuda", seed=heads + batch)
    ref_out, ref_lse = TorchReference().prepare(problem, inputs).run(inputs)
    prepared = load_adapter(name)().prepare(problem, inputs)
    out, lse = prepared.run(inputs)
    torch.cuda.synchronize()
    fp8_query = quantizes_query(name, problem.kv_cache_dtype)
    verdict = check_output(out, lse, ref_out, ref_lse, kv_cache_dtype=problem.kv_cache_dtype, fp8_query=fp8_query)
    if name == "TRITON_MLA" and heads == 1 and not verdict.ok:
        # Measured on an H100: vLLM's own Triton kernel reads 1.8e-2 relative error at one head (bf16), above the
        # 1e-2 gate, so the tuner records it as incorrect there; the kernel is vLLM's and is not ours to change.
        pytest.xfail(f"vLLM's TRITON_MLA at 1 head: {verdict.reason}")
    assert verdict.ok, f"{name}: {verdict.reason}"

    # A graph over two input copies replays to the same numbers as eager runs on each; the outputs checked are
    # those the captured launches write (an engine's op may allocate them from the graph's pool).
    sets = clone_data(inputs, 2)
    sets[1].q.copy_(torch.randn_like(sets[1].q))
    adopt_rotation(prepared, sets)
    results = []
    graph = capture_graph(lambda: results.append([prepared.run(s) for s in sets]), iterations_per_replay=2,
                          min_replay_ms=0)
    out, lse = results[-1][1]
    out.zero_()
    graph()
    torch.cuda.synchronize()
    ref1_out, ref1_lse = TorchReference().prepare(problem, sets[1]).run(sets[1])
    verdict = check_output(out, lse, ref1_out, ref1_lse, kv_cache_dtype=problem.kv_cache_dtype, fp8_query=fp8_query)
    assert verdict.ok, f"{name} after CUDA-graph replay: {verdict.reason}"


@pytest.mark.parametrize("name", RUNNABLE)
def test_wrong_page_size_dimension_is_a_value_error(name):
    from mla_tune.backends.inputs import make_inputs
    from mla_tune.backends.registry import load_adapter

    problem = _problem(16, "bf16", None, 1)
    _eligible_or_skip(name, problem)
    inputs = make_inputs(problem, Shape(2, 300), device="cuda")
    collapsed = inputs.with_data(inputs.q, inputs.kv_cache.view(-1, 1, inputs.kv_cache.shape[-1]))
    with pytest.raises(ValueError, match="kv_cache"):
        load_adapter(name)().prepare(problem, collapsed)


def test_reference_runs_on_gpu_like_on_cpu():
    import torch

    from mla_tune.backends.inputs import make_inputs
    from mla_tune.backends.reference import mla_reference

    problem = _problem(20, "fp8_e4m3", 128, 2)
    inputs = make_inputs(problem, Shape(3, 400), device="cuda", seed=5)
    args = dict(sm_scale=inputs.sm_scale, kv_scale=inputs.kv_scale, topk_indices=inputs.topk_indices)
    gpu_out, gpu_lse = mla_reference(inputs.q, inputs.kv_cache, inputs.block_table,
                                     inputs.seq_lens, **args)
    cpu_out, cpu_lse = mla_reference(inputs.q.cpu(), inputs.kv_cache.cpu(), inputs.block_table.cpu(),
                                     inputs.seq_lens.cpu(), sm_scale=inputs.sm_scale,
                                     kv_scale=inputs.kv_scale, topk_indices=inputs.topk_indices.cpu())
    torch.testing.assert_close(gpu_out.cpu(), cpu_out, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(gpu_lse.cpu(), cpu_lse, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", ["MLA_TUNE_TRITON_SPARSE", "FLASHINFER_FA3_MLA_SPARSE"])
def test_a_captured_graph_keeps_the_backend_it_replays_alive(name):
    # A caller that keeps only the graph must not leave it replaying freed buffers (cudaErrorInvalidAddressSpace).
    import gc
    import weakref

    import torch

    from mla_tune.backends.inputs import clone_data, make_inputs
    from mla_tune.backends.reference import TorchReference
    from mla_tune.backends.registry import load_adapter
    from mla_tune.tuner.gate import check_output

    problem = _problem(128, "bf16", 2048, 1)
    _eligible_or_skip(name, problem)
    inputs = make_inputs(problem, Shape(4, 32768), device="cuda", seed=4, ragged=False)
    ref_out, ref_lse = TorchReference().prepare(problem, inputs).run(inputs)
    prepared = load_adapter(name)().prepare(problem, inputs)
    out, lse = prepared.run(inputs)
    graph = _graph_of(prepared, clone_data(inputs, 2))
    alive = weakref.ref(prepared)
    del prepared
    gc.collect()
    assert alive() is not None, "the graph outlived the backend it replays"
    load_adapter(name)().prepare(problem, inputs)  # another backend's buffers, allocated after the first's
    out.zero_()
    graph()
    torch.cuda.synchronize()
    verdict = check_output(out, lse, ref_out, ref_lse, kv_cache_dtype=problem.kv_cache_dtype)
    assert verdict.ok, f"{name} after the graph outlived its caller's reference: {verdict.reason}"


def _graph_of(prepared, sets):
    """A CUDA graph of `prepared` over `sets`, as a benchmark makes them: the caller keeps only the graph."""
    from mla_tune.tuner.timing import capture_graph

    return capture_graph(lambda: [prepared.run(s) for s in sets], iterations_per_replay=len(sets), min_replay_ms=0)
