"""A throwaway PostgreSQL server for the tests: ``initdb`` in a temporary directory, started on a free port of
127.0.0.1 (socket in the same directory), one per test session, stopped and removed at exit.

Nothing depends on a system PostgreSQL service: only its binaries (Debian's ``postgresql`` package puts them under
/usr/lib/postgresql/VERSION/bin; ``.ci/run`` installs it). PostgreSQL refuses to run as root, so as root the server
runs as ``nobody`` through ``runuser``.
"""

from __future__ import annotations

import atexit
import contextlib
import glob
import os
import pwd
import shutil
import subprocess
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.net import free_port

USER = "tailguard"


class ClusterUnavailable(RuntimeError):
    """This machine cannot run a throwaway PostgreSQL (no binaries, no unprivileged user)."""


def _bindir() -> Path:
    found = shutil.which("pg_ctl")
    if found and shutil.which("initdb"):
        return Path(os.path.realpath(found)).parent
    candidates = sorted(glob.glob("/usr/lib/postgresql/*/bin/pg_ctl"), key=lambda p: int(p.split("/")[4]))
    if not candidates:
        raise ClusterUnavailable("PostgreSQL's initdb/pg_ctl are not installed (Debian: apt-get install postgresql)")
    return Path(candidates[-1]).parent



class PgCluster:
    def __init__(self, fsync: bool = False) -> None:
        self.fsync = fsync
        self.bindir = _bindir()
        self.runas: list[str] = []
        as_root = os.geteuid() == 0
        # As root the server runs as nobody, who must reach the directory: /tmp, not a $TMPDIR only root can enter.
        self.root = Path(tempfile.mkdtemp(prefix="tailguard-pg-", dir="/tmp" if as_root else None))
        if as_root:
            runuser = shutil.which("runuser")
            if runuser is None:
                raise ClusterUnavailable("running as root without runuser: PostgreSQL refuses to run as root")
            nobody = pwd.getpwnam("nobody")
            os.chown(self.root, nobody.pw_uid, nobody.pw_gid)
            self.runas = [runuser, "-u", "nobody", "--"]
        self.data = self.root / "data"
        self.port = free_port()
        self._run("initdb", "-D", str(self.data), "-U", USER, "--auth=trust", "-E", "UTF8", "--locale=C",
                  "--no-sync")
        self.start()

    def _run(self, tool: str, *args: str) -> None:
        out = subprocess.run([*self.runas, str(self.bindir / tool), *args], capture_output=True, text=True,
                             timeout=120, cwd=self.root)
        if out.returncode != 0:
            log = self.root / "server.log"
            tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
            raise RuntimeError(f"{tool} {' '.join(args)} failed ({out.returncode}): {out.stdout}{out.stderr}{tail}")

    def start(self) -> None:
        # fsync off for the tests (a throwaway server; a clean stop, as in the restart test, still writes everything
        # out); on for the benchmark, whose figures should hold for a real server.
        opts = (f"-p {self.port} -k {self.root} -c listen_addresses=127.0.0.1 -c fsync={'on' if self.fsync else 'off'} "
                "-c max_connections=200")
        self._run("pg_ctl", "-D", str(self.data), "-l", str(self.root / "server.log"), "-w", "-t", "60", "-o", opts,
                  "start")

    def stop(self, mode: str = "fast") -> None:
        self._run("pg_ctl", "-D", str(self.data), "-m", mode, "-w", "-t", "60", "stop")

    def url(self, database: str = "postgres") -> str:
        return f"postgresql://{USER}@127.0.0.1:{self.port}/{database}"

    @contextlib.contextmanager
    def database(self) -> Iterator[str]:
        """A new empty database for one test; its URL. Dropped afterwards (connections and all)."""
        import psycopg

        name = f"t_{uuid.uuid4().hex[:12]}"
        with psycopg.connect(self.url(), autocommit=True) as conn:
            conn.execute(f"CREATE DATABASE {name}")
        try:
            yield self.url(name)
        finally:
            with psycopg.connect(self.url(), autocommit=True) as conn:
                conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")

    def destroy(self) -> None:
        with contextlib.suppress(Exception):
            self.stop("immediate")
        shutil.rmtree(self.root, ignore_errors=True)


_cluster: PgCluster | None = None


def shared_cluster() -> PgCluster:
    """The session's PostgreSQL server, started on first use. Skips the test where none can run, except in CI
    (``CI`` set), where .ci/run installs PostgreSQL and a missing server must fail, not hide."""
    global _cluster
    if _cluster is None:
        try:
            pytest.importorskip("psycopg")
            _cluster = PgCluster()
        except ClusterUnavailable as exc:
            if os.environ.get("CI"):
                pytest.fail(f"PostgreSQL tests cannot run in CI: {exc}")
            pytest.skip(str(exc))
        atexit.register(_cluster.destroy)
    return _cluster
