"""The vLLM-kernel adapters on the CPU: registry names, eligibility reasons, argument construction, layouts.

vLLM itself is not installed in this environment (tests/backends/test_vllm_real.py runs against the real
package); where a test needs a `vllm` package it builds a tiny one in a temporary folder.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

from mla_tune.backends.inputs import make_inputs
from mla_tune.backends.interface import BackendUnavailable, adopt_rotation
from mla_tune.backends.problem import DeviceSpec, Problem, Shape
from mla_tune.backends.registry import BACKENDS, backend_reasons, get_backend

H100 = DeviceSpec("NVIDIA H100 80GB HBM3", (9, 0))
B200 = DeviceSpec("NVIDIA B200", (10, 0))
VLLM_ADAPTERS = ["FLASHMLA", "FLASHMLA_SPARSE", "FLASH_ATTN_MLA", "FLASH_ATTN_MLA_SPARSE", "TRITON_MLA",
                 "FLASHINFER_MLA_SPARSE_SM90", "CUTLASS_MLA"]


def test_our_kernels_have_their_own_names_and_no_vllm_name():
    for name, plugin in (("MLA_TUNE_TRITON", "MLA_TUNE_TRITON"), ("MLA_TUNE_TRITON_SPARSE", "MLA_TUNE_TRITON_SPARSE")):
        info = get_backend(name)
        assert info.vllm_name is None and info.sglang_name is None
        assert info.vllm_plugin_name == plugin
        assert info.adapter.startswith("mla_tune.backends.triton_mla.adapter:")
    assert "TRITON_MLA_SPARSE" not in BACKENDS


def test_every_vllm_name_is_the_kernel_vllm_runs_under_it():
    for name, info in BACKENDS.items():
        if info.vllm_name is not None:
            assert info.vllm_name == name, f"{name} hands vLLM another backend's name"
            assert info.adapter is None or not info.adapter.startswith("mla_tune.backends.triton_mla"), name
    assert get_backend("TRITON_MLA").adapter == "mla_tune.backends.vllm_kernels.triton:VllmTritonMLA"


@pytest.mark.parametrize("name", VLLM_ADAPTERS)
def test_vllm_adapters_import_without_vllm_and_name_themselves(name):
    from mla_tune.backends.registry import load_adapter

    assert load_adapter(name).name == name


def test_blackwell_entries_say_they_are_untested_on_hardware():
    for name in ("FLASHINFER_MLA", "FLASHINFER_MLA_SPARSE", "CUTLASS_MLA", "FLASHINFER_MLA_SPARSE_SM120"):
        assert "untested on hardware" in get_backend(name).hardware["blackwell"], name


@pytest.mark.parametrize("name", ["FLASHMLA", "FLASH_ATTN_MLA", "TRITON_MLA", "CUTLASS_MLA"])
def test_without_vllm_the_reason_is_one_sentence_naming_it(name):
    problem = Problem(16, page_size=128 if name == "CUTLASS_MLA" else 64)
    reasons = backend_reasons(name, problem, B200 if name == "CUTLASS_MLA" else H100)
    assert reasons == ["vllm is not installed (No module named 'vllm')"]


def _fake_vllm(root, files: dict[str, str]):
    pkg = root / "vllm"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("raise RuntimeError('listing must not import vllm')\n")
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def _reasons_in_subprocess(root, name: str, problem: str) -> tuple[list[str], bool]:
    code = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(root)!r})
        from mla_tune.backends.problem import DeviceSpec, Problem
        from mla_tune.backends.registry import backend_reasons
        print(repr(backend_reasons({name!r}, {problem}, DeviceSpec("H100", (9, 0)))))
        print("torch" in sys.modules)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    reasons, torch_loaded = out.strip().splitlines()
    return eval(reasons), torch_loaded == "True"  # noqa: S307 - our own repr


def test_a_missing_extension_is_named_without_importing_vllm_or_torch(tmp_path):
    _fake_vllm(tmp_path, {"vllm/third_party/__init__.py": "", "vllm/third_party/flashmla/__init__.py": "",
                          "vllm/third_party/flashmla/flash_mla_interface.py": ""})
    reasons, torch_loaded = _reasons_in_subprocess(tmp_path, "FLASHMLA", "Problem(16)")
    assert reasons == [f"vLLM's FlashMLA extension vllm._flashmla_C is missing: no vllm._flashmla_C under "
                       f"{tmp_path / 'vllm'}",
                       f"vLLM's FlashMLA FP8 extension vllm._flashmla_extension_C is missing: no "
                       f"vllm._flashmla_extension_C under {tmp_path / 'vllm'}"]
    assert not torch_loaded


def test_present_kernel_files_make_the_backend_eligible(tmp_path):
    _fake_vllm(tmp_path, {"vllm/v1/__init__.py": "", "vllm/v1/attention/__init__.py": "",
                          "vllm/v1/attention/ops/__init__.py": "",
                          "vllm/v1/attention/ops/triton_decode_attention.py": ""})
    reasons, torch_loaded = _reasons_in_subprocess(tmp_path, "TRITON_MLA", "Problem(16)")
    assert reasons == [] and not torch_loaded


def test_an_extension_that_fails_to_load_is_named_with_its_error(tmp_path, monkeypatch):
    from mla_tune.backends.vllm_kernels import load

    pkg = tmp_path / "vllm"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "_flashmla_C.py").write_text("raise ImportError('libcuda.so.1: cannot open shared object file')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for mod in [m for m in sys.modules if m == "vllm" or m.startswith("vllm.")]:
        monkeypatch.delitem(sys.modules, mod)
    try:
        with pytest.raises(BackendUnavailable) as err:
            load("vllm._flashmla_C")
    finally:   # the fake package must not outlive the test
        for mod in [m for m in sys.modules if m == "vllm" or m.startswith("vllm.")]:
            del sys.modules[mod]
    assert str(err.value) == ("vLLM's FlashMLA extension vllm._flashmla_C did not load: ImportError: "
                              "libcuda.so.1: cannot open shared object file")


def test_load_says_vllm_is_not_installed():
    from mla_tune.backends.vllm_kernels import load

    with pytest.raises(BackendUnavailable, match=r"^vllm is not installed \(No module named 'vllm'\)$"):
        load("vllm.third_party.flashmla.flash_mla_interface")


@pytest.mark.parametrize("name", VLLM_ADAPTERS)
def test_prepare_on_cpu_tensors_is_refused_with_a_reason(name):
    from mla_tune.backends.registry import load_adapter

    sparse = "SPARSE" in name
    problem = Problem(16, topk=64 if sparse else None, page_size=128 if name == "CUTLASS_MLA" else 64)
    inputs = make_inputs(problem, Shape(2, 200))
    with pytest.raises(BackendUnavailable, match="needs CUDA tensors"):
        load_adapter(name)().prepare(problem, inputs)


def test_sparse_adapters_refuse_dense_problems():
    from mla_tune.backends.vllm_kernels.flashmla import FlashMLASparse

    problem = Problem(16)
    with pytest.raises(BackendUnavailable, match="does not run dense problems"):
        FlashMLASparse().prepare(problem, make_inputs(problem, Shape(2, 100)))


def test_fp8_ds_mla_packing_is_vllms_656_byte_layout_and_exact():
    from mla_tune.backends.vllm_kernels.flashmla import DS_MLA_BYTES, pack_fp8_ds_mla

    problem = Problem(16, kv_cache_dtype="fp8_e4m3")
    inputs = make_inputs(problem, Shape(3, 300), seed=3)
    kv, scale = inputs.kv_cache, inputs.kv_scale
    packed = pack_fp8_ds_mla(kv, scale)
    assert packed.dtype == torch.uint8 and packed.shape == (*kv.shape[:2], DS_MLA_BYTES)
    assert torch.equal(packed[..., :512], kv[..., :512].view(torch.uint8))
    scales = packed[..., 512:528].contiguous().view(torch.float32)
    assert torch.equal(scales, torch.full_like(scales, scale))
    rope = packed[..., 528:].contiguous().view(torch.bfloat16).float()
    want = (kv[..., 512:].float() * scale).to(torch.bfloat16).float()
    assert torch.equal(rope, want)
    # Dequantised as FlashMLA reads it, it is the cache our reference reads.
    nope = packed[..., :512].contiguous().view(torch.float8_e4m3fn).float().view(*kv.shape[:2], 4, 128)
    deq = torch.cat([(nope * scales.unsqueeze(-1)).flatten(-2), rope], -1)
    ours = kv.float() * scale
    assert float((deq - ours).abs().max()) <= float(ours[..., 512:].abs().max()) * 2 ** -8


def test_head_padding_follows_vllm():
    from mla_tune.backends.vllm_kernels.flashmla import bf16_sparse_padded_heads, fp8_sparse_padded_heads

    assert [fp8_sparse_padded_heads(h) for h in (1, 16, 32, 64, 65, 128)] == [64, 64, 64, 64, 128, 128]
    assert [bf16_sparse_padded_heads(h) for h in (1, 16, 64, 65, 128)] == [64, 64, 64, 128, 128]


def test_global_slots_are_pages_times_page_size_plus_offset_valid_first():
    from mla_tune.backends.vllm_kernels import global_slots

    problem = Problem(16, topk=64, page_size=64)
    inputs = make_inputs(problem, Shape(3, 700), seed=2)
    slots, counts = global_slots(problem, inputs)
    idx = inputs.topk_indices
    for b in range(3):
        pos = idx[b, 0][idx[b, 0] >= 0]
        want = inputs.block_table[b, (pos // 64).long()] * 64 + pos % 64
        n = int(counts[b, 0])
        assert n == pos.numel()
        assert torch.equal(slots[b, 0, :n], want.to(torch.int32))
        assert bool((slots[b, 0, n:] == -1).all())


def test_fa3_dense_arguments_are_vllms():
    from mla_tune.backends.vllm_kernels.flash_attn import MAX_NUM_SPLITS_FOR_CUDA_GRAPH, dense_arguments, split_query

    problem = Problem(16, q_len=2)
    inputs = make_inputs(problem, Shape(3, 500), seed=1)
    cu = torch.arange(0, 8, 2, dtype=torch.int32)
    kwargs = dense_arguments(problem, inputs, cu_seqlens_q=cu, scheduler_metadata="meta")
    assert kwargs["max_seqlen_q"] == 2 and kwargs["max_seqlen_k"] == int(inputs.seq_lens.max())
    assert kwargs["causal"] is True and kwargs["fa_version"] == 3 and kwargs["return_softmax_lse"] is False
    assert kwargs["num_splits"] == MAX_NUM_SPLITS_FOR_CUDA_GRAPH == 32
    assert kwargs["seqused_k"] is inputs.seq_lens and kwargs["block_table"] is inputs.block_table
    q_nope, q_pe = split_query(inputs.q.view(6, 16, 576), 512)
    assert q_nope.shape == (6, 16, 512) and q_pe.shape == (6, 16, 64)
    assert q_pe.data_ptr() == inputs.q.data_ptr() + 512 * inputs.q.element_size()   # views, no copy


def test_triton_split_rule_and_causal_rows():
    from mla_tune.backends.vllm_kernels.triton import causal_rows, num_kv_splits

    assert [num_kv_splits(n, 132) for n in (1, 511, 512, 1024, 1500, 4096, 32768, 10 ** 7)] == \
        [1, 1, 1, 2, 2, 8, 64, 264]
    table = torch.tensor([[3, 4], [7, 8]], dtype=torch.int32)
    lens = torch.tensor([100, 70], dtype=torch.int32)
    rows_table, rows_lens = causal_rows(table, lens, 2)
    assert rows_table.tolist() == [[3, 4], [3, 4], [7, 8], [7, 8]]
    assert rows_lens.tolist() == [99, 100, 69, 70]


def test_flashinfer_sm90_plan_is_one_row_per_token_with_its_valid_slots():
    from mla_tune.backends.vllm_kernels.flashinfer_sm90 import plan_arrays

    problem = Problem(16, topk=128, q_len=2)
    inputs = make_inputs(problem, Shape(3, 300), seed=5)
    qo, kv_indptr, kv_indices, kv_lens = plan_arrays(problem, inputs)
    assert qo.tolist() == list(range(7))
    assert kv_indptr[-1] == kv_indices.numel() == int(kv_lens.sum())
    assert int((inputs.topk_indices >= 0).sum()) == kv_indices.numel()


def test_cutlass_refuses_what_vllm_rejects_and_builds_its_arguments():
    from mla_tune.backends.vllm_kernels.cutlass import cutlass_arguments, cutlass_refusal

    assert "page size 128" in cutlass_refusal(Problem(16, page_size=64), None)
    assert "at most 128 heads" in cutlass_refusal(Problem(256, page_size=128), None)
    assert "kv_scale 0.0206186" in cutlass_refusal(Problem(16, kv_cache_dtype="fp8_e4m3", page_size=128),
                                                     1 / 48.5)
    problem = Problem(16, page_size=128)
    assert cutlass_refusal(problem, None) is None
    inputs = make_inputs(problem, Shape(2, 300))
    args = cutlass_arguments(problem, inputs, workspace="ws")
    assert args["q_nope"].shape == (2, 16, 512) and args["q_pe"].shape == (2, 16, 64)
    assert args["kv_c_and_k_pe_cache"] is inputs.kv_cache and args["num_kv_splits"] == -1


def test_adopt_rotation_converts_every_set_and_skips_adapters_without_the_hook():
    seen = []

    class Converting:
        def adopt(self, inputs):
            seen.append(inputs)

    adopt_rotation(Converting(), ["a", "b"])
    adopt_rotation(object(), ["c"])
    assert seen == ["a", "b"]


def test_new_capabilities_give_sentences():
    fa4 = "FLASH_ATTN_MLA_SPARSE_FA4"
    reasons = backend_reasons(fa4, Problem(20, topk=2000), B200, check_packages=False)
    assert "num_heads 20 not in {8, 16, 32, 64, 128}" in reasons
    assert "top-k 2000 is not a multiple of 128" in reasons
    assert backend_reasons("FLASHINFER_MLA_SPARSE_SM90", Problem(64, kv_cache_dtype="fp8", topk=2048), H100,
                           check_packages=False) == []
