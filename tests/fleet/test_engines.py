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
    with pytest.raises(ValueError, match="unknown engine 'trt'"):
        engine_name("TRITON_MLA", "trt")
    with pytest.raises(ValueError, match="unknown backend"):
        engine_name("NOPE", "vllm")


def test_ranking_keeps_only_the_engines_backends_best_first():
    scores = {"FLASHINFER_FA3_MLA": 1.0, "TRITON_MLA": 1.4, "FLASHMLA": 1.2, "CUTLASS_MLA": float("inf")}
    assert rank_for_engine(scores, "vllm") == [("FLASHMLA", "FLASHMLA", 1.2), ("TRITON_MLA", "TRITON_MLA", 1.4)]
    assert [r[1] for r in rank_for_engine(scores, "sglang")] == ["flashinfer", "flashmla", "triton"]


def test_choose_states_its_basis():
    scores = {"FLASHINFER_FA2_MLA": 1.0, "FLASHINFER_FA3_MLA": 1.05, "TRITON_MLA": 1.3}
    assert choose_for_engine(winner="TRITON_MLA", scores=scores, engine="vllm").basis == "winner"
    ranked = choose_for_engine(winner="FLASHINFER_FA2_MLA", scores=scores, engine="vllm")
    assert (ranked.backend, ranked.basis, ranked.score) == ("TRITON_MLA", "ranked", 1.3)
    static = choose_for_engine(winner="FLASHINFER_FA2_MLA", scores={"FLASHINFER_FA2_MLA": 1.0}, engine="vllm",
                               static_choice="FLASH_ATTN_MLA")
    assert (static.engine_backend, static.basis) == ("FLASH_ATTN_MLA", "static")
    none = choose_for_engine(winner="FLASHINFER_FA2_MLA", scores={"FLASHINFER_FA2_MLA": 1.0}, engine="vllm")
    assert none.engine_backend is None and "let the engine choose" in none.reason


def test_choice_from_a_real_lookup_ranks_the_stored_scores(tmp_path):
    import mla_tune
    from mla_tune.backends.software import current_fingerprint
    from mla_tune.store.repository import Store

    url = f"sqlite:///{tmp_path / 'd.db'}"
    with Store.open(url) as store:
        (decision,) = fleet_data.populate(store, heads=(16,), fingerprint=current_fingerprint())
    choice = mla_tune.lookup(16, "fp8", device={"name": "NVIDIA H200", "compute_capability": (9, 0)}, db=url)
    assert (choice.backend, choice.source) == ("FLASHINFER_FA2_MLA", "tuned")
    vllm = choice_for_engine(choice, "vllm")
    assert (vllm.engine_backend, vllm.basis) == ("TRITON_MLA", "ranked")
    assert vllm.score == pytest.approx(decision.scores["TRITON_MLA"])
    sglang = choice_for_engine(choice, "sglang")
    assert (sglang.engine_backend, sglang.basis) == ("flashinfer", "ranked")
