"""No password reaches any output, whatever form the URL gives it in."""

from __future__ import annotations

import pytest
from fault_helpers import export_file, filled_store, run_cli

SECRET = "Zq9-s3cr3t"

# (URL form, what must not appear): refused at once on port 1, so every driver message is seen
FORMS = [
    (f"postgresql://tuner:{SECRET}@127.0.0.1:1/mla", [SECRET]),
    (f"postgresql://tuner@127.0.0.1:1/mla?password={SECRET}", [SECRET]),
    (f"postgresql+psycopg://tuner:{SECRET[:4]} {SECRET[4:]}@127.0.0.1:1/mla", [SECRET[:4] + " " + SECRET[4:], SECRET[4:]]),
    (f"postgresql://tuner:{SECRET[:4]}@{SECRET[4:]}@127.0.0.1:1/mla", [SECRET[4:]]),
    (f"postgresql://tuner:{SECRET[:4]}%40{SECRET[4:]}@127.0.0.1:1/mla", [SECRET[4:], f"{SECRET[:4]}%40"]),
    (f"postgresql://tuner:{SECRET}@127.0.0.1:1/mla?sslmode=require&password={SECRET}x", [SECRET]),
]
COMMANDS = [("show",), ("show", "--json"), ("db", "upgrade"), ("export", "--out", "OUT"),
            ("lookup", "--heads", "16", "--kv-cache-dtype", "bf16", "--device-name", "NVIDIA H100 80GB HBM3",
             "--cc", "9.0"),
            ("lookup", "--format", "json", "--heads", "16", "--kv-cache-dtype", "bf16", "--device-name",
             "NVIDIA H100 80GB HBM3", "--cc", "9.0")]


def _invoke(args, env=None):
    """`mla-tune ARGS` in this process, forgetting the URLs earlier invocations remembered."""
    from click.testing import CliRunner

    from mla_tune.cli import output
    from mla_tune.cli.main import main
    from mla_tune.runtime import clear_cache

    output._URLS.clear()
    clear_cache()
    return CliRunner().invoke(main, list(args), env=env, catch_exceptions=False)


@pytest.mark.parametrize("url, secrets", FORMS, ids=[f"form{i}" for i in range(len(FORMS))])
def test_no_password_form_leaks_through_any_command(url, secrets, tmp_path):
    for command in COMMANDS:
        args = [str(tmp_path / "out.json") if a == "OUT" else a for a in command]
        for where, env in (((("--db", url, *args)), None), (((*args, "--db", url)), None),
                           (args, {"MLA_TUNE_DB": url})):
            result = _invoke(where, env)
            text = result.stdout + result.stderr
            assert result.exit_code in (0, 1, 2) and "Traceback" not in text, text
            for secret in secrets:
                assert secret not in text, (command, text)


@pytest.mark.postgres
def test_a_working_password_url_is_never_printed(pg_url, tmp_path):
    from pg_server import PASSWORD

    query_form = pg_url.replace(f":{PASSWORD}@", "@") + f"?password={PASSWORD}"
    export = export_file(filled_store(f"sqlite:///{tmp_path / 'source.db'}"), tmp_path / "x.json")
    for url in (pg_url, query_form):
        for args in (("db", "upgrade"), ("import", export), ("show",), ("export", "--out", tmp_path / "o.json")):
            result = run_cli("--db", url, *args, env={"COLUMNS": "300"})
            assert result.returncode == 0, result.stderr
            assert PASSWORD not in result.stdout + result.stderr
    wrong = pg_url.replace(PASSWORD, "Wr0ng-" + PASSWORD[:3] + " x")
    result = run_cli("--db", wrong, "show")
    assert result.returncode == 1 and "Wr0ng" not in result.stderr and "refused the credentials" in result.stderr
