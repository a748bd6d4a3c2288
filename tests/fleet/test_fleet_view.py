"""`show --fleet`: nodes and GPUs behind each decision, spread, and outlier GPUs."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
import fleet_data  # noqa: E402

from mla_tune.store.fleet import fleet_view  # noqa: E402
from mla_tune.store.repository import Store  # noqa: E402


def test_a_slow_gpu_is_an_outlier_and_the_spread_shows_it(store_url):
    with Store.open(store_url) as store:
        fleet_data.populate(store, node="node-a", gpus=("GPU-1", "GPU-2"), heads=(64,))
        fleet_data.populate(store, node="node-b", gpus=("GPU-3", "GPU-4"), heads=(64,), scale={"GPU-4": 1.25})
        view = fleet_view(store)
    (row,) = view.rows
    assert row.nodes == ("node-a", "node-b") and len(row.gpus) == 4
    assert row.spread == pytest.approx(0.25)
    (outlier,) = view.outliers
    assert (outlier.gpu_uuid, outlier.nodes) == ("GPU-4", ("node-b",))
    assert outlier.slower == pytest.approx(0.25) and outlier.compared == 4 * 15  # 4 timed backends x 15 shapes


def test_healthy_fleet_has_no_outliers_and_small_differences_are_not_flagged(store_url):
    with Store.open(store_url) as store:
        fleet_data.populate(store, gpus=("GPU-1", "GPU-2", "GPU-3"), heads=(16,), scale={"GPU-3": 1.05})
        view = fleet_view(store)
    assert view.outliers == ()
    assert view.rows[0].spread == pytest.approx(0.05)


def test_two_gpus_are_too_few_to_call_one_an_outlier(tmp_path):
    with Store.open(f"sqlite:///{tmp_path / 'x.db'}") as store:
        fleet_data.populate(store, gpus=("GPU-1", "GPU-2"), heads=(16,), scale={"GPU-2": 2.0})
        assert fleet_view(store).outliers == ()


def test_show_fleet_prints_the_view(tmp_path, capsys):
    from mla_tune.cli.main import main

    url = f"sqlite:///{tmp_path / 'x.db'}"
    with Store.open(url) as store:
        fleet_data.populate(store, gpus=("GPU-1", "GPU-2", "GPU-3"), heads=(16,), scale={"GPU-3": 1.5})
    with pytest.raises(SystemExit) as exited:
        main.main(["--db", url, "show", "--fleet", "--json"])
    assert exited.value.code == 0
    data = json.loads(capsys.readouterr().out)
    assert data["decisions"][0]["gpus"] == ["GPU-1", "GPU-2", "GPU-3"]
    assert [o["gpu_uuid"] for o in data["outliers"]] == ["GPU-3"]
    with pytest.raises(SystemExit):
        main.main(["--db", url, "show", "--fleet"])
    text = capsys.readouterr().out
    assert "GPUs markedly slower" in text and "GPU-3" in text and "50.0%" in text


def test_report_command_writes_the_report(tmp_path, capsys):
    from mla_tune.cli.main import main

    url = f"sqlite:///{tmp_path / 'x.db'}"
    with Store.open(url) as store:
        fleet_data.populate(store, heads=(16,))
    with pytest.raises(SystemExit) as exited:
        main.main(["--db", url, "report", "--out", str(tmp_path / "rep")])
    assert exited.value.code == 0
    assert (tmp_path / "rep" / "index.md").stat().st_size > 0
    assert len(list((tmp_path / "rep").glob("*.png"))) == 2
