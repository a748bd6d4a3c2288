"""vLLM's static MLA priority at the pinned versions, checked against the rules written out here.

The expected lists below are typed from vLLM's `_get_backend_priorities` (commit
81be2e09, REFERENCE.md section 1; release 0.33.0, `vllm/platforms/cuda.py` and
`get_kv_quant_mode` of its wheel) independently of `backends/priority_tables.py`.
"""

from __future__ import annotations

import pytest

import mla_tune
from mla_tune import static_priority
from mla_tune.backends import priority
from mla_tune.backends.priority import StaticChoice, pinned_table, priority_rule, static_choice, table_for_installed
from mla_tune.backends.problem import DeviceSpec, Geometry, Problem

SM100_DENSE = ["FLASHINFER_MLA", "TOKENSPEED_MLA", "CUTLASS_MLA", "FLASH_ATTN_MLA", "FLASHMLA", "TRITON_MLA"]
OTHER_DENSE = ["FLASH_ATTN_MLA", "FLASHMLA", "FLASHINFER_MLA", "TRITON_MLA"]
SM120 = ["TRITON_MLA", "FLASHINFER_MLA_SPARSE_SM120"]

# Spellings both versions accept (mla-tune's own), then those only vLLM 0.33.0 has.
COMMON_DTYPES = ["auto", "bf16", "bfloat16", "float16", "fp16", "half", "fp8", "fp8_e4m3", "fp8_e4m3fn", "fp8_e5m2",
                 "fp8_inc", "fp8_ds_mla", "fp8_per_token_head", "fp8_e4m3_per_token_head", "int8_per_token_head",
                 "nvfp4", " FP8 "]
NEW_DTYPES = ["nvfp4_ds_mla", "nvfp4_4over6", "turboquant_k8v4", "turboquant_4bit_nc", "turboquant_k3v4_nc",
              "turboquant_3bit_nc", "octave_k3v4", "octave_k3v3", "octave_k3v3_compact", "ultraquant_4bit",
              "int4_per_token_head"]
HEADS = [None, 1, 8, 16, 17, 64, 128]
HEAD_SIZES = [None, 64, 511, 512, 513, 576]
MAJORS = [7, 8, 9, 10, 11, 12, 13]


def rule_81be2e09(major: int, dtype: str, heads: int | None) -> list[str]:
    raw = dtype.strip().lower()
    if major == 10:
        quantized = raw.startswith("fp8") or raw.endswith("per_token_head") or raw == "nvfp4"
        if quantized or (heads is not None and heads <= 16):
            return SM100_DENSE + ["FLASHINFER_MLA_SPARSE", "FLASHMLA_SPARSE"]
        return SM100_DENSE + ["FLASHMLA_SPARSE", "FLASHINFER_MLA_SPARSE"]
    if major == 12:
        return SM120
    return OTHER_DENSE + ["FLASH_ATTN_MLA_SPARSE", "FLASHMLA_SPARSE"]


def rule_0_33_0(major: int, dtype: str, heads: int | None, head_size: int | None) -> list[str]:
    raw = dtype.strip().lower()
    if major == 10:
        unquantized = {"auto", "bf16", "bfloat16", "float16", "fp16", "half"}
        if raw not in unquantized:
            return SM100_DENSE + ["FLASHINFER_MLA_SPARSE", "FLASHMLA_SPARSE"]
        if heads is not None and heads <= 16:
            return SM100_DENSE + ["FLASH_ATTN_MLA_SPARSE_FA4", "FLASHINFER_MLA_SPARSE", "FLASHMLA_SPARSE"]
        return SM100_DENSE + ["FLASHMLA_SPARSE", "FLASHINFER_MLA_SPARSE"]
    if major == 12:
        return SM120
    if head_size == 512:
        return OTHER_DENSE + ["FLASHINFER_MLA_SPARSE_SM90", "FLASH_ATTN_MLA_SPARSE", "FLASHMLA_SPARSE"]
    return OTHER_DENSE + ["FLASH_ATTN_MLA_SPARSE", "FLASHMLA_SPARSE", "FLASHINFER_MLA_SPARSE_SM90"]


@pytest.mark.parametrize("major", MAJORS)
@pytest.mark.parametrize("version", ["81be2e09", "81be2e09aebf"])
def test_commit_81be2e09_table_on_every_branch(version, major):
    for minor in (0, 3):  # SM100/SM103, SM120/SM121-style minors change nothing
        for dtype in COMMON_DTYPES:
            for heads in HEADS:
                for head_size in HEAD_SIZES:
                    got = static_priority(compute_capability=(major, minor), kv_cache_dtype=dtype, num_heads=heads,
                                          head_size=head_size, vllm_version=version)
                    assert got == rule_81be2e09(major, dtype, heads), (major, minor, dtype, heads, head_size)


@pytest.mark.parametrize("major", MAJORS)
@pytest.mark.parametrize("version", ["0.33.0", "v0.33.0", "4ba787ec"])
def test_release_0_33_0_table_on_every_branch(version, major):
    for minor in (0, 3):
        for dtype in COMMON_DTYPES + NEW_DTYPES:
            for heads in HEADS:
                for head_size in HEAD_SIZES:
                    got = static_priority(compute_capability=(major, minor), kv_cache_dtype=dtype, num_heads=heads,
                                          head_size=head_size, vllm_version=version)
                    assert got == rule_0_33_0(major, dtype, heads, head_size), (major, minor, dtype, heads, head_size)


def test_the_tables_differ_where_the_release_changed_the_rule():
    def both(**kw):
        return [static_priority(**kw, vllm_version=v) for v in ("81be2e09", "0.33.0")]

    old, new = both(compute_capability=(10, 0), kv_cache_dtype="auto", num_heads=16)
    assert old[-2:] == ["FLASHINFER_MLA_SPARSE", "FLASHMLA_SPARSE"]
    assert new[-3:] == ["FLASH_ATTN_MLA_SPARSE_FA4", "FLASHINFER_MLA_SPARSE", "FLASHMLA_SPARSE"]
    old, new = both(compute_capability=(9, 0), kv_cache_dtype="fp8", num_heads=64, head_size=576)
    assert "FLASHINFER_MLA_SPARSE_SM90" not in old and new[-1] == "FLASHINFER_MLA_SPARSE_SM90"
    old, new = both(compute_capability=(9, 0), kv_cache_dtype="fp8", num_heads=64, head_size=512)
    assert new[4] == "FLASHINFER_MLA_SPARSE_SM90" and old[4] == "FLASH_ATTN_MLA_SPARSE"


@pytest.mark.parametrize("dtype", NEW_DTYPES)
def test_spellings_new_in_0_33_0_are_rejected_for_the_older_commit(dtype):
    with pytest.raises(ValueError, match="vLLM commit 81be2e09aebf"):
        static_priority(compute_capability=(10, 0), kv_cache_dtype=dtype, num_heads=128, vllm_version="81be")


@pytest.mark.parametrize("version", ["0.33", "0.32.0", "81b", "81be2e0a", "dead", "4ba787ec9x", "latest"])
def test_unknown_version_names_the_known_ones(version):
    with pytest.raises(ValueError, match=r"unknown vllm_version .*release 0\.33\.0.*commit 81be2e09aebf"):
        static_priority(compute_capability=(9, 0), kv_cache_dtype="auto", num_heads=64, vllm_version=version)


@pytest.mark.parametrize("version", ["", "  ", 33, ("0", "33")])
def test_version_that_is_not_a_string_is_refused(version):
    with pytest.raises(ValueError, match="vllm_version must be"):
        static_priority(compute_capability=(9, 0), kv_cache_dtype="auto", num_heads=64, vllm_version=version)


@pytest.mark.parametrize(("prefix", "label"), [("81be", "vLLM commit 81be2e09aebf"),
                                               ("81BE2E09", "vLLM commit 81be2e09aebf"),
                                               ("81be2e09aebf" + "7" * 28, "vLLM commit 81be2e09aebf"),
                                               ("4ba787ec9", "vLLM 0.33.0"), ("0.33.0", "vLLM 0.33.0")])
def test_commit_prefixes_and_release_resolve(prefix, label):
    assert pinned_table(prefix).label == label
    assert priority_rule(prefix).description == f"mla-tune's pinned table for {label}"
    assert priority_rule(prefix).source == "pinned"


@pytest.mark.parametrize(("installed", "table"), [("0.33.0", "0.33.0"), ("0.33.0+cu130", "0.33.0"),
                                                  ("0.34.0.dev3+g81be2e09a", "81be2e09aebf"),
                                                  ("0.34.0.dev3+g81be2e09a.d20260806", "81be2e09aebf"),
                                                  ("0.34.0", None), ("0.34.0.dev1+gdeadbeef1", None)])
def test_installed_version_strings_map_to_a_pinned_table(installed, table):
    found = table_for_installed(installed)
    assert (found.version if found else None) == table


def test_without_vllm_the_newest_pinned_table_answers_and_says_so(monkeypatch):
    from importlib import metadata

    def missing(name):
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(metadata, "version", missing)
    priority._installed_rule.cache_clear()
    try:
        rule = priority_rule(None)
        assert (rule.vllm_version, rule.source) == ("0.33.0", "pinned")
        assert rule.description == ("mla-tune's pinned table for vLLM 0.33.0, the newest it knows "
                                    "(vLLM is not installed here)")
        assert static_priority(compute_capability=(10, 0), kv_cache_dtype="auto", num_heads=8) == \
            rule_0_33_0(10, "auto", 8, None)
    finally:
        priority._installed_rule.cache_clear()


def test_an_installed_vllm_that_is_not_loaded_or_cannot_be_loaded_falls_back_to_a_pinned_table(monkeypatch):
    """vLLM is not importable here, so only its version is faked: importing it then fails."""
    import importlib.util
    from importlib import metadata

    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed here; tests/backends/test_priority_vllm.py covers it")
    cases = [("0.33.0", "mla-tune's pinned table for vLLM 0.33.0, the installed version (vLLM is not loaded in "
                        "this process, and importing it only to ask would cost seconds)"),
             ("0.40.0", "mla-tune's pinned table for vLLM 0.33.0, the newest it knows; the installed vLLM 0.40.0 "
                        "has no pinned table and its own rule could not be loaded (ModuleNotFoundError: No module "
                        "named 'vllm'), so its order may differ")]
    for installed, description in cases:
        monkeypatch.setattr(metadata, "version", lambda name, v=installed: v)
        priority._installed_rule.cache_clear()
        try:
            rule = priority_rule(None)
            assert (rule.vllm_version, rule.source, rule.description) == ("0.33.0", "pinned", description)
            assert rule.table.version == "0.33.0" and rule.function is None
        finally:
            priority._installed_rule.cache_clear()


@pytest.mark.parametrize("bad", [dict(compute_capability="nine", kv_cache_dtype="auto"),
                                 dict(compute_capability=(9, 0), kv_cache_dtype="fp7"),
                                 dict(compute_capability=(9, 0), kv_cache_dtype=None),
                                 dict(compute_capability=(9, 0), kv_cache_dtype="turboquant_k9v9"),
                                 dict(compute_capability=(9, 0), kv_cache_dtype="auto", num_heads=0),
                                 dict(compute_capability=(9, 0), kv_cache_dtype="auto", num_heads=True),
                                 dict(compute_capability=(9, 0), kv_cache_dtype="auto", head_size=-512),
                                 dict(compute_capability=(9, 0), kv_cache_dtype="auto", head_size=512.0)])
@pytest.mark.parametrize("version", [None, "0.33.0", "81be2e09"])
def test_static_priority_rejects_bad_arguments(bad, version):
    with pytest.raises(ValueError):
        static_priority(**bad, vllm_version=version)


def test_public_export_is_the_module_function():
    assert mla_tune.static_priority is priority.static_priority


def test_static_choice_is_first_eligible_entry_and_lists_skipped():
    # H100, FP8 dense: FLASH_ATTN_MLA cannot take FP8, so it is skipped with that reason.
    problem = Problem(num_heads=64, kv_cache_dtype="fp8")
    for version in ("81be2e09", "0.33.0"):
        static = static_choice(problem, DeviceSpec("NVIDIA H100 80GB HBM3", (9, 0)), kv_cache_spelling="fp8",
                               vllm_version=version)
        assert isinstance(static, StaticChoice)
        assert "FLASH_ATTN_MLA" in static.skipped
        assert any("kv_cache_dtype fp8_e4m3" in r for r in static.skipped["FLASH_ATTN_MLA"])
        order = static_priority(compute_capability=(9, 0), kv_cache_dtype="fp8", num_heads=64, head_size=576,
                                vllm_version=version)
        assert list(static.order) == order
        assert static.backend is not None and static.backend in order
        assert list(static.skipped) == order[:order.index(static.backend)]
        assert static.vllm_version == pinned_table(version).version
        assert static.rule == f"mla-tune's pinned table for {pinned_table(version).label}"


def test_static_choice_passes_the_geometry_head_size():
    nope = Problem(num_heads=64, kv_cache_dtype="fp8_ds_mla", topk=2048,
                   geometry=Geometry(kv_lora_rank=512, qk_rope_head_dim=0))
    static = static_choice(nope, DeviceSpec("NVIDIA H100 80GB HBM3", (9, 0)), vllm_version="0.33.0")
    assert static.order[4] == "FLASHINFER_MLA_SPARSE_SM90"
    deepseek = static_choice(nope.replace(geometry=Geometry()), DeviceSpec("NVIDIA H100 80GB HBM3", (9, 0)),
                             vllm_version="0.33.0")
    assert deepseek.order[-1] == "FLASHINFER_MLA_SPARSE_SM90"


def test_a_name_the_registry_does_not_know_is_skipped_with_a_sentence(monkeypatch):
    from mla_tune.backends import registry

    # As a registry without the names vLLM 0.33.0 added: the B200 bf16 sparse list at 16 heads starts its tail
    # with FLASH_ATTN_MLA_SPARSE_FA4.
    trimmed = {k: v for k, v in registry.BACKENDS.items() if k not in ("FLASH_ATTN_MLA_SPARSE_FA4",
                                                                       "FLASHINFER_MLA_SPARSE_SM90")}
    monkeypatch.setattr(registry, "BACKENDS", trimmed)
    problem = Problem(num_heads=16, kv_cache_dtype="bf16", topk=2048)
    static = static_choice(problem, DeviceSpec("NVIDIA B200", (10, 0)), vllm_version="0.33.0")
    text = static.skipped["FLASH_ATTN_MLA_SPARSE_FA4"][0]
    assert "FLASH_ATTN_MLA_SPARSE_FA4 is in the priority list of mla-tune's pinned table for vLLM 0.33.0" in text
    assert "does not know it" in text
    assert static.backend == "FLASHINFER_MLA_SPARSE"


def test_static_choice_none_lists_every_backend_on_ampere_sparse():
    problem = Problem(num_heads=128, kv_cache_dtype="bf16", topk=2048)
    for version in ("81be2e09", "0.33.0"):
        static = static_choice(problem, DeviceSpec("NVIDIA A100-SXM4-80GB", (8, 0)), vllm_version=version)
        assert static.backend is None
        assert list(static.skipped) == list(static.order)
        assert all(static.skipped.values())


def test_fallback_lookup_why_names_the_rule(tmp_path):
    from mla_tune.store.repository import Store

    url = f"sqlite:///{tmp_path / 'empty.db'}"
    Store.open(url).close()
    choice = mla_tune.lookup(64, "fp8", device={"name": "NVIDIA H100 80GB HBM3", "compute_capability": (9, 0)},
                             db=url)
    rule = priority_rule(None)
    assert choice.source == "fallback"
    assert choice.why.endswith(f"; vLLM's static choice by {rule.description}")
    assert rule.vllm_version in choice.why
