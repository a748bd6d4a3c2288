"""`write_report`: Markdown plus readable PNGs for every key, anomalies called out."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
import fleet_data  # noqa: E402

pytest.importorskip("matplotlib")
from mla_tune.tuner.report import write_report  # noqa: E402

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC, f"{path.name} is not a PNG"
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")


def test_report_has_a_section_and_plots_for_every_key(tmp_path):
    decisions, measurements = fleet_data.fleet(heads=(16, 64))
    index = write_report(decisions, measurements, tmp_path / "out")
    text = index.read_text()
    images = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", text)
    # two plots per key plus the scores-by-heads plot of the SKU
    assert len(images) == 2 * len(decisions) + 1
    for name in images:
        width, height = _png_size(index.parent / name)
        assert width >= 600 and height >= 300, f"{name} is {width}x{height}"
        assert (index.parent / name).stat().st_size > 10_000, f"{name} looks empty"
    for d in decisions:
        assert f"**Chosen: `{d.winner}`**" in text and d.key.label in text


def test_anomaly_is_listed_at_the_top_and_under_its_key(tmp_path):
    decisions, measurements = fleet_data.fleet(heads=(32, 64, 128))
    text = write_report(decisions, measurements, tmp_path).read_text()
    head, _, body = text.partition("## NVIDIA")
    assert "## Anomalies" in head and "FLASHINFER_FA3_MLA at 64 heads" in head
    assert "⚠️ **Anomaly:**" in body


def test_margin_and_static_choice_are_stated(tmp_path):
    decisions, measurements = fleet_data.fleet(heads=(64,))
    d = decisions[0]
    text = write_report(decisions, measurements, tmp_path).read_text()
    assert f"runner-up `{d.runner_up}` at +{d.margin * 100:.1f}%" in text
    assert "vLLM static choice `FLASHMLA`" in text


def test_what_vllm_gets_is_its_fastest_own_backend_against_the_fastest_and_its_static_choice(tmp_path):
    decisions, measurements = fleet_data.fleet(heads=(64,))
    d = decisions[0]
    text = write_report(decisions, measurements, tmp_path).read_text()
    assert d.winner == "FLASHINFER_FA2_MLA" and d.engine_best["vllm"] == "FLASHMLA"  # vLLM has no FA2 name
    ratio = d.scores["FLASHMLA"] / d.scores["FLASHINFER_FA2_MLA"]
    assert f"- vLLM gets: FLASHMLA, {ratio:.2f}x FLASHINFER_FA2_MLA" in text
    _, _, table = text.partition("## What vLLM gets, by heads per rank")
    (row,) = [line for line in table.splitlines() if line.startswith("| NVIDIA")]
    # the SKU's own `|` are escaped, so the row has the header's seven cells
    cells = [c.strip() for c in row.replace("\\|", "/").strip("|").split("|")]
    assert cells[1:] == ["fp8_e4m3", "64", "`FLASHINFER_FA2_MLA`", f"`FLASHMLA` {ratio:.2f}x", "`FLASHMLA` 1.00x",
                         "-"]


def test_where_ours_is_fastest_the_report_gives_its_vllm_launch_and_what_vllm_gets_with_the_plugin(tmp_path):
    from dataclasses import replace

    decisions, measurements = fleet_data.fleet(heads=(64,))
    d = decisions[0]
    scores = {**d.scores, "MLA_TUNE_TRITON": 0.9 * min(d.scores.values())}
    fastest = scores["MLA_TUNE_TRITON"]
    slow = replace(d, winner="MLA_TUNE_TRITON", scores=scores, plugin_scores={"MLA_TUNE_TRITON": 1.5})
    text = write_report([slow], measurements, tmp_path).read_text()
    assert f"MLA_TUNE_TRITON as vLLM launches it {1.5 / fastest:.2f}x" in text
    assert "With mla-tune's vLLM plugin, vLLM gets `FLASHMLA`: " in text
    assert "MLA_TUNE_TRITON as vLLM launches it takes 1.50x the time of the fastest kernel" in text
    _, _, table = text.partition("## What vLLM gets, by heads per rank")
    (row,) = [line for line in table.splitlines() if line.startswith("| NVIDIA")]
    assert row.endswith(f"| `MLA_TUNE_TRITON` {1.5 / fastest:.2f}x |")
    stale = write_report([replace(slow, plugin_scores=None)], measurements, tmp_path).read_text()
    assert "MLA_TUNE_TRITON as vLLM launches it not timed" in stale and "re-run `mla-tune`" in stale


def test_key_without_measurements_still_reported(tmp_path):
    decisions, _ = fleet_data.fleet(heads=(16,))
    text = write_report(decisions, [], tmp_path).read_text()
    assert "No per-shape measurements stored for this key." in text
    assert not list(tmp_path.glob("*.png"))


def test_empty_table_says_what_to_do(tmp_path):
    text = write_report([], [], tmp_path).read_text()
    assert "Nothing is tuned yet" in text
