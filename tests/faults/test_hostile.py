"""Hostile inputs: control characters, NUL, dense files, files too big for memory."""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
from contextlib import closing

import pytest
from fault_helpers import export_file, filled_store, one_error_line, run_cli

import mla_tune
from mla_tune.store.exchange import checksum, dumps

ESC = "\x1b[31mRED\x1b[0m"
DEVICE = {"name": "NVIDIA H100 80GB HBM3", "compute_capability": (9, 0)}


def _rewrite(path, change) -> None:
    document = json.loads(path.read_text())
    change(document["content"])
    document["checksum"] = checksum(document)
    path.write_bytes(dumps(document))


@pytest.mark.parametrize("where, change", [
    ("a node name with an ANSI sequence", lambda c: c["runs"][0].update(node=ESC)),
    ("a node name with a newline", lambda c: c["decisions"][0].update(node="n\nmla-tune: error: forged")),
    ("a SKU with a bidi override", lambda c: [d["key"].update(sku=d["key"]["sku"] + "\u202e") for d in c["decisions"]]),
    ("a device name with NUL", lambda c: c["devices"][0].update(name="H100\x00")),
    ("a reason with NUL", lambda c: c["measurements"][0].update(reason="crash\x00")),
])
def test_control_characters_are_refused_by_import_check(where, change, tmp_path):
    export = export_file(filled_store(f"sqlite:///{tmp_path / 'source.db'}"), tmp_path / "x.json")
    _rewrite(export, change)
    target = f"sqlite:///{tmp_path / 'target.db'}"
    for args in (("import", "--check", export), ("import", export)):
        line = one_error_line(run_cli("--db", target, *args), 2)
        assert "control character" in line and "\x1b" not in line and "\x00" not in line, line
    assert not (tmp_path / "target.db").exists()


def test_control_characters_already_stored_are_escaped_in_every_output(tmp_path):
    from store_samples import decision, key

    from mla_tune.backends.software import current_fingerprint
    from mla_tune.store.repository import Store

    path = tmp_path / "mla.db"
    url = f"sqlite:///{path}"
    export = export_file(filled_store(f"sqlite:///{tmp_path / 'source.db'}"), tmp_path / "x.json")
    with Store.open(url) as store:
        store.save_decision(decision(key(num_heads=16), fingerprint=current_fingerprint()), node="n")
    with closing(sqlite3.connect(path)) as connection, connection:   # written behind mla-tune's back
        connection.execute("UPDATE decisions SET decided_at = ?, runner_up = ?",
                           (f"2026-11-22 {ESC}\nmla-tune: error: forged", "FLASHMLA\x07"))
        connection.execute("UPDATE fingerprints SET torch = ?", (f"2.13{ESC}",))
    outputs = [run_cli("--db", url, "lookup", "--heads", 16, "--kv-cache-dtype", "bf16",
                       "--device-name", DEVICE["name"], "--cc", "9.0"),
               run_cli("--db", url, "show", env={"COLUMNS": "400"}),
               run_cli("--db", url, "show", "--json"),
               run_cli("--db", url, "import", "--check", export)]
    for result in outputs:
        text = result.stdout + result.stderr
        assert "\x1b" not in text and "\x07" not in text, text
        assert not any(line.startswith("mla-tune: error: forged") for line in text.splitlines()), text
    assert "\\x1b[31mRED" in outputs[0].stdout + outputs[1].stdout


def _peak_rss_mib(code: str) -> tuple[float, str]:
    script = ("import resource, sys\n" + code +
              "\nprint(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, file=sys.stderr)")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    return float(result.stderr.strip().splitlines()[-1]), result.stdout


@pytest.mark.time_limit(90)
def test_a_dense_file_is_refused_before_parsing_in_bounded_memory(tmp_path):
    dense = tmp_path / "dense.json"
    size = 40 << 20
    dense.write_bytes(b'{"format": "mla-tune-export", "content": [' + b"[]," * (size // 3) + b"[]]}")
    code = (f"from mla_tune.store.exchange import read_export, ExchangeError\n"
            f"try:\n    read_export({str(dense)!r})\nexcept ExchangeError as exc:\n    print(exc)\n")
    baseline, _ = _peak_rss_mib("import mla_tune.store.exchange")
    peak, out = _peak_rss_mib(code)
    assert "refused before parsing" in out, out
    # parsed, 14 million empty lists would take ~1 GB; refused from byte counts, the file is read once
    assert peak - baseline < 2.5 * size / 2**20, (peak, baseline)


def test_running_out_of_memory_is_one_line(tmp_path):
    export = export_file(filled_store(f"sqlite:///{tmp_path / 'source.db'}"), tmp_path / "x.json")
    document = json.loads(export.read_text())
    record = document["content"]["measurements"][0]
    document["content"]["measurements"] = [record] * 40_000      # ~30 MB, ~200 MB once parsed
    big = tmp_path / "big.json"
    big.write_text(json.dumps(document))
    code = ("import resource\n"
            "import click, rich, sqlalchemy, mla_tune.cli.fleet, mla_tune.store.importer, mla_tune.tuner.decide\n"
            "from mla_tune.cli.main import main\n"
            "size = int(open('/proc/self/statm').read().split()[0]) * resource.getpagesize()\n"
            "resource.setrlimit(resource.RLIMIT_AS, (size + (96 << 20), resource.RLIM_INFINITY))\n"
            "main()\n")
    result = subprocess.run([sys.executable, "-c", code, "--db", f"sqlite:///{tmp_path / 't.db'}", "import",
                             "--check", str(big)], capture_output=True, text=True, timeout=60)
    assert "memory" in one_error_line(result, 2)
