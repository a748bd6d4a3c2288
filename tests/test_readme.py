"""README.md stays true: CI runs its test command verbatim, the command table lists every command and option,
every name its Python example uses exists, and the support matrix (docs/support.md) matches the registry."""

from __future__ import annotations

import itertools
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


def support_doc() -> str:
    return (ROOT / "docs" / "support.md").read_text()


def test_ci_runs_the_readme_test_command_verbatim():
    block = readme().split("<!-- ci:test-command", 1)[1].split("```bash\n", 1)[1].split("\n```", 1)[0]
    assert "\n" not in block.strip()
    ci_lines = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert block.strip() in ci_lines


def test_ci_runs_the_slow_tests_too():
    assert "pytest -m slow" in (ROOT / ".ci" / "run").read_text()


def _commands():
    """(`mla-tune ...` words, click command) of every leaf command."""
    import click

    from mla_tune.cli.main import main

    def walk(group, words):
        for name, command in group.commands.items():
            if isinstance(command, click.Group):
                yield from walk(command, [*words, name])
            else:
                yield " ".join([*words, name]), command
    return list(walk(main, ["mla-tune"]))


def test_the_command_table_lists_every_command_with_every_option():
    # options every command takes (`--db`) are listed once, under "Global options:", instead of in every row
    global_options = readme().split("Global options:", 1)[1].split("\n\n", 1)[0]
    rows = {}
    for line in readme().split("## Command line", 1)[1].split("\n## ", 1)[0].splitlines():
        if line.startswith("| `mla-tune"):
            usage = line.split("`")[1]
            words = itertools.takewhile(lambda w: re.fullmatch(r"[a-z][a-z-]*", w), usage.split())
            rows[" ".join(words)] = usage
    for words, command in _commands():
        assert words in rows, f"README's command table has no row for `{words}`"
        for param in command.params:
            for flag in param.opts:
                if flag.startswith("--") and flag != "--help":
                    assert flag in rows[words] or f"`{flag} " in global_options, \
                        f"`{words}`: README's table does not show {flag}"


def test_every_name_of_the_python_example_exists():
    import mla_tune

    block = readme().split("## Python API", 1)[1].split("```python\n", 1)[1].split("\n```", 1)[0]
    names = set(re.findall(r"mla_tune\.(\w+)", block)) | set(re.findall(r"`mla_tune\.(\w+)`", readme()))
    assert {"lookup", "NoDeviceError"} <= names
    for name in names:
        assert hasattr(mla_tune, name), f"README uses mla_tune.{name}, which `import mla_tune` does not have"


def test_readme_links_stay_inside_the_repository():
    for target in re.findall(r"\]\(([^)#]+)", readme()):
        if "://" not in target:
            assert (ROOT / target).exists(), target


def matrix_rows() -> tuple[list[str], dict[str, list[str]]]:
    text = support_doc().split("<!-- support-matrix", 1)[1].splitlines()
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
