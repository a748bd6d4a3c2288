"""vLLM's static MLA priority (REFERENCE.md section 1), checked against the rule written out here.

The expected lists below are typed from vLLM's `_get_backend_priorities` at
commit 81be2e09 independently of `backends/priority.py`.
"""

from __future__ import annotations

import pytest

from mla_tune import static_priority
from mla_tune.backends.priority import static_choice
from mla_tune.backends.problem import DeviceSpec, Problem

CACHE_DTYPES = ["auto", "float16", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2", "fp8_inc", "fp8_ds_mla",
                "fp8_per_token_head", "int8_per_token_head", "nvfp4"]
HEADS = [None, 8, 16, 17, 64, 128]
MAJORS = [8, 9, 10, 11, 12]


def vllm_rule(major: int, cache_dtype: str, heads: int | None) -> list[str]:
    if major == 10:
        quantized = (cache_dtype.startswith("fp8") or cache_dtype.endswith("per_token_head")
                     or cache_dtype == "nvfp4")
        dense = ["FLASHINFER_MLA", "TOKENSPEED_MLA", "CUTLASS_MLA", "FLASH_ATTN_MLA", "FLASHMLA", "TRITON_MLA"]
        if quantized or (heads is not None and heads <= 16):
            return dense + ["FLASHINFER_MLA_SPARSE", "FLASHMLA_SPARSE"]
        return dense + ["FLASHMLA_SPARSE", "FLASHINFER_MLA_SPARSE"]
    if major == 12:
        return ["TRITON_MLA", "FLASHINFER_MLA_SPARSE_SM120"]
    return ["FLASH_ATTN_MLA", "FLASHMLA", "FLASHINFER_MLA", "TRITON_MLA", "FLASH_ATTN_MLA_SPARSE",
            "FLASHMLA_SPARSE"]


@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES)
@pytest.mark.parametrize("major", MAJORS)
def test_static_priority_matches_vllm(major, cache_dtype, heads):
    for minor in (0, 3):  # SM100/SM103, SM120/SM121-style minors change nothing
        got = static_priority(compute_capability=(major, minor), kv_cache_dtype=cache_dtype, num_heads=heads)
        assert got == vllm_rule(major, cache_dtype, heads)


def test_sm100_unquantized_sparse_tail_flips_at_16_heads():
    sixteen = static_priority(compute_capability=(10, 0), kv_cache_dtype="auto", num_heads=16)
    seventeen = static_priority(compute_capability=(10, 0), kv_cache_dtype="auto", num_heads=17)
    assert sixteen[-2:] == ["FLASHINFER_MLA_SPARSE", "FLASHMLA_SPARSE"]
    assert seventeen[-2:] == ["FLASHMLA_SPARSE", "FLASHINFER_MLA_SPARSE"]


@pytest.mark.parametrize("bad", [dict(compute_capability="nine", kv_cache_dtype="auto"),
                                 dict(compute_capability=(9, 0), kv_cache_dtype="fp7"),
                                 dict(compute_capability=(9, 0), kv_cache_dtype="auto", num_heads=0),
                                 dict(compute_capability=(9, 0), kv_cache_dtype="auto", num_heads=True)])
def test_static_priority_rejects_bad_arguments(bad):
    with pytest.raises(ValueError):
        static_priority(**bad)


def test_static_choice_is_first_eligible_entry_and_lists_skipped():
    # H100, FP8 dense: FLASH_ATTN_MLA cannot take FP8, so it is skipped with that reason.
    problem = Problem(num_heads=64, kv_cache_dtype="fp8")
    winner, skipped = static_choice(problem, DeviceSpec("NVIDIA H100 80GB HBM3", (9, 0)), kv_cache_spelling="fp8")
    assert "FLASH_ATTN_MLA" in skipped
    assert any("kv_cache_dtype fp8_e4m3" in r for r in skipped["FLASH_ATTN_MLA"])
    order = static_priority(compute_capability=(9, 0), kv_cache_dtype="fp8", num_heads=64)
    assert winner is not None and winner in order
    assert list(skipped) == order[:order.index(winner)]


def test_static_choice_none_lists_every_backend_on_ampere_sparse():
    problem = Problem(num_heads=128, kv_cache_dtype="bf16", topk=2048)
    winner, skipped = static_choice(problem, DeviceSpec("NVIDIA A100-SXM4-80GB", (8, 0)))
    assert winner is None
    assert list(skipped) == vllm_rule(8, "bf16", 128)
    assert all(skipped.values())
