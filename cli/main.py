"""The `mla-tune` command group: global options, error handling, subcommand registration.

Each subcommand lives in its own module and is registered from `COMMANDS`
below (one line each). Every usage error is one line on stderr with exit
status 2; a library error becomes one line with exit status 1; no traceback.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import re
import sys

import click

from mla_tune import __version__
from mla_tune.cli.output import print_json, remember_url, safe

# (module, attribute) of each subcommand, in help order; add one line per new command.
COMMANDS = [
    ("mla_tune.cli.probe", "probe"),
    ("mla_tune.cli.backends_cmd", "backends"),
    ("mla_tune.cli.lookup", "lookup"),
    ("mla_tune.cli.show", "show"),
    ("mla_tune.cli.db", "db"),
    ("mla_tune.cli.tune", "tune"),
    ("mla_tune.cli.fleet", "export_cmd"),
    ("mla_tune.cli.fleet", "import_cmd"),
    ("mla_tune.cli.fleet", "report_cmd"),
]


class MainGroup(click.Group):
    """A click group whose errors are one line on stderr (click prints usage and a hint).

    When the command line asks for JSON (`--json`, `--format json`), a failure also prints
    `{"error": ..., "exit_status": ...}` on stdout, so that a program reading stdout always gets JSON.
    """

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        args = list(sys.argv[1:] if args is None else args)
        remember_url(os.environ.get("MLA_TUNE_DB"))
        for i, arg in enumerate(args):  # passwords of every --db given, even one that fails to parse
            if arg == "--db" and i + 1 < len(args):
                remember_url(args[i + 1])
            elif arg.startswith("--db="):
                remember_url(arg[5:])
        try:
            with self.make_context(prog_name or "mla-tune", list(args), **extra) as ctx:
                self.invoke(ctx)
        except click.exceptions.Exit as exc:
            sys.exit(exc.exit_code)
        except click.UsageError as exc:
            _error(exc.format_message(), 2, args)
        except click.ClickException as exc:
            _error(exc.format_message(), exc.exit_code, args)
        except click.Abort:
            _error("aborted", 1, args, prefix="mla-tune: ")
        except KeyboardInterrupt:
            _error("interrupted", 130, args, prefix="mla-tune: ")
        except BrokenPipeError:
            sys.exit(1)
        sys.exit(0)


def wants_json(args: list[str]) -> bool:
    """Whether the command line asks for JSON output on stdout."""
    for i, arg in enumerate(args):
        if arg == "--json" or arg == "--format=json" or (arg == "--format" and args[i + 1:i + 2] == ["json"]):
            return True
    return False


def _error(message: str, exit_code: int, args: list[str], *, prefix: str = "mla-tune: error: ") -> None:
    line = _one_line(safe(message))
    if wants_json(args):
        with contextlib.suppress(Exception):
            print_json({"error": line, "exit_status": exit_code})
    click.echo(f"{prefix}{line}", err=True)
    sys.exit(exit_code)


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


_PLAIN_SQLITE = re.compile(r"sqlite:///([^?#]+)")


def validated_db_url(url: str | None) -> str:
    """The store URL to use (`--db`, `$MLA_TUNE_DB` or the default), or a usage error. Creates nothing."""
    from mla_tune.store.engine import default_url, resolve_url

    raw = (url or "").strip() or default_url()
    remember_url(raw)
    plain = _PLAIN_SQLITE.fullmatch(raw)
    if plain and plain.group(1) != ":memory:":
        # The common case, resolved as `resolve_url` would, without importing SQLAlchemy
        # (~300 ms on the 2-core dev machine, by `python -X importtime`):
        # `mla-tune lookup` runs in engines' init containers and start-up scripts.
        return f"sqlite:///{os.path.abspath(os.path.expanduser(plain.group(1)))}"
    try:
        return resolve_url(raw)
    except ValueError as exc:
        raise click.BadParameter(_one_line(exc), param_hint="'--db'") from None


@click.group(cls=MainGroup, invoke_without_command=True,
             context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.option("--db", "db_url", metavar="URL", envvar="MLA_TUNE_DB", show_envvar=True,
              help="SQLAlchemy URL of the decision store (default: an SQLite file in the user's data directory).")
@click.version_option(__version__, "--version", prog_name="mla-tune", message="%(prog)s %(version)s")
@click.pass_context
def main(ctx: click.Context, db_url: str | None) -> None:
    """Measure which MLA decode backend is fastest on this GPU, and serve the answer.

    With no command, runs the main job: probe the GPU, tune every key not yet
    tuned with this software, store the decisions and print them. Without an
    NVIDIA GPU it says so and prints vLLM's static choices instead.

    Example: mla-tune --db sqlite:///decisions.db lookup --heads 64 --kv-cache-dtype fp8
    """
    ctx.ensure_object(dict)
    ctx.obj["db"] = validated_db_url(db_url) if db_url else None
    if ctx.invoked_subcommand is None:
        from mla_tune.cli.mainjob import run_main_job

        run_main_job(ctx)


def db_url(ctx: click.Context) -> str:
    """The resolved store URL for a subcommand (validated `--db`, else the default)."""
    root = ctx.find_root()
    url = (root.obj or {}).get("db")
    return url if url is not None else validated_db_url(None)


for _module, _attr in COMMANDS:
    main.add_command(getattr(importlib.import_module(_module), _attr))
