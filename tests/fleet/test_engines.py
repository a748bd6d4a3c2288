"""Engine name mapping and `--engine` ranking from stored scores."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
import fleet_data  # noqa: E402

from mla_tune.backends.registry import BACKENDS  # noqa: E402
from mla_tune.engines import (choice_for_engine, choose_for_engine, engine_backends, engine_name,  # noqa: E402
                              engine_table_markdown, rank_for_engine)

DOCS = Path(__file__).resolve().parents[2] / "docs" / "fleet.md"


def test_the_documented_table_is_the_registry():
    assert engine_table_markdown() in DOCS.read_text(), "docs/fleet.md's mapping table is out of date"


def test_every_mapped_name_comes_from_the_registry():
    assert engine_backends("vllm") == {n: i.vllm_name for n, i in BACKENDS.items() if i.vllm_name}
    assert engine_name("FLASHINFER_FA3_MLA", "vllm") is None
    assert engine_name("FLASHINFER_FA3_MLA", "sglang") == "flashinfer"
    # Our kernel has no vLLM name of its own: vLLM runs it only through our plugin.
    assert engine_name("MLA_TUNE_TRITON", "vllm") is None
    assert engine_name("MLA_TUNE_TRITON", "vllm", with_plugin=True) == "MLA_TUNE_TRITON"
    with pytest.raises(ValueError, match="unknown engine 'trt'"):
        engine_name("TRITON_MLA", "trt")
    with pytest.raises(ValueError, match="unknown backend"):
        engine_name("NOPE", "vllm")


def test_ranking_keeps_only_the_engines_own_kernels_best_first():
    scores = {"FLASHINFER_FA3_MLA": 1.0, "MLA_TUNE_TRITON": 1.1, "TRITON_MLA": 1.4, "FLASHMLA": 1.2,
              "CUTLASS_MLA": float("inf")}
    assert rank_for_engine(scores, "vllm") == [("FLASHMLA", "FLASHMLA", 1.2), ("TRITON_MLA", "TRITON_MLA", 1.4)]
    assert [r[0] for r in rank_for_engine(scores, "vllm", with_plugin=True)][:2] == ["MLA_TUNE_TRITON", "FLASHMLA"]


SCORES = {"MLA_TUNE_TRITON": 1.0, "FLASHMLA": 1.3, "FLASH_ATTN_MLA": 1.5, "TRITON_MLA": 3.0}


def test_vllm_gets_its_fastest_own_kernel_with_how_far_it_is_from_the_fastest():
    got = choose_for_engine(winner="MLA_TUNE_TRITON", scores=SCORES, engine="vllm",
                            engine_best={"vllm": "FLASHMLA"}, static_choice="FLASH_ATTN_MLA",
                            plugin_missing="vLLM is not installed in this environment")
    assert (got.backend, got.engine_backend, got.basis) == ("FLASHMLA", "FLASHMLA", "engine_best")
    assert "1.30x the time of the fastest kernel MLA_TUNE_TRITON" in got.reason
    assert "static choice FLASH_ATTN_MLA takes 1.15x its time" in got.reason
    assert "MLA_TUNE_TRITON cannot go to vLLM here: vLLM is not installed" in got.reason


def test_our_kernel_goes_to_vllm_only_where_the_plugin_is_installed():
    got = choose_for_engine(winner="MLA_TUNE_TRITON", scores=SCORES, engine="vllm",
                            engine_best={"vllm": "FLASHMLA"}, static_choice="FLASH_ATTN_MLA", plugin_missing=None,
                            plugin_scores={"MLA_TUNE_TRITON": 1.04})
    assert (got.engine_backend, got.basis, got.score) == ("MLA_TUNE_TRITON", "winner", 1.04)
    assert "through mla-tune's plugin" in got.reason
    assert "as vLLM launches it takes 1.04x the time of the fastest kernel" in got.reason
    assert "vLLM's fastest own backend FLASHMLA 1.30x" in got.reason


def test_our_kernel_whose_vllm_launch_is_slower_than_vllms_best_is_not_handed_to_vllm():
    got = choose_for_engine(winner="MLA_TUNE_TRITON", scores=SCORES, engine="vllm",
                            engine_best={"vllm": "FLASHMLA"}, static_choice="FLASH_ATTN_MLA", plugin_missing=None,
                            plugin_scores={"MLA_TUNE_TRITON": 1.35})
    assert (got.engine_backend, got.basis, got.score) == ("FLASHMLA", "engine_best", 1.3)
    assert "MLA_TUNE_TRITON as vLLM launches it takes 1.35x the time of the fastest kernel; FLASHMLA 1.30x" \
        in got.reason
    tie = choose_for_engine(winner="MLA_TUNE_TRITON", scores=SCORES, engine="vllm", engine_best={"vllm": "FLASHMLA"},
                            plugin_missing=None, plugin_scores={"MLA_TUNE_TRITON": 1.3})
    assert tie.engine_backend == "FLASHMLA"      # ours must beat vLLM's own best, not match it


def test_a_decision_that_never_timed_the_vllm_launch_does_not_hand_our_kernel_to_vllm():
    got = choose_for_engine(winner="MLA_TUNE_TRITON", scores=SCORES, engine="vllm",
                            engine_best={"vllm": "FLASHMLA"}, plugin_missing=None, plugin_scores=None)
    assert (got.engine_backend, got.basis) == ("FLASHMLA", "engine_best")
    assert "did not; re-run `mla-tune` to tune again" in got.reason
    missing = choose_for_engine(winner="MLA_TUNE_TRITON", scores=SCORES, engine="vllm",
                                engine_best={"vllm": "FLASHMLA"}, plugin_missing=None, plugin_scores={})
    assert missing.engine_backend == "FLASHMLA"
    assert "was not timed as vLLM launches it at every shape" in missing.reason


def test_with_no_vllm_backend_timed_our_vllm_launch_is_handed_on_its_own_score():
    got = choose_for_engine(winner="MLA_TUNE_TRITON", scores={"MLA_TUNE_TRITON": 1.0, "FLASHINFER_FA2_MLA": 1.2},
                            engine="vllm", engine_best={}, plugin_missing=None, plugin_scores={"MLA_TUNE_TRITON": 1.1})
    assert (got.engine_backend, got.score) == ("MLA_TUNE_TRITON", 1.1)


def test_our_kernel_is_not_handed_to_vllm_for_a_key_our_vllm_backend_refuses():
    # Sparse with 16-token pages: our vLLM sparse backend needs blocks of a multiple of 64 tokens, so vLLM gets its
    # own fastest backend even with the plugin installed.
    key = {"sku": "H100", "compute_capability": "9.0", "query_dtype": "bf16", "kv_cache_dtype": "bf16",
           "num_heads": 16, "geometry": "512/64/128/128", "page_size": 16, "topk": 2048, "q_len": 1}
    got = choose_for_engine(winner="MLA_TUNE_TRITON_SPARSE", scores={"MLA_TUNE_TRITON_SPARSE": 1.0,
                            "FLASHMLA_SPARSE": 1.87}, engine="vllm", engine_best={"vllm": "FLASHMLA_SPARSE"},
                            static_choice="FLASHMLA_SPARSE", plugin_missing=None, key=key,
                            plugin_scores={"MLA_TUNE_TRITON_SPARSE": 1.0})
    assert (got.engine_backend, got.basis) == ("FLASHMLA_SPARSE", "engine_best")
    assert "needs a block size that is a multiple of 64; got 16" in got.reason
    fits = choose_for_engine(winner="MLA_TUNE_TRITON_SPARSE", scores={"MLA_TUNE_TRITON_SPARSE": 1.0,
                             "FLASHMLA_SPARSE": 1.87}, engine="vllm", engine_best={"vllm": "FLASHMLA_SPARSE"},
                             plugin_missing=None, key=dict(key, page_size=64),
                             plugin_scores={"MLA_TUNE_TRITON_SPARSE": 1.0})
    assert fits.engine_backend == "MLA_TUNE_TRITON_SPARSE"


@pytest.mark.parametrize("kv_cache_dtype", ["fp8_e4m3", "fp8_ds_mla"])
def test_sparse_fp8_keys_go_to_our_vllm_backend_which_reads_that_cache_as_timed(kv_cache_dtype):
    # fp8_e4m3: vLLM hands our backend 576 e4m3 values with k_scale (it converts fp8 to fp8_ds_mla for
    # FLASHMLA_SPARSE only); fp8_ds_mla: the 656-byte rows, which the tuner times our kernel on.
    key = {"sku": "H100", "compute_capability": "9.0", "query_dtype": "bf16", "kv_cache_dtype": kv_cache_dtype,
           "num_heads": 16, "geometry": "512/64/128/128", "page_size": 64, "topk": 2048, "q_len": 1}
    got = choose_for_engine(winner="MLA_TUNE_TRITON_SPARSE", scores={"MLA_TUNE_TRITON_SPARSE": 1.0,
                            "FLASHMLA_SPARSE": 1.87}, engine="vllm", engine_best={"vllm": "FLASHMLA_SPARSE"},
                            static_choice="FLASHMLA_SPARSE", plugin_missing=None, key=key,
                            plugin_scores={"MLA_TUNE_TRITON_SPARSE": 1.02})
    assert (got.engine_backend, got.basis) == ("MLA_TUNE_TRITON_SPARSE", "winner")


def test_a_decision_that_never_timed_vllms_kernels_hands_vllm_nothing():
    # A decision migrated from when our kernel was stored as TRITON_MLA: engine_best is None.
    got = choose_for_engine(winner="TRITON_MLA", scores={"TRITON_MLA": 1.0}, engine="vllm", engine_best=None,
                            plugin_missing=None)
    assert (got.engine_backend, got.basis) == (None, "stale")
    assert "before mla-tune timed vLLM's own kernels" in got.reason


def test_no_engine_kernel_timed_means_no_flag():
    got = choose_for_engine(winner="FLASHINFER_FA2_MLA", scores={"FLASHINFER_FA2_MLA": 1.0}, engine="vllm",
                            engine_best={})
    assert (got.engine_backend, got.basis) == (None, "none")


def test_choice_from_a_real_lookup_hands_vllm_its_fastest_own_backend(tmp_path):
    import mla_tune
    from mla_tune.backends.software import current_fingerprint
    from mla_tune.store.repository import Store

    url = f"sqlite:///{tmp_path / 'd.db'}"
    with Store.open(url) as store:
        (decision,) = fleet_data.populate(store, heads=(16,), fingerprint=current_fingerprint())
    choice = mla_tune.lookup(16, "fp8", device={"name": "NVIDIA H200", "compute_capability": (9, 0)}, db=url)
    assert (choice.backend, choice.source) == ("FLASHINFER_FA2_MLA", "tuned")
    assert dict(choice.engine_best) == {"vllm": "FLASHMLA", "sglang": "FLASHINFER_FA3_MLA"}
    vllm = choice_for_engine(choice, "vllm", plugin_missing=None)
    assert (vllm.engine_backend, vllm.basis) == ("FLASHMLA", "engine_best")
    assert vllm.score == pytest.approx(decision.scores["FLASHMLA"])
    sglang = choice_for_engine(choice, "sglang")
    assert (sglang.engine_backend, sglang.basis) == ("flashinfer", "engine_best")
