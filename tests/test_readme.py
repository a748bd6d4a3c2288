"""README.md stays true: CI runs its test command verbatim, and its support matrix matches the registry."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from mla_tune.backends.problem import DeviceSpec, Problem
from mla_tune.backends.registry import BACKENDS, backend_reasons

ROOT = Path(__file__).resolve().parents[1]
FAMILIES = {"Ampere (SM80/86)": (8, 0), "Ada (SM89)": (8, 9), "Hopper (SM90)": (9, 0), "Blackwell (SM100/103)": (10, 0),
            "Blackwell RTX (SM120/121)": (12, 0)}


def readme() -> str:
    return (ROOT / "README.md").read_text()


def test_ci_runs_the_readme_test_command_verbatim():
    block = readme().split("<!-- ci:test-command", 1)[1].split("```bash\n", 1)[1].split("\n```", 1)[0]
    assert "\n" not in block.strip()
    ci_lines = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert block.strip() in ci_lines


def matrix_rows() -> tuple[list[str], dict[str, list[str]]]:
    text = readme().split("<!-- support-matrix", 1)[1].splitlines()
    start = next(i for i, line in enumerate(text) if line.startswith("|"))
    lines = []
    for line in text[start:]:  # the table ends at its first non-table line
        if not line.startswith("|"):
            break
        lines.append(line)
    header = [cell.strip() for cell in lines[0].strip("|").split("|")][1:]
    rows = {}
    for line in lines[2:]:
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        rows[cells[0].strip("`")] = cells[1:]
    return header, rows


def test_matrix_lists_every_candidate_backend_and_family():
    header, rows = matrix_rows()
    assert header == list(FAMILIES)
    assert set(rows) == {name for name, info in BACKENDS.items() if info.capabilities.candidate}


@pytest.mark.parametrize("name", [n for n, i in BACKENDS.items() if i.capabilities.candidate])
def test_matrix_cells_agree_with_declared_capabilities(name):
    header, rows = matrix_rows()
    info = BACKENDS[name]
    for family, cell in zip(header, rows[name]):
        statuses = dict(re.findall(r"(bf16|fp8) (\S+)", cell))
        assert set(statuses) == {"bf16", "fp8"}, cell
        for kv, status in statuses.items():
            problem = Problem(num_heads=128 if name == "CUTLASS_MLA" else 64, kv_cache_dtype=kv,
                              page_size=128 if name == "CUTLASS_MLA" else 64,
                              topk=None if info.capabilities.dense else 2048)
            supported = not backend_reasons(name, problem, DeviceSpec("x", FAMILIES[family]), check_packages=False)
            assert (status != "–") == supported, (name, family, kv, status)
            if supported:
                assert (status == "V") == (info.adapter is None), (name, family, kv, status)
                assert status in {"W", "P", "U", "V"}
