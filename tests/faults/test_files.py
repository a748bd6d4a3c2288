"""Files around the store and the export: kills, full disks, symbolic links, devices, missing directories."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import time

import pytest
from fault_helpers import CLI, export_file, filled_store, one_error_line, run_cli

from mla_tune.store.exchange import read_export
from mla_tune.store.safe_write import TEMP_MARK


@pytest.fixture(scope="module")
def big_store(tmp_path_factory):
    """A store whose export takes long enough (~1 s) to be killed while it writes."""
    path = tmp_path_factory.mktemp("big") / "big.db"
    return filled_store(f"sqlite:///{path}", heads=tuple(range(8, 136, 8)), measurements_per_key=300)


def _leftovers(folder) -> list[str]:
    return sorted(name for name in os.listdir(folder) if TEMP_MARK in name)


@pytest.mark.time_limit(120)
def test_killed_exports_leave_the_old_file_or_the_new_one_and_the_next_export_cleans_up(big_store, tmp_path):
    out = tmp_path / "export.json"
    out.write_text("the previous export\n")
    rng = random.Random(39)
    states = []
    for attempt in range(4):
        proc = subprocess.Popen([*CLI, "--db", big_store, "export", "--out", str(out)],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        if attempt % 2:
            time.sleep(rng.uniform(0.3, 2.0))     # anywhere
        else:                                      # while it writes its temporary file
            deadline = time.monotonic() + 30
            while not _leftovers(tmp_path) and proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.002)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
        content = out.read_bytes()
        whole = content == b"the previous export\n" or read_export(out)["format"] == "mla-tune-export"
        states.append((whole, len(_leftovers(tmp_path))))
    assert all(whole for whole, _ in states), states
    result = run_cli("--db", big_store, "export", "--out", out, timeout_s=60)
    assert result.returncode == 0, result.stderr
    assert _leftovers(tmp_path) == []          # a killed export's temporary file is removed by the next one
    print(f"kills: {states}")


def test_a_full_disk_fails_in_one_line_and_leaves_no_temporary_file(big_store, tmp_path):
    out = tmp_path / "export.json"
    out.write_text("the previous export\n")
    # RLIMIT_FSIZE makes writes past 64 KiB fail with EFBIG, as a full disk fails them with ENOSPC.
    limit = "import resource; resource.setrlimit(resource.RLIMIT_FSIZE, (65536, 65536)); "
    code = limit + "from mla_tune.cli.main import main; main()"
    result = subprocess.run([CLI[0], "-c", code, "--db", big_store, "export", "--out", str(out)],
                            capture_output=True, text=True, timeout=60)
    assert "cannot write" in one_error_line(result, 1)
    assert out.read_text() == "the previous export\n" and _leftovers(tmp_path) == []


def test_export_syncs_the_file_before_renaming_it(tmp_path, monkeypatch):
    from mla_tune.store import safe_write

    calls = []
    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: (calls.append("fsync"), real_fsync(fd))[1])
    monkeypatch.setattr(os, "replace", lambda a, b: (calls.append("rename"), real_replace(a, b))[1])
    safe_write.write_file(tmp_path / "x.json", b"{}\n")
    assert calls == ["fsync", "rename", "fsync"]     # file, rename, then the directory


def test_export_writes_through_a_symbolic_link(tmp_path):
    url = filled_store(f"sqlite:///{tmp_path / 'mla.db'}")
    (tmp_path / "exports").mkdir()
    target = tmp_path / "exports" / "real.json"
    target.write_text("old")
    link = tmp_path / "link.json"
    link.symlink_to(target)
    dangling = tmp_path / "dangling.json"
    dangling.symlink_to(tmp_path / "exports" / "new.json")
    for path in (link, dangling):
        assert run_cli("--db", url, "export", "--out", path).returncode == 0
        assert path.is_symlink() and read_export(path)["format"] == "mla-tune-export"
    assert read_export(target)["format"] == "mla-tune-export"


def test_export_to_a_device_or_pipe_writes_it_and_never_replaces_it(tmp_path):
    url = filled_store(f"sqlite:///{tmp_path / 'mla.db'}")
    assert run_cli("--db", url, "export", "--out", "/dev/null").returncode == 0
    assert os.path.exists("/dev/null") and not os.path.isfile("/dev/null")
    # /dev/stdout when stdout is a pipe: the document arrives on the pipe, /dev/stdout stays a link
    result = subprocess.run([*CLI, "--db", url, "export", "--out", "/dev/stdout"], capture_output=True,
                            timeout=30)
    assert result.returncode == 0 and result.stdout.startswith(b"{") and os.path.islink("/dev/stdout")
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    reader = subprocess.Popen(["cat", str(fifo)], stdout=subprocess.PIPE)
    assert run_cli("--db", url, "export", "--out", fifo).returncode == 0
    assert reader.communicate(timeout=10)[0].startswith(b"{") and not os.path.isfile(fifo)


def test_a_dangling_symlink_is_never_deleted_and_missing_directories_never_made(tmp_path, good_export=None):
    link = tmp_path / "store.db"
    link.symlink_to(tmp_path / "gone" / "store.db")
    export = export_file(filled_store(f"sqlite:///{tmp_path / 'source.db'}"), tmp_path / "good.json")
    for args in (("db", "upgrade"), ("import", export)):
        line = one_error_line(run_cli("--db", f"sqlite:///{link}", *args), 2)
        assert "symbolic link" in line and link.is_symlink()
    assert not (tmp_path / "gone").exists()
    missing = tmp_path / "nonexistent" / "dir" / "x.db"
    line = one_error_line(run_cli("--db", f"sqlite:///{missing}", "db", "upgrade"), 2)
    assert "does not exist (nothing was created)" in line and not (tmp_path / "nonexistent").exists()
    line = one_error_line(run_cli("--db", f"sqlite:///{tmp_path / 'source.db'}", "export", "--out",
                                  missing), 1)
    assert "cannot write" in line and not (tmp_path / "nonexistent").exists()


@pytest.mark.slow
@pytest.mark.time_limit(120)
def test_killed_imports_leave_all_or_nothing(tmp_path):
    from store_samples import dump

    source = filled_store(f"sqlite:///{tmp_path / 'source.db'}", heads=tuple(range(8, 72, 8)),
                          measurements_per_key=400)
    export = export_file(source, tmp_path / "node.json")
    url = filled_store(f"sqlite:///{tmp_path / 'target.db'}", heads=(128,), node="other")
    before = dump(url)
    rng = random.Random(12)
    for _ in range(3):
        proc = subprocess.Popen([*CLI, "--db", url, "import", str(export)], stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
        time.sleep(rng.uniform(0.5, 3.0))
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
        state = dump(url)
        assert state == before or len(state["measurements"]) == len(before["measurements"]) + 8 * 400
        if state != before:
            break
    assert run_cli("--db", url, "import", export, timeout_s=90).returncode == 0
    assert len(dump(url)["measurements"]) == len(before["measurements"]) + 8 * 400
