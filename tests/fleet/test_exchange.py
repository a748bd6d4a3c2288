"""Export and import on real SQLite files and a real PostgreSQL server (the `store_url` fixture)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from sqlalchemy import create_engine, inspect, text

sys.path.insert(0, str(Path(__file__).parent))
import fleet_data  # noqa: E402

from mla_tune.store.exchange import ExchangeError, checksum, dumps, read_export, write_export  # noqa: E402
from mla_tune.store.exchange_schema import SCHEMA_VERSION  # noqa: E402
from mla_tune.store.importer import import_files  # noqa: E402
from mla_tune.store.repository import Store  # noqa: E402
from mla_tune.tuner.decide import decide  # noqa: E402

# Columns that record when a row was last touched, not what it says.
VOLATILE = {("devices", "last_seen")}


def dump_tables(url: str) -> dict[str, list[tuple]]:
    """Every row of every table, sorted: the database's contents, for before/after comparisons."""
    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            out = {}
            for table in sorted(inspect(conn).get_table_names()):
                if table == "alembic_version":
                    continue
                columns = [c["name"] for c in inspect(conn).get_columns(table)
                           if (table, c["name"]) not in VOLATILE]
                rows = conn.execute(text(f"SELECT {', '.join(columns)} FROM {table}")).all()
                out[table] = sorted((tuple(str(v) for v in row) for row in rows))
            return out
    finally:
        engine.dispose()


@pytest.fixture
def source(tmp_path) -> Path:
    """An export of one node's tune (two keys, one GPU) written from a real SQLite store."""
    with Store.open(f"sqlite:///{tmp_path / 'node-a.db'}") as store:
        fleet_data.populate(store, node="node-a", heads=(16, 64))
        write_export(store, tmp_path / "node-a.json", node="node-a")
    return tmp_path / "node-a.json"


def _main(args: list[str], capsys) -> tuple[int, str, str]:
    from mla_tune.cli.main import main

    with pytest.raises(SystemExit) as exited:
        main.main(args)
    captured = capsys.readouterr()
    return exited.value.code, captured.out, captured.err


def test_two_exports_of_the_same_data_are_byte_identical(tmp_path, source):
    with Store.open(f"sqlite:///{tmp_path / 'node-a.db'}") as store:
        write_export(store, tmp_path / "again.json", node="node-a")
    assert (tmp_path / "again.json").read_bytes() == source.read_bytes()


def test_round_trip_reproduces_the_export_byte_for_byte(tmp_path, source, store_url):
    with Store.open(store_url) as store:
        report = import_files(store, [source], decide=decide)
        # 2 keys x (4 timed backends x 15 shapes + 1 ineligible record)
        assert report.measurements_added == 2 * 61 and report.decisions_saved == 2
        # engines keep what each is handed: an imported decision is not stale
        assert [d.engine_best["vllm"] for d in store.decisions()] == ["FLASHMLA", "FLASHMLA"]
        write_export(store, tmp_path / "copy.json", node="node-a")
    assert (tmp_path / "copy.json").read_bytes() == source.read_bytes()


def test_import_is_idempotent(source, store_url):
    with Store.open(store_url) as store:
        import_files(store, [source], decide=decide)
    before = dump_tables(store_url)
    with Store.open(store_url) as store:
        again = import_files(store, [source], decide=decide)
    assert again.measurements_added == 0 and again.runs_added == 0 and again.decisions_saved == 0
    assert dump_tables(store_url) == before


def test_check_reports_and_writes_nothing(source, store_url):
    Store.open(store_url).close()
    before = dump_tables(store_url)
    with Store.open(store_url) as store:
        report = import_files(store, [source], check=True, decide=decide)
    assert report.measurements_added == 2 * 61 and any("would add" in line for line in report.lines())
    assert dump_tables(store_url) == before


def test_check_against_a_database_not_yet_created_reports_and_creates_nothing(tmp_path, source, capsys):
    target = tmp_path / "later" / "fleet.db"
    code, out, err = _main(["--db", f"sqlite:///{target}", "import", str(source), "--check"], capsys)
    assert code == 0 and "would add" in out and "does not exist yet" in err
    assert not target.exists() and not target.parent.exists()


def test_imported_decision_is_looked_up_with_the_same_answer(tmp_path, store_url):
    from mla_tune.backends.software import current_fingerprint

    import mla_tune

    fingerprint = current_fingerprint()  # as if tuned with this machine's software
    with Store.open(f"sqlite:///{tmp_path / 'gpu.db'}") as store:
        decisions = fleet_data.populate(store, heads=(64,), fingerprint=fingerprint)
        write_export(store, tmp_path / "gpu.json")
    with Store.open(store_url) as store:
        import_files(store, [tmp_path / "gpu.json"], decide=decide)
    device = {"name": "NVIDIA H200", "compute_capability": (9, 0), "memory_total_mib": 144384,
              "pci_device_id": "0x233510DE"}
    choice = mla_tune.lookup(64, "fp8", device=device, db=store_url)
    assert (choice.backend, choice.source) == (decisions[0].winner, "tuned")


def test_nodes_of_one_sku_are_merged_and_their_disagreement_reported(tmp_path, store_url):
    paths = []
    for node, gpus, scale in (("node-a", ("GPU-a1",), None), ("node-b", ("GPU-b1", "GPU-b2"), {"GPU-b2": 1.3})):
        with Store.open(f"sqlite:///{tmp_path / node}.db") as store:
            fleet_data.populate(store, node=node, gpus=gpus, heads=(64,), scale=scale)
            write_export(store, tmp_path / f"{node}.json", node=node)
        paths.append(tmp_path / f"{node}.json")
    with Store.open(store_url) as store:
        report = import_files(store, paths, decide=decide)
        merged = store.decisions()
    assert len(merged) == 1
    assert set(merged[0].gpu_uuids) == {"GPU-a1", "GPU-b1", "GPU-b2"}
    assert len(report.rebuilt) == 1 and "2 nodes, 3 GPUs" in report.rebuilt[0]
    assert len(report.disagreements) == 1
    assert "node-b 1.070x" in report.disagreements[0] and "beyond the noise margin" in report.disagreements[0]


def test_identical_nodes_are_merged_without_a_disagreement(tmp_path, store_url):
    paths = []
    for node in ("node-a", "node-b"):
        with Store.open(f"sqlite:///{tmp_path / node}.db") as store:
            fleet_data.populate(store, node=node, gpus=(f"GPU-{node}",), heads=(64,))
            write_export(store, tmp_path / f"{node}.json", node=node)
        paths.append(tmp_path / f"{node}.json")
    with Store.open(store_url) as store:
        report = import_files(store, paths, decide=decide)
    assert len(report.rebuilt) == 1 and report.disagreements == []


# -- hostile files ----------------------------------------------------------------------------

def _resigned(document: dict) -> bytes:
    document = dict(document)
    document["checksum"] = checksum(document)
    return dumps(document)


def _edit(good: dict, edit) -> bytes:
    document = json.loads(json.dumps(good))
    edit(document)
    return _resigned(document)


def _measurement(doc, **values):
    doc["content"]["measurements"][0].update(values)


def _triton(doc) -> dict:
    return next(m for m in doc["content"]["measurements"] if m["backend"] == "MLA_TUNE_TRITON")


HOSTILE = {
    "truncated": (lambda raw, doc: raw[: len(raw) // 2], "truncated"),
    "not JSON": (lambda raw, doc: b"\xff\xfe\x00 binary, not json", "not UTF-8 text"),
    "plain text": (lambda raw, doc: b"hello, world", "not valid JSON"),
    "empty": (lambda raw, doc: b"", "is empty"),
    "a JSON list": (lambda raw, doc: b"[1, 2, 3]", "not an mla-tune export"),
    "another format": (lambda raw, doc: _edit(doc, lambda d: d.update(format="something-else")),
                       "not an mla-tune export"),
    "newer schema": (lambda raw, doc: _edit(doc, lambda d: d.update(schema_version=SCHEMA_VERSION + 1)),
                     "newer than this mla-tune"),
    "unknown schema": (lambda raw, doc: _edit(doc, lambda d: d.update(schema_version="1")),
                       "unknown export schema version"),
    "wrong checksum": (lambda raw, doc: raw.replace(b'"median_ms": 0.', b'"median_ms": 9.', 1),
                       "checksum mismatch"),
    "unknown backend": (lambda raw, doc: _edit(doc, lambda d: _measurement(d, backend="EVIL_MLA")),
                        "unknown backend 'EVIL_MLA'"),
    "unknown winner": (lambda raw, doc: _edit(doc, lambda d: d["content"]["decisions"][0].update(winner="X")),
                       "decisions[0].winner: unknown backend"),
    "negative time": (lambda raw, doc: _edit(doc, lambda d: _measurement(d, median_ms=-1.0)),
                      "median_ms: -1.0 is not in (0, 1e+06]"),
    "zero heads": (lambda raw, doc: _edit(doc, lambda d: d["content"]["decisions"][0]["key"].update(num_heads=0)),
                   "num_heads: 0 is not in [1, 1024]"),
    "boolean heads": (lambda raw, doc: _edit(doc, lambda d: _measurement(d, batch_size=True)),
                      "batch_size: True is not an integer"),
    "huge batch": (lambda raw, doc: _edit(doc, lambda d: _measurement(d, batch_size=10**12)),
                   "batch_size: 1000000000000 is not in"),
    "score below one": (lambda raw, doc: _edit(
        doc, lambda d: d["content"]["decisions"][0]["scores"].update(MLA_TUNE_TRITON=0.5)), "is not in [0.999"),
    "unknown dtype": (lambda raw, doc: _edit(
        doc, lambda d: d["content"]["decisions"][0]["key"].update(kv_cache_dtype="fp4")), "'fp4' is not one of"),
    "NaN": (lambda raw, doc: raw.replace(b'"median_ms": 0.', b'"median_ms": NaN, "x": 0.', 1),
            "NaN is not a JSON number"),
    "unknown field": (lambda raw, doc: _edit(doc, lambda d: _measurement(d, pickle="gASVAAAA")),
                      "unknown field 'pickle'"),
    "duplicate field": (lambda raw, doc: raw.replace(b'"format":', b'"format": "x", "format":', 1),
                        "duplicate field 'format'"),
    "bad tile value": (lambda raw, doc: _edit(doc, lambda d: _triton(d)["params"]["tile"].update(block_h="64; rm")),
                       "params.tile['block_h']: '64; rm' is not a tile value"),
    "dangling run": (lambda raw, doc: _edit(doc, lambda d: _measurement(d, run=99)), "is not a run index"),
    "forged digest": (lambda raw, doc: _edit(doc, lambda d: d["content"]["fingerprints"][0].update(torch="9.9")),
                      "is not the digest of its fields"),
    "deep nesting": (lambda raw, doc: b"[" * 200_000 + b"]" * 200_000, "nests too deeply"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_file_is_rejected_in_one_line_with_status_2_and_nothing_changes(case, tmp_path, source,
                                                                               store_url, capsys):
    with Store.open(store_url) as store:
        fleet_data.populate(store, node="resident", gpus=("GPU-resident",), heads=(32,))
    before = dump_tables(store_url)
    make, expected = HOSTILE[case]
    raw = source.read_bytes()
    bad = tmp_path / "bad.json"
    bad.write_bytes(make(raw, json.loads(raw)))
    # A good file next to the bad one must not be applied either: all or nothing.
    code, out, err = _main(["--db", store_url, "import", str(source), str(bad)], capsys)
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"mla-tune: error: {bad}: "), err
    assert expected in lines[0]
    assert "Traceback" not in err and out == ""
    assert dump_tables(store_url) == before


def test_oversize_file_is_rejected(tmp_path, source, capsys):
    url = f"sqlite:///{tmp_path / 'target.db'}"
    code, _, err = _main(["--db", url, "import", "--max-bytes", "1000", str(source)], capsys)
    assert code == 2 and f"is {source.stat().st_size} bytes, more than the import limit of 1000 bytes" in err
    assert not (tmp_path / "target.db").exists()  # rejected before the store was even opened


def test_the_real_command_exits_2_with_one_line(tmp_path):
    bad = tmp_path / "cut.json"
    bad.write_text('{"format": "mla-tune-export", "schema_version": 1, "content": {"devi')
    result = subprocess.run([str(Path(sys.executable).parent / "mla-tune"), "--db",
                             f"sqlite:///{tmp_path / 'x.db'}", "import", str(bad)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2, result.stderr
    assert result.stderr.count("\n") == 1 and "truncated" in result.stderr


def test_export_records_its_producer_and_the_time_of_its_newest_record(source):
    document = read_export(source)
    content = document["content"]
    stamps = [r[name] or "" for kind in ("runs", "measurements", "decisions") for r in content[kind]
              for name in ("started_at", "finished_at", "measured_at", "decided_at") if name in r]
    assert document["producer"]["node"] == "node-a"
    assert document["producer"]["exported_at"] == max(stamps)
    with pytest.raises(ExchangeError, match="cannot be read"):
        read_export(source.parent / "missing.json")


def test_a_version_1_file_without_launch_params_is_still_read(tmp_path, source, store_url):
    # Schema 1 (before measurements had `params`, before our kernel had its own name and decisions had
    # `engine_best`): the same file as written then, checksummed as it was.
    old = json.loads(source.read_text())
    old["schema_version"] = 1
    for m in old["content"]["measurements"]:
        del m["params"]
        m["backend"] = {"MLA_TUNE_TRITON": "TRITON_MLA"}.get(m["backend"], m["backend"])
    for d in old["content"]["decisions"]:
        del d["engine_best"]
        d["scores"] = {{"MLA_TUNE_TRITON": "TRITON_MLA"}.get(b, b): v for b, v in d["scores"].items()}
    path = tmp_path / "v1.json"
    path.write_bytes(_resigned(old))
    with Store.open(store_url) as store:
        import_files(store, [path], decide=decide)
        triton = [m for m in store.measurements() if m.backend == "MLA_TUNE_TRITON"]
        vllm_triton = [m for m in store.measurements() if m.backend == "TRITON_MLA"]
        decisions = store.decisions()
    assert triton and all(m.params is None for m in triton)
    assert not vllm_triton  # the old name was our kernel: vLLM's Triton kernel was never timed
    assert decisions and all(d.engine_best is None and "MLA_TUNE_TRITON" in d.scores for d in decisions)


def test_launch_params_survive_export_and_import(tmp_path, source, store_url):
    with Store.open(store_url) as store:
        import_files(store, [source], decide=decide)
        triton = [m for m in store.measurements() if m.backend == "MLA_TUNE_TRITON"]
    assert triton and all(m.params == fleet_data.TRITON_PARAMS for m in triton)


ENGINE_PARAMS = {**fleet_data.TRITON_PARAMS, "engine_median_ms": 0.55, "engine_max_seq_len": 32768,
                 "engine_reason": ""}


def test_plugin_scores_and_the_vllm_launch_time_survive_export_and_import(tmp_path, store_url, monkeypatch):
    from dataclasses import replace

    monkeypatch.setattr(fleet_data, "TRITON_PARAMS", ENGINE_PARAMS)
    with Store.open(f"sqlite:///{tmp_path / 'node-a.db'}") as store:
        (d,) = fleet_data.populate(store, node="node-a", heads=(16,))
        store.save_decision(replace(d, plugin_scores={"MLA_TUNE_TRITON": 0.998}), node="node-a")
        write_export(store, tmp_path / "node-a.json", node="node-a")
    document = read_export(tmp_path / "node-a.json")
    assert document["schema_version"] == SCHEMA_VERSION
    assert [x["plugin_scores"] for x in document["content"]["decisions"]] == [{"MLA_TUNE_TRITON": 0.998}]
    with Store.open(store_url) as store:
        import_files(store, [tmp_path / "node-a.json"], decide=decide)
        (got,) = store.decisions()
        triton = [m for m in store.measurements() if m.backend == "MLA_TUNE_TRITON"]
        write_export(store, tmp_path / "copy.json", node="node-a")
    assert got.plugin_scores == {"MLA_TUNE_TRITON": 0.998}
    assert triton and all(m.params == ENGINE_PARAMS for m in triton)
    assert (tmp_path / "copy.json").read_bytes() == (tmp_path / "node-a.json").read_bytes()


def test_a_version_3_file_without_plugin_scores_imports_as_never_timed(tmp_path, source, store_url):
    old = json.loads(source.read_text())
    old["schema_version"] = 3
    for d in old["content"]["decisions"]:
        del d["plugin_scores"]
    path = tmp_path / "v3.json"
    path.write_bytes(_resigned(old))
    with Store.open(store_url) as store:
        import_files(store, [path], decide=decide)
        decisions = store.decisions()
    assert decisions and all(d.plugin_scores is None and d.engine_best for d in decisions)


@pytest.mark.parametrize("edit, message", [
    (lambda d: d["content"]["decisions"][0].update(plugin_scores={"NOPE": 1.0}), "unknown backend 'NOPE'"),
    (lambda d: d["content"]["decisions"][0].update(plugin_scores={"MLA_TUNE_TRITON": 0}), "is not in (0, 1e+06]"),
    (lambda d: [m["params"].update(engine_median_ms=-1.0) for m in d["content"]["measurements"] if m["params"]],
     "engine_median_ms: -1.0 is not in"),
    (lambda d: [m["params"].update(engine_extra=1) for m in d["content"]["measurements"] if m["params"]],
     "unknown field 'engine_extra'"),
])
def test_plugin_scores_and_vllm_launch_params_are_checked(tmp_path, source, edit, message):
    path = tmp_path / "bad.json"
    path.write_bytes(_edit(json.loads(source.read_text()), edit))
    with pytest.raises(ExchangeError, match=message.replace("(", r"\(").replace(")", r"\)").replace("+", r"\+")):
        read_export(path)
