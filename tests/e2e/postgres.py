"""A throwaway PostgreSQL for an Airflow metadata database: initdb in a temp dir, one server.

Production runs Airflow's metadata database on PostgreSQL wherever more than one component
writes at once (a Celery or Kubernetes executor, a fleet of tasks writing their task state
store): SQLite's single writer stalls the api-server there ("database is locked") and ends the
scheduler. ``PostgresCluster`` gives the tests and the fleet benchmark that database: Debian's
``postgresql`` server binaries, a cluster initialised in a temp directory, listening on a free
loopback port and a private Unix socket directory, stopped (fast shutdown, then SIGKILL) after.

PostgreSQL refuses to run as root; as root the cluster is owned by and run as ``nobody``
(``setpriv``). The cluster lives in a directory of its own under the system temp dir (a
pytest tmp dir is private to root, so ``nobody`` could not reach it), removed at ``stop``.
"""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import signal
import subprocess
import tempfile
from pathlib import Path

from tests.e2e.airflow_stack import free_port, tail, wait_until

#: Where Debian's ``postgresql-NN`` puts the server binaries (only ``pg_ctlcluster`` and the
#: clients are on PATH there).
DEBIAN_BIN_GLOB = "/usr/lib/postgresql/*/bin"
#: The user the server runs as when we are root.
UNPRIVILEGED = "nobody"
DATABASE = "airflow"


def server_bin_dir() -> Path | None:
    """The directory holding ``initdb`` and ``postgres``: PATH first, else Debian's newest."""
    on_path = shutil.which("initdb")
    if on_path is not None and shutil.which("postgres") is not None:
        return Path(on_path).resolve().parent
    found = [Path(d) for d in glob.glob(DEBIAN_BIN_GLOB) if (Path(d) / "initdb").exists()]
    return max(found, key=lambda d: _major(d.parent.name), default=None)


def _major(name: str) -> int:
    return int(name) if name.isdigit() else -1


def missing_reason() -> str | None:
    """Why a cluster cannot be started here (for a skip), or ``None`` if it can."""
    if server_bin_dir() is None:
        return "PostgreSQL's server binaries (Debian: postgresql) are not installed; run `make system-deps`"
    if os.geteuid() == 0 and shutil.which("setpriv") is None:
        return "running as root needs setpriv (util-linux) to start PostgreSQL as an unprivileged user"
    return None


class PostgresCluster:
    """One PostgreSQL server on 127.0.0.1 (``start`` / ``stop``; a context manager).

    :param max_connections: Airflow's components each hold a pool (5 + 10 overflow by default),
        and every task's supervisor talks through the api-server's pool; 200 leaves room.
    :param log_path: where the server writes its log; ``None`` puts it in the cluster's
        directory, removed at ``stop``. A path outside it outlives the cluster, for a benchmark
        whose database side is read afterwards.
    :param settings: further server settings (``-c name=value``), e.g. what to log.
    """

    def __init__(
        self,
        *,
        max_connections: int = 200,
        log_path: Path | None = None,
        settings: dict[str, str] | None = None,
    ) -> None:
        bin_dir = server_bin_dir()
        if bin_dir is None:
            raise RuntimeError(missing_reason())
        self.bin_dir = bin_dir
        self.root = Path(tempfile.mkdtemp(prefix="cancellable-agents-pg-"))
        self.data = self.root / "data"
        self.sockets = self.root / "sockets"
        self.log_path = log_path or self.root / "postgres.log"
        self.port = free_port()
        self.max_connections = max_connections
        self.settings = settings or {}
        self.proc: subprocess.Popen[bytes] | None = None
        self._as_user = UNPRIVILEGED if os.geteuid() == 0 else None

    @property
    def user(self) -> str:
        """The database superuser initdb created (the OS user the server runs as)."""
        if self._as_user is not None:
            return self._as_user
        import pwd

        return pwd.getpwuid(os.geteuid()).pw_name

    @property
    def sqlalchemy_url(self) -> str:
        """``AIRFLOW__DATABASE__SQL_ALCHEMY_CONN`` for the ``airflow`` database (psycopg2)."""
        return f"postgresql+psycopg2://{self.user}@127.0.0.1:{self.port}/{DATABASE}"

    def _argv(self, *args: str) -> list[str]:
        if self._as_user is None:
            return list(args)
        return ["setpriv", "--reuid", self._as_user, "--regid", "nogroup", "--clear-groups", *args]

    def start(self, timeout: float = 60) -> PostgresCluster:
        """initdb, start the server, wait until it accepts connections, create the database; on
        any failure, stop what was started and remove the directory before raising."""
        try:
            return self._start(timeout)
        except BaseException:
            self.stop()
            raise

    def _start(self, timeout: float) -> PostgresCluster:
        self.sockets.mkdir(exist_ok=True)
        if self._as_user is not None:
            import pwd

            entry = pwd.getpwnam(self._as_user)
            for path in (self.root, self.sockets):
                os.chown(path, entry.pw_uid, entry.pw_gid)
        init = [str(self.bin_dir / "initdb"), "-D", str(self.data), "-A", "trust", "-E", "UTF8"]
        init += ["--no-sync", "-U", self.user]
        done = subprocess.run(self._argv(*init), capture_output=True, timeout=timeout, cwd=self.root)
        if done.returncode != 0:
            raise RuntimeError(f"initdb failed ({done.returncode}): {done.stderr.decode(errors='replace')}")
        server = [str(self.bin_dir / "postgres"), "-D", str(self.data), "-p", str(self.port)]
        server += ["-k", str(self.sockets), "-c", "listen_addresses=127.0.0.1"]
        server += ["-c", f"max_connections={self.max_connections}"]
        # A throwaway database: durability buys nothing and fsync costs a 2-core CI box its time.
        server += ["-c", "fsync=off", "-c", "synchronous_commit=off", "-c", "full_page_writes=off"]
        for name, value in self.settings.items():
            server += ["-c", f"{name}={value}"]
        with self.log_path.open("wb") as log:
            self.proc = subprocess.Popen(
                self._argv(*server),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                cwd=self.root,
            )
        wait_until(
            self._ready, timeout, "PostgreSQL to accept connections", interval=0.1, on_timeout=self.logs
        )
        self._createdb(timeout)
        return self

    def _ready(self) -> bool:
        if self.proc is not None and self.proc.poll() is not None:
            raise RuntimeError(f"postgres exited with {self.proc.returncode}\n{self.logs()}")
        probe = [str(self.bin_dir / "pg_isready"), "-h", "127.0.0.1", "-p", str(self.port), "-q"]
        return subprocess.run(probe, capture_output=True, timeout=10).returncode == 0

    def _createdb(self, timeout: float) -> None:
        create = [str(self.bin_dir / "createdb"), "-h", "127.0.0.1", "-p", str(self.port), "-U", self.user]
        done = subprocess.run([*create, DATABASE], capture_output=True, timeout=timeout)
        if done.returncode != 0:
            raise RuntimeError(f"createdb failed: {done.stderr.decode(errors='replace')}\n{self.logs()}")

    def stop(self, grace: float = 15.0) -> None:
        """Fast shutdown (SIGINT: disconnect clients, stop), then SIGKILL the group if it lingers."""
        proc, self.proc = self.proc, None
        if proc is not None:
            self._end(proc, grace)
        shutil.rmtree(self.root, ignore_errors=True)

    @staticmethod
    def _end(proc: subprocess.Popen[bytes], grace: float) -> None:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGINT)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(grace)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(5)

    def logs(self, lines: int = 40) -> str:
        return f"----- postgres ({self.log_path}) -----\n{tail(self.log_path, lines)}"

    def __enter__(self) -> PostgresCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
