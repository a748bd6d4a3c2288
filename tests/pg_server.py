"""A throwaway PostgreSQL server for the test session (Debian's `postgresql` package).

`initdb` + `pg_ctl` from `/usr/lib/postgresql/*/bin/` (or PATH) in a temporary
directory, listening only on 127.0.0.1 at a free port and on a unix socket in
that directory, with password (scram) authentication over TCP so that tests
can check that errors never print the password. PostgreSQL refuses to run as
root: as root the commands run as the `postgres` OS user (`runuser`) in a
directory it owns.

Install the binaries with: apt-get install -y postgresql
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
from dataclasses import dataclass

USER = "mla_test"
PASSWORD = "pg-s3cret-Pw"  # tests assert this never appears in output


def find_pg_bin() -> str | None:
    """The directory holding initdb/pg_ctl (newest Debian version first), or None."""
    candidates = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"),
                        key=lambda p: int(p.split("/")[4]) if p.split("/")[4].isdigit() else 0,
                        reverse=True)
    found = shutil.which("initdb")
    if found:
        candidates.append(found)
    for initdb in candidates:
        bindir = os.path.dirname(initdb)
        if os.path.exists(os.path.join(bindir, "pg_ctl")):
            return bindir
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class PgServer:
    bindir: str
    root: str
    port: int
    run_as: str | None

    @property
    def data(self) -> str:
        return os.path.join(self.root, "data")

    @property
    def log(self) -> str:
        return os.path.join(self.root, "server.log")

    def url(self, database: str = "postgres") -> str:
        return f"postgresql+psycopg://{USER}:{PASSWORD}@127.0.0.1:{self.port}/{database}"

    def _cmd(self, *args: str) -> list[str]:
        prefix = ["runuser", "-u", self.run_as, "--"] if self.run_as else []
        return [*prefix, *args]

    def _run(self, *args: str, timeout_s: float = 60) -> None:
        result = subprocess.run(self._cmd(*args), capture_output=True, text=True, timeout=timeout_s)
        if result.returncode:
            log = open(self.log).read()[-2000:] if os.path.exists(self.log) else ""
            raise RuntimeError(f"{' '.join(args[:2])} failed ({result.returncode}): "
                               f"{result.stderr.strip()[-2000:]}\n{log}")

    def stop(self) -> None:
        if os.path.exists(os.path.join(self.data, "postmaster.pid")):
            subprocess.run(self._cmd(os.path.join(self.bindir, "pg_ctl"), "-D", self.data,
                                     "-m", "immediate", "-w", "stop"),
                           capture_output=True, timeout=60)
        shutil.rmtree(self.root, ignore_errors=True)


def start_server() -> PgServer:
    """initdb a fresh cluster in a temporary directory and start it; the caller stops it."""
    bindir = find_pg_bin()
    if bindir is None:
        raise FileNotFoundError("no PostgreSQL binaries (initdb, pg_ctl) found in /usr/lib/postgresql/*/bin "
                                "or PATH; install them with: apt-get install -y postgresql")
    run_as = None
    root = tempfile.mkdtemp(prefix="mla-tune-pg-")
    if os.geteuid() == 0:
        run_as = "postgres"
        entry = pwd.getpwnam(run_as)
        os.chown(root, entry.pw_uid, entry.pw_gid)
    os.chmod(root, 0o755)  # so that the test process can read the log
    server = PgServer(bindir=bindir, root=root, port=free_port(), run_as=run_as)
    pwfile = os.path.join(root, "pwfile")
    with open(pwfile, "w") as f:
        f.write(PASSWORD + "\n")
    if run_as:
        os.chown(pwfile, entry.pw_uid, entry.pw_gid)
    try:
        server._run(os.path.join(bindir, "initdb"), "-D", server.data, "-U", USER, "-E", "UTF8",
                    "--locale=C", "--no-sync", "--auth-local=trust", "--auth-host=scram-sha-256",
                    f"--pwfile={pwfile}")
        options = (f"-h 127.0.0.1 -p {server.port} -k {root} -F "
                   f"-c max_connections=100 -c shared_buffers=32MB -c listen_addresses=127.0.0.1")
        server._run(os.path.join(bindir, "pg_ctl"), "-D", server.data, "-l", server.log,
                    "-o", options, "-w", "-t", "60", "start")
    except BaseException:
        server.stop()
        raise
    _watchdog(server)
    return server


def _watchdog(server: PgServer) -> None:
    """Stop the server and remove its directory if this process dies without doing so (killed run)."""
    stop = " ".join(server._cmd(os.path.join(server.bindir, "pg_ctl"), "-D", server.data, "-m", "immediate",
                                "-w", "stop"))
    script = (f"while kill -0 {os.getpid()} 2>/dev/null; do sleep 2; done; "
              f"if [ -e {server.data}/postmaster.pid ]; then {stop}; fi; rm -rf {server.root}")
    subprocess.Popen(["sh", "-c", script], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                     stderr=subprocess.DEVNULL, start_new_session=True)


def create_database(admin_url: str, name: str) -> None:
    _admin(admin_url, f'CREATE DATABASE "{name}"')


def drop_database(admin_url: str, name: str) -> None:
    _admin(admin_url, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def _admin(admin_url: str, sql: str) -> None:
    import psycopg

    conninfo = admin_url.replace("postgresql+psycopg://", "postgresql://", 1)
    with psycopg.connect(conninfo, autocommit=True, connect_timeout=5) as connection:
        connection.execute(sql)
