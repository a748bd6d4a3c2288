"""Eligibility reasons of every backend on SM80, SM89, SM90, SM100 and SM120 (REFERENCE.md section 2)."""

from __future__ import annotations

import itertools

import pytest

from mla_tune.backends.capabilities import Capabilities, eligibility_reasons
from mla_tune.backends.problem import DeviceSpec, Geometry, Problem
from mla_tune.backends.registry import BACKENDS, backend_reasons

DEVICES = {
    "SM80": DeviceSpec("NVIDIA A100-SXM4-80GB", (8, 0)),
    "SM89": DeviceSpec("NVIDIA L40S", (8, 9)),
    "SM90": DeviceSpec("NVIDIA H100 80GB HBM3", (9, 0)),
    "SM100": DeviceSpec("NVIDIA B200", (10, 0)),
    "SM120": DeviceSpec("NVIDIA RTX PRO 6000 Blackwell Server Edition", (12, 0)),
}

# Dense DeepSeek decode, bf16 KV, 64 heads, page 64: who can run it (packages aside). TRITON_MLA is vLLM's
# Triton kernel (any compute capability), MLA_TUNE_TRITON ours.
DENSE_BF16_ELIGIBLE = {
    "SM80": {"FLASHINFER_FA2_MLA", "TRITON_MLA", "MLA_TUNE_TRITON", "TORCH_REFERENCE"},
    "SM89": {"FLASHINFER_FA2_MLA", "TRITON_MLA", "MLA_TUNE_TRITON", "TORCH_REFERENCE"},
    "SM90": {"FLASHINFER_FA2_MLA", "FLASHINFER_FA3_MLA", "FLASHMLA", "FLASH_ATTN_MLA", "TRITON_MLA",
             "MLA_TUNE_TRITON", "TORCH_REFERENCE"},
    "SM100": {"FLASHINFER_MLA", "FLASHINFER_FA2_MLA", "TRITON_MLA", "MLA_TUNE_TRITON", "TORCH_REFERENCE"},
    "SM120": {"FLASHINFER_FA2_MLA", "TRITON_MLA", "MLA_TUNE_TRITON", "TORCH_REFERENCE"},
}
# Sparse (top-k 2048) DeepSeek-V3.2 decode, bf16 KV, 64 heads, page 64.
SPARSE_BF16_ELIGIBLE = {
    "SM80": {"FLASHINFER_FA2_MLA_SPARSE", "MLA_TUNE_TRITON_SPARSE", "TORCH_REFERENCE"},
    "SM89": {"FLASHINFER_FA2_MLA_SPARSE", "MLA_TUNE_TRITON_SPARSE", "TORCH_REFERENCE"},
    "SM90": {"FLASHINFER_FA2_MLA_SPARSE", "FLASHINFER_FA3_MLA_SPARSE", "FLASHMLA_SPARSE",
             "FLASH_ATTN_MLA_SPARSE", "FLASHINFER_MLA_SPARSE_SM90", "MLA_TUNE_TRITON_SPARSE", "TORCH_REFERENCE"},
    "SM100": {"FLASHINFER_MLA_SPARSE", "FLASHMLA_SPARSE", "FLASH_ATTN_MLA_SPARSE_FA4", "FLASHINFER_FA2_MLA_SPARSE",
              "MLA_TUNE_TRITON_SPARSE", "TORCH_REFERENCE"},
    "SM120": {"FLASHINFER_MLA_SPARSE_SM120", "FLASHINFER_FA2_MLA_SPARSE", "MLA_TUNE_TRITON_SPARSE",
              "TORCH_REFERENCE"},
}


def eligible(problem: Problem, device: DeviceSpec) -> set[str]:
    return {name for name in BACKENDS if not backend_reasons(name, problem, device, check_packages=False)}


@pytest.mark.parametrize("sm", list(DEVICES))
def test_dense_bf16_eligibility_per_architecture(sm):
    problem = Problem(num_heads=64, kv_cache_dtype="bf16")
    assert eligible(problem, DEVICES[sm]) == DENSE_BF16_ELIGIBLE[sm]


@pytest.mark.parametrize("sm", list(DEVICES))
def test_sparse_bf16_eligibility_per_architecture(sm):
    problem = Problem(num_heads=64, kv_cache_dtype="bf16", topk=2048)
    assert eligible(problem, DEVICES[sm]) == SPARSE_BF16_ELIGIBLE[sm]


@pytest.mark.parametrize("sm", list(DEVICES))
def test_every_ineligible_backend_says_why_with_the_observed_value(sm):
    device = DEVICES[sm]
    problem = Problem(num_heads=64, kv_cache_dtype="bf16")
    for name in set(BACKENDS) - DENSE_BF16_ELIGIBLE[sm]:
        reasons = backend_reasons(name, problem, device, check_packages=False)
        assert reasons, name
        for reason in reasons:
            assert reason[0].islower() or reason[0].isupper()
            assert len(reason.split()) >= 4, f"{name}: {reason!r} is not a sentence"
        cc_reasons = [r for r in reasons if "compute capability" in r]
        assert all(device.cc_label in r for r in cc_reasons), (name, cc_reasons)


def test_fp8_kv_on_hopper_only_for_flashinfer_fa2():
    problem = Problem(num_heads=64, kv_cache_dtype="fp8")
    assert not backend_reasons("FLASHINFER_FA2_MLA", problem, DEVICES["SM90"], check_packages=False)
    reasons = backend_reasons("FLASHINFER_FA2_MLA", problem, DEVICES["SM80"], check_packages=False)
    assert reasons == ["FP8 KV cache is not supported on compute capability 8.0 (only major {9})"]


def test_triton_fp8_kv_needs_sm89_where_triton_has_e4m3():
    for name, topk in (("MLA_TUNE_TRITON", None), ("MLA_TUNE_TRITON_SPARSE", 2048), ("TRITON_MLA", None)):
        fp8, bf16 = (Problem(num_heads=16, kv_cache_dtype=kv, topk=topk) for kv in ("fp8", "bf16"))
        assert backend_reasons(name, fp8, DEVICES["SM80"], check_packages=False) == [
            "FP8 KV cache needs compute capability 8.9 or newer, got 8.0"]
        assert not backend_reasons(name, fp8, DEVICES["SM89"], check_packages=False)
        assert not backend_reasons(name, bf16, DEVICES["SM80"], check_packages=False)


def test_fp8_kv_needs_a_bf16_query():
    problem = Problem(num_heads=64, kv_cache_dtype="fp8", query_dtype="fp16")
    reasons = backend_reasons("MLA_TUNE_TRITON", problem, DEVICES["SM90"], check_packages=False)
    assert reasons == ["FP8 KV cache needs a bf16 query, got fp16"]
    # vLLM's Triton kernel reads an fp16 query with an FP8 cache (its class lists both).
    assert backend_reasons("TRITON_MLA", problem, DEVICES["SM90"], check_packages=False) == []


def test_flashinfer_trtllm_gen_cannot_tile_65_to_127_heads():
    device = DEVICES["SM100"]
    for heads, ok in ((64, True), (65, False), (96, False), (127, False), (128, True)):
        reasons = backend_reasons("FLASHINFER_MLA", Problem(num_heads=heads), device, check_packages=False)
        assert (not reasons) == ok, (heads, reasons)
    assert backend_reasons("FLASHINFER_MLA", Problem(num_heads=96), device, check_packages=False) == [
        "num_heads 96 is in 65..127, which the kernel cannot tile"]


def test_page_size_limits_name_the_page_size():
    device = DEVICES["SM100"]
    assert backend_reasons("CUTLASS_MLA", Problem(num_heads=128, page_size=128), device, check_packages=False) == []
    assert backend_reasons("CUTLASS_MLA", Problem(num_heads=128, page_size=64), device,
                           check_packages=False) == ["page_size 64 not in {128}"]
    assert backend_reasons("TRITON_MLA", Problem(num_heads=16, page_size=24), device,
                           check_packages=False) == ["page_size 24 is not a multiple of 16"]


def test_tokenspeed_takes_fp8_only():
    device = DEVICES["SM100"]
    assert backend_reasons("TOKENSPEED_MLA", Problem(num_heads=16, kv_cache_dtype="fp8"), device,
                           check_packages=False) == []
    assert backend_reasons("TOKENSPEED_MLA", Problem(num_heads=16), device,
                           check_packages=False) == ["kv_cache_dtype bf16 not in {fp8_e4m3}"]


def test_sm120_sparse_needs_top_k_2048():
    reasons = backend_reasons("FLASHINFER_MLA_SPARSE_SM120", Problem(num_heads=64, topk=1024), DEVICES["SM120"],
                              check_packages=False)
    assert reasons == ["top-k 1024 not in {2048}"]


def test_glm5_geometry():
    glm5 = Geometry(qk_nope_head_dim=192, v_head_dim=256)
    device = DEVICES["SM100"]
    assert not backend_reasons("FLASHINFER_MLA_SPARSE", Problem(num_heads=64, topk=2048, geometry=glm5), device,
                               check_packages=False)
    assert backend_reasons("TOKENSPEED_MLA", Problem(num_heads=64, kv_cache_dtype="fp8", geometry=glm5), device,
                           check_packages=False) == ["qk_nope_head_dim 192 not in {128}"]


def test_missing_package_reason_carries_the_import_error_text():
    caps = Capabilities(required_modules=("mla_tune_no_such_kernel_library",))
    reasons = eligibility_reasons(caps, Problem(num_heads=16), DEVICES["SM90"])
    assert reasons == ["mla_tune_no_such_kernel_library is not installed "
                       "(No module named 'mla_tune_no_such_kernel_library')"]
    broken_parent = Capabilities(required_modules=("mla_tune_no_such_pkg.sub",))
    assert "mla_tune_no_such_pkg is not installed" in eligibility_reasons(
        broken_parent, Problem(num_heads=16), DEVICES["SM90"])[0]


def _vllm_installed() -> bool:
    from importlib import metadata

    try:
        return bool(metadata.version("vllm"))
    except metadata.PackageNotFoundError:
        return False


def test_vllm_only_backends_say_vllm_is_missing_when_it_is():
    if _vllm_installed():
        pytest.skip("vllm is installed here")
    reasons = backend_reasons("FLASH_ATTN_MLA", Problem(num_heads=64), DEVICES["SM90"])
    assert reasons == ["vllm is not installed (No module named 'vllm')"]


def test_a_folder_named_like_a_package_is_not_the_package(tmp_path, monkeypatch):
    # A folder `vllm/` without __init__.py on sys.path (a test folder, a config folder in the working
    # directory) imports as a namespace package; it holds none of vLLM's kernels.
    if _vllm_installed():
        pytest.skip("vllm is installed here, and a real package wins over a namespace folder")
    (tmp_path / "vllm" / "v1").mkdir(parents=True)
    monkeypatch.syspath_prepend(str(tmp_path))
    reasons = backend_reasons("TRITON_MLA", Problem(num_heads=64), DEVICES["SM90"])
    (reason,) = reasons
    assert reason.startswith(f"vllm is not installed (no vllm/__init__.py in {tmp_path / 'vllm'}")
    assert reason.endswith(": a folder of that name, not the package)")


def test_eligibility_never_raises_over_a_grid():
    heads = (1, 17, 100, 256)
    dtypes = ("bf16", "fp16", "fp8", "fp8_e5m2", "fp8_ds_mla", "nvfp4", "int8_per_token_head")
    for (sm, device), h, kv, topk, page in itertools.product(
            list(DEVICES.items()) + [("none", None)], heads, dtypes, (None, 2048), (1, 64, 128)):
        problem = Problem(num_heads=h, kv_cache_dtype=kv, topk=topk, page_size=page)
        for name in BACKENDS:
            reasons = backend_reasons(name, problem, device, check_packages=False)
            assert isinstance(reasons, list) and all(isinstance(r, str) and r for r in reasons)
