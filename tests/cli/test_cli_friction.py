"""What a new user hit: --db after the subcommand, a missing --heads, JSON errors, the terminal width."""

from __future__ import annotations

import json

import pytest

from mla_tune.store.repository import Store

H100 = ("--device-name", "NVIDIA H100 80GB HBM3", "--cc", "9.0")


def test_db_is_accepted_after_the_subcommand(cli, tmp_path):
    url = f"sqlite:///{tmp_path / 'mla.db'}"
    assert cli("db", "upgrade", "--db", url).exit_code == 0
    assert cli("db", "--db", url, "upgrade").exit_code == 0
    assert (tmp_path / "mla.db").is_file()
    assert cli("show", "--db", url).stdout.startswith("no decisions stored in")
    result = cli("lookup", "--heads", "16", "--kv-cache-dtype", "bf16", *H100, "--db", url)
    assert result.exit_code == 0 and result.stderr == ""
    assert cli("export", "--out", tmp_path / "x.json", "--db", url).exit_code == 0
    assert cli("import", "--check", tmp_path / "x.json", "--db", url).exit_code == 0
    # the subcommand's --db wins over the global one
    other = tmp_path / "other.db"
    assert cli("--db", f"sqlite:///{other}", "db", "upgrade", "--db", url).exit_code == 0
    assert not other.exists()


def test_a_bad_db_after_the_subcommand_is_a_usage_error(cli, tmp_path):
    result = cli("show", "--db", "mysql://u@h/db")
    assert result.exit_code == 2 and "unsupported database 'mysql'" in result.stderr


@pytest.mark.parametrize("missing, named", [("--heads", "--heads N"), ("--kv-cache-dtype", "--kv-cache-dtype D")])
def test_a_missing_required_option_is_named(cli, missing, named):
    args = {"--heads": "16", "--kv-cache-dtype": "bf16"}
    del args[missing]
    result = cli("lookup", *[x for pair in args.items() for x in pair], *H100)
    assert result.exit_code == 2
    assert f"missing option '{named}'" in result.stderr and "None" not in result.stderr


def test_probe_json_prints_a_json_error_object_when_there_is_no_gpu(cli, monkeypatch):
    from mla_tune.tuner import probe

    def no_gpu():
        raise probe.ProbeError("NVML could not start (libnvidia-ml.so.1 not found)")

    monkeypatch.setattr(probe, "probe_devices", no_gpu)
    result = cli("probe", "--json")
    assert result.exit_code == 1
    assert json.loads(result.stdout) == {"error": "NVML could not start (libnvidia-ml.so.1 not found)",
                                         "exit_status": 1}
    assert result.stderr.startswith("mla-tune: error: NVML could not start")


@pytest.mark.parametrize("args, status", [
    (("--heads", "0", "--kv-cache-dtype", "bf16", *H100), 2),
    (("--heads", "16", "--kv-cache-dtype", "int3", *H100), 2),
    (("--heads", "16", "--kv-cache-dtype", "bf16", "--sparse", "--device-name", "NVIDIA A100-SXM4-80GB",
      "--cc", "8.0"), 1),
])
def test_lookup_json_failures_print_a_json_error_object(cli, args, status):
    for form in (("--format", "json"), ("--format=json",)):
        result = cli("lookup", *form, *args)
        assert result.exit_code == status
        error = json.loads(result.stdout)
        assert error["exit_status"] == status and error["error"] and "\n" not in error["error"]


def test_tables_fit_the_terminal_width_from_columns(cli, tmp_path):
    from mla_tune.backends.software import current_fingerprint

    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent.parent / "store"))
    from store_samples import decision, key

    url = f"sqlite:///{tmp_path / 'mla.db'}"
    with Store.open(url) as store:
        for heads in (16, 128):
            store.save_decision(decision(key(num_heads=heads), fingerprint=current_fingerprint()))
    for columns in (80, 120):
        result = cli("--db", url, "show", env={"COLUMNS": str(columns)})
        lines = result.stdout.splitlines()
        assert result.exit_code == 0 and max(len(line) for line in lines) <= columns, result.stdout
        body = " ".join(" ".join(line.replace("│", " ").split()) for line in lines)
        assert "FLASHINFER_FA3_MLA" in body.replace(" ", "") and "FLASHMLA" in body


def test_db_upgrade_initialises_an_empty_file_as_documented(cli, tmp_path):
    empty = tmp_path / "empty.db"
    empty.write_bytes(b"")
    result = cli("--db", f"sqlite:///{empty}", "db", "upgrade")
    assert result.exit_code == 0 and "schema at revision" in result.stdout
    assert empty.stat().st_size > 0
    doc = (Path(__file__).parent.parent.parent / "docs" / "errors.md").read_text()
    assert "An empty (0-byte) file is initialised" in doc


from pathlib import Path  # noqa: E402
