"""Presets, grids, workload weights, plan order and the budget check."""

from __future__ import annotations

import pytest

from mla_tune.backends.problem import Shape
from mla_tune.store.records import DecisionKey, Measurement
from mla_tune.tuner.plan import BudgetError, KeyPlan, check_budget, done_shapes, plan_units
from mla_tune.tuner.presets import (GRIDS, SpecError, TuneSpec, expand_keys, heads_per_rank, load_workload,
                                    parse_model, shape_grid)


def test_default_preset_covers_dense_and_sparse_deepseek_tp_sweeps_with_both_kv_dtypes():
    keys = expand_keys(TuneSpec())
    assert sorted({(k.problem.num_heads, k.problem.kv_cache_dtype, k.problem.topk or 0) for k in keys}) == [
        (h, kv, topk) for h in (16, 32, 64, 128) for kv in ("bf16", "fp8_e4m3") for topk in (0, 2048)]
    assert len(keys) == 16 and all(k.problem.geometry.label == "512/64/128/128" for k in keys)
    # Most valuable first: TP 8 (16 heads) leads, TP 1 (128 heads) comes last.
    assert [k.problem.num_heads for k in keys][:4] == [16] * 4
    assert [k.problem.num_heads for k in keys][-4:] == [128] * 4
    dense = next(k for k in keys if not k.problem.sparse)
    assert min(s.batch_size for s in dense.shapes) == 1 and max(s.batch_size for s in dense.shapes) == 128
    assert Shape(32, 32768) in dense.shapes                    # vLLM's long-context point
    assert sum(dense.weights) == pytest.approx(1.0)
    # Sparse decode reads top-k 2048 tokens whatever the context: each batch size at a 32k context.
    sparse = next(k for k in keys if k.problem.sparse)
    assert sparse.shapes == tuple(Shape(b, 32768) for b in (1, 4, 16, 64, 128))


def test_model_presets_carry_their_geometry_and_sparsity():
    glm = parse_model("glm-5")
    assert glm.geometry.qk_nope_head_dim == 192 and glm.topk == 2048 and glm.num_heads == 64
    assert parse_model("deepseek-v3.2").topk == 2048
    assert parse_model("kimi-k2").num_heads == 64
    keys = expand_keys(TuneSpec(models=("glm-5",), tps=(1, 2), kv_cache_dtypes=("bf16",), level="quick"))
    assert [(k.problem.num_heads, k.problem.topk) for k in keys] == [(32, 2048), (64, 2048)]
    custom = parse_model("custom:512/64/192/256:heads=40:topk=1024")
    assert (custom.num_heads, custom.topk, custom.geometry.v_head_dim) == (40, 1024, 256)
    with pytest.raises(SpecError, match="unknown model preset 'llama'"):
        parse_model("llama")
    with pytest.raises(SpecError, match="bad custom geometry"):
        parse_model("custom:512/64")


def test_tp_that_leaves_no_head_is_skipped_and_an_empty_sweep_is_an_error():
    assert heads_per_rank(16, (1, 2, 4, 8, 32)) == [(1, 16), (2, 8), (4, 4), (8, 2)]
    with pytest.raises(SpecError, match="no TP in \\[32\\]"):
        expand_keys(TuneSpec(models=("deepseek-v2-lite",), tps=(32,)))


def test_mtp_adds_q_len_2_keys_after_the_q_len_1_keys():
    keys = expand_keys(TuneSpec(models=("deepseek-v3",), tps=(8,), kv_cache_dtypes=("bf16",), mtp=True))
    assert [k.problem.q_len for k in keys] == [1, 2]


def test_workload_weights_from_json_and_toml(tmp_path):
    js = tmp_path / "trace.json"
    js.write_text('{"batch_size": {"2": 3, "100": 1}, "kv_len": {"900": 1}}')
    grid = dict(shape_grid("quick", load_workload(js)))
    # batch 2 goes to grid batch 1, batch 100 to 128; kv 900 to 1024; 8192 and batch 16 weigh 0 and are dropped.
    assert grid == {Shape(1, 1024): pytest.approx(0.75), Shape(128, 1024): pytest.approx(0.25)}
    toml = tmp_path / "trace.toml"
    toml.write_text('[[shapes]]\nbatch_size = 48\nkv_len = 3000\nweight = 2\n'
                    '[[shapes]]\nbatch_size = 8\nkv_len = 500\n')
    assert dict(shape_grid("default", load_workload(toml))) == {Shape(48, 3000): pytest.approx(2 / 3),
                                                                  Shape(8, 500): pytest.approx(1 / 3)}


@pytest.mark.parametrize("text, message", [
    ("{not json", "does not parse"),
    ('{"batch_size": {"1": 0}}', "sum to zero"),
    ('{"batches": {"1": 1}}', "expected keys batch_size and kv_len"),
    ('{"shapes": []}', "non-empty list"),
])
def test_bad_workload_files_are_one_clear_error(tmp_path, text, message):
    path = tmp_path / "w.json"
    path.write_text(text)
    with pytest.raises(SpecError, match=message):
        load_workload(path)


def test_budget_that_cannot_fit_one_measurement_is_rejected():
    check_budget(None, max_seconds=1.0)
    check_budget(10, max_seconds=1.0)
    for budget in (0, -5, 1.0):
        with pytest.raises(BudgetError, match="cannot fit a single measurement"):
            check_budget(budget, max_seconds=1.0)


def _m(backend, batch, status="ok"):
    key = DecisionKey("sku", "9.0", "bf16", "bf16", 16)
    return Measurement(key=key, backend=backend, batch_size=batch, kv_len=1024, status=status, median_ms=1.0)


def test_done_shapes_need_every_backend_and_a_skipped_shape_counts_as_done():
    rows = [_m("A", 1), _m("B", 1, "failed"), _m("A", 4), _m("A", 16, "skipped")]
    assert done_shapes(rows, ["A", "B"]) == {(1, 1024), (16, 1024)}


def test_units_pin_each_keys_first_shape_to_every_gpu():
    work = expand_keys(TuneSpec(tps=(8,), kv_cache_dtypes=("bf16",), level="quick"))[0]
    plan = KeyPlan(DecisionKey("sku", "9.0", "bf16", "bf16", 16), work, ("A",), todo=work.shapes)
    units = plan_units([plan], ["g0", "g1"])
    assert [u.gpu for u in units[:2]] == ["g0", "g1"] and units[0].shape == units[1].shape
    assert len(units) == len(GRIDS["quick"][0]) * len(GRIDS["quick"][1]) + 1
    assert all(u.gpu is None for u in units[2:])
