"""A real Airflow 3 on loopback for end-to-end tests: api-server, scheduler, dag-processor, and
(``triggerer=True``) a triggerer.

``AirflowStack`` owns a fresh ``AIRFLOW_HOME`` (SQLite unless given a PostgreSQL URL, as the
Celery e2e and the fleet benchmark are: ``tests/e2e/postgres.py``; LocalExecutor, no examples,
the simple auth manager with a known admin password), starts each component in its own process group with
its output in ``AIRFLOW_HOME/components/NAME.log``, waits for ``/api/v2/monitor/health`` to say
everything is healthy, and stops exactly the processes it started (by process group and by the
pids it saw under them). ``RestClient`` talks to the public REST API with a JWT obtained the way
the UI does (``POST /auth/token``), sends one write at a time, and retries idempotent calls when
SQLite's single writer makes the server answer 5xx.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import httpx
import psutil

from tests.airflow_env import AIRFLOW, airflow_env, migrate

T = TypeVar("T")

ADMIN_USER = "admin"
#: A second user with no role: the simple auth manager grants it no DAG (authorization tests).
NO_ACCESS_USER = "no_access"
#: Components that must report healthy before a test may trigger anything.
HEALTHY_COMPONENTS = ("metadatabase", "scheduler", "dag_processor")
#: How long the scheduler and the dag-processor wait for SQLite's write lock (sqlite3's default
#: is 5 s). An audit-log commit on the api-server's event loop can still meet a task's write
#: whose commit that loop must schedule (a task state store PUT, a heartbeat: see RestClient):
#: then the api-server stands still, lock held, until its own 5 s wait gives up, and a scheduler
#: write that waited as long exits the scheduler. Measured: SQLite's lock held 8 s just after runs
#: were queued ended the scheduler at once; with 20 s it lived through three of them. The
#: api-server keeps the default: a longer wait would make its stall that much longer. Below the
#: 30 s after which /health calls a scheduler without a heartbeat unhealthy.
SCHEDULER_DB_WAIT_S = 20


def free_port() -> int:
    """An ephemeral loopback port that was free a moment ago (the server binds it right after)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_until(
    probe: Callable[[], T | None],
    timeout: float,
    what: str,
    *,
    interval: float = 0.1,
    on_timeout: Callable[[], str] | None = None,
) -> T:
    """Poll ``probe`` until it returns something truthy; fail naming ``what`` after ``timeout`` s.

    Used only where there is no event to await (another process's state behind HTTP or /proc).
    """
    deadline = time.monotonic() + timeout
    last: T | None = None
    while True:
        last = probe()
        if last:
            return last
        if time.monotonic() >= deadline:
            details = on_timeout() if on_timeout else ""
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}\n{details}")
        time.sleep(interval)


def tail(path: Path, lines: int = 80) -> str:
    """The last ``lines`` lines of a text file (empty if it does not exist)."""
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    return "\n".join(text[-lines:])


@dataclass
class Component:
    """One Airflow process we started; it leads its own process group."""

    name: str
    proc: subprocess.Popen[bytes]
    log_path: Path
    seen: dict[int, float] = field(default_factory=dict)
    #: Set by a test that kills it on purpose (a Celery worker): its exit is not a failure.
    expendable: bool = False
    #: How it was started (the command line and the environment), so it can be started again.
    argv: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)

    def remember_descendants(self) -> None:
        """Note (pid, start time) of everything under us, so stop() can find it after reparenting."""
        with contextlib.suppress(psutil.Error):
            for child in psutil.Process(self.proc.pid).children(recursive=True):
                with contextlib.suppress(psutil.Error):
                    self.seen[child.pid] = child.create_time()

    def stop(self, grace: float = 15.0) -> None:
        """SIGTERM our process group, then SIGKILL it and any descendant we saw that is left."""
        self.remember_descendants()
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(grace)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        for pid, started in self.seen.items():
            with contextlib.suppress(psutil.Error):
                proc = psutil.Process(pid)
                if proc.create_time() == started:
                    proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(5)


class AirflowStack:
    """A fresh Airflow 3 (api-server + scheduler + dag-processor) on 127.0.0.1.

    :param home: an empty directory that becomes ``AIRFLOW_HOME``.
    :param dags_folder: the DAGs folder (the tests' own ``dags/``).
    :param extra_env: more environment for every component (and so for the tasks).
    :param database_url: the metadata database (a :class:`~tests.e2e.postgres.PostgresCluster`'s
        URL where several components write at once); SQLite in ``home`` by default.
    :param triggerer: also run ``airflow triggerer`` (deferred tasks wait there), and wait for it
        to report healthy too.
    """

    def __init__(
        self,
        home: Path,
        dags_folder: Path,
        extra_env: dict[str, str],
        *,
        database_url: str | None = None,
        triggerer: bool = False,
    ) -> None:
        self.home = home
        self.triggerer = triggerer
        self.database_url = database_url or f"sqlite:///{home / 'airflow.db'}"
        self.dags_folder = dags_folder
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.password = secrets.token_urlsafe(12)
        self.components: dict[str, Component] = {}
        (home / "components").mkdir(parents=True, exist_ok=True)
        passwords = home / "simple_auth_manager_passwords.json"
        passwords.write_text(json.dumps({ADMIN_USER: self.password, NO_ACCESS_USER: self.password}))
        self.env = airflow_env(home, {**self._stack_env(passwords), **extra_env}, dags_folder=dags_folder)

    def _stack_env(self, passwords: Path) -> dict[str, str]:
        """What a whole stack needs beyond :func:`tests.airflow_env.airflow_env`."""
        return {
            "AIRFLOW__CORE__EXECUTOR": "LocalExecutor",
            "AIRFLOW__CORE__DAGS_ARE_PAUSED_AT_CREATION": "False",
            "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS": f"{ADMIN_USER}:admin,{NO_ACCESS_USER}:",
            "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE": str(passwords),
            "AIRFLOW__CORE__EXECUTION_API_SERVER_URL": f"{self.url}/execution/",
            "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": self.database_url,
            "AIRFLOW__API__HOST": "127.0.0.1",
            "AIRFLOW__API__PORT": str(self.port),
            "AIRFLOW__API__BASE_URL": self.url,
            "AIRFLOW__API__WORKERS": "1",
            "AIRFLOW__API__SECRET_KEY": secrets.token_hex(16),
            "AIRFLOW__API_AUTH__JWT_SECRET": secrets.token_hex(32),
            # The scheduler runs with --skip-serve-logs; these keep any log server on a private port.
            "AIRFLOW__LOGGING__WORKER_LOG_SERVER_PORT": str(free_port()),
            "AIRFLOW__LOGGING__TRIGGER_LOG_SERVER_PORT": str(free_port()),
            "AIRFLOW__DAG_PROCESSOR__REFRESH_INTERVAL": "5",
            # A file's re-parse that outlasts this timeout is killed and counted as a file with no
            # Dags, and its Dags are deactivated until the next parse: under a loaded CI (fifteen
            # pods starting Airflow beside the other lane) a trigger then got 404 for a Dag that
            # had been parsed minutes before. Airflow's default is 50 s.
            "AIRFLOW__DAG_PROCESSOR__DAG_FILE_PROCESSOR_TIMEOUT": "300",
            "AIRFLOW__SCHEDULER__ENABLE_HEALTH_CHECK": "False",
            "PYTHONUNBUFFERED": "1",
        }

    # -- lifecycle -------------------------------------------------------------------------

    def migrate(self, timeout: float = 240) -> None:
        """``airflow db migrate`` into the fresh metadata database."""
        migrate(self.env, log=self.home / "components" / "db-migrate.log", timeout=timeout)

    def start(self) -> None:
        """Start the three components, each leading its own process group."""
        self._spawn("api-server", ["api-server", "--host", "127.0.0.1", "--port", str(self.port)])
        db = self.env["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"]
        patient = {"AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"{db}?timeout={SCHEDULER_DB_WAIT_S}"}
        if not db.startswith("sqlite:"):
            patient = {}  # PostgreSQL has no single writer to wait for
        self._spawn("scheduler", ["scheduler", "--skip-serve-logs"], env=patient)
        self._spawn("dag-processor", ["dag-processor"], env=patient)
        if self.triggerer:
            self._spawn("triggerer", ["triggerer", "--skip-serve-logs"], env=patient)

    def _spawn(
        self,
        name: str,
        args: list[str],
        *,
        argv: list[str] | None = None,
        env: dict[str, str] | None = None,
        append: bool = False,
    ) -> Component:
        """Start ``airflow ARGS`` (or ``argv``) with the stack's environment plus ``env``; its log
        is started afresh unless ``append``."""
        log_path = self.home / "components" / f"{name}.log"
        command, environment = argv or [*AIRFLOW, *args], {**self.env, **(env or {})}
        log = log_path.open("ab" if append else "wb")
        proc = subprocess.Popen(
            command,
            env=environment,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        log.close()
        self.components[name] = Component(name, proc, log_path, argv=command, env=environment)
        return self.components[name]

    def restart(self, name: str, grace: float = 30.0) -> float:
        """SIGTERM component ``name``'s process group (as a deploy or a node drain does), wait up
        to ``grace`` s for it to exit, and start it again as it was started, its log appended.
        Returns when the old one had exited (``time.time()``); fails if it did not exit in time."""
        old = self.components[name]
        old.remember_descendants()
        os.killpg(old.proc.pid, signal.SIGTERM)
        try:
            old.proc.wait(grace)
        except subprocess.TimeoutExpired:
            old.stop()
            raise AssertionError(f"{name} did not exit within {grace:.0f} s of SIGTERM") from None
        exited = time.time()
        old.stop(grace=0)  # anything of it still in its group
        self._spawn(name, [], argv=old.argv, env=old.env, append=True)
        return exited

    def wait_healthy(self, timeout: float = 120) -> dict[str, Any]:
        """Poll ``/api/v2/monitor/health`` until the database, scheduler and dag-processor are healthy."""

        def probe() -> dict[str, Any] | None:
            self.check_alive()
            try:
                health = httpx.get(f"{self.url}/api/v2/monitor/health", timeout=5).json()
            except (httpx.HTTPError, ValueError):
                return None
            components = (*HEALTHY_COMPONENTS, "triggerer") if self.triggerer else HEALTHY_COMPONENTS
            ok = all((health.get(c) or {}).get("status") == "healthy" for c in components)
            return health if ok else None

        return wait_until(probe, timeout, "Airflow to report healthy", interval=0.25, on_timeout=self.logs)

    def check_alive(self) -> None:
        """Fail at once, with the logs, if a component died."""
        for component in self.components.values():
            if not component.expendable and component.proc.poll() is not None:
                raise RuntimeError(f"{component.name} exited with {component.proc.returncode}\n{self.logs()}")

    def stop(self) -> None:
        for component in reversed(list(self.components.values())):
            component.stop()

    def remember_processes(self) -> None:
        """Record the pids under every component (tasks, executor workers) for stop()."""
        for component in self.components.values():
            component.remember_descendants()

    # -- diagnostics -----------------------------------------------------------------------

    def logs(self, lines: int = 60, names: Iterable[str] | None = None) -> str:
        """Tails of the components' logs, for failure messages."""
        chosen = list(names) if names is not None else [*self.components, "db-migrate"]
        parts = []
        for name in chosen:
            path = self.home / "components" / f"{name}.log"
            parts.append(f"----- {name} ({path}) -----\n{tail(path, lines)}")
        return "\n".join(parts)

    def task_log_files(self, dag_id: str, run_id: str, task_id: str) -> list[Path]:
        """The task's log files under ``AIRFLOW_HOME/logs`` (one per try)."""
        root = self.home / "logs" / f"dag_id={dag_id}" / f"run_id={run_id}" / f"task_id={task_id}"
        return sorted(root.glob("attempt=*.log"))

    def client(self) -> RestClient:
        return RestClient(self.url, ADMIN_USER, self.password)


#: Methods that write nothing, so the REST API logs no audit row for them.
READS = frozenset({"GET", "HEAD", "OPTIONS"})


class RestClient:
    """The public REST API with a UI-style JWT; idempotent calls are retried on 5xx/connection errors.

    Writes (POST, PATCH, PUT, DELETE) go one at a time, however many test threads send them.
    Airflow's REST API writes its audit-log row (``action_logging``) from an ``async`` dependency:
    a blocking SQLite commit on the api-server's event loop. When a second write arrives while the
    first one's transaction is open, that commit waits for SQLite's lock on the loop thread, and
    the first request's own commit, which the loop must schedule, cannot run: the whole api-server
    stands still for SQLite's 5 s busy timeout per queued write, the writes end in 500 "database
    is locked", and a scheduler write that waited as long exits the scheduler. Six concurrent
    triggers stalled it in 6 of 12 rounds (5 to 25 s; the scheduler died), none of 12 when sent
    one at a time (each takes ~10 ms).
    """

    def __init__(self, url: str, username: str, password: str) -> None:
        self.url = url
        self._http = httpx.Client(base_url=url, timeout=30)
        self._writes = threading.Lock()
        token = self._login(username, password)
        self._http.headers["Authorization"] = f"Bearer {token}"

    def _login(self, username: str, password: str) -> str:
        response = self._retry(
            lambda: self._http.post("/auth/token", json={"username": username, "password": password})
        )
        if response.status_code != 201:
            raise AssertionError(f"login failed: {response.status_code} {response.text}")
        return str(response.json()["access_token"])

    @staticmethod
    def _retry(call: Callable[[], httpx.Response], attempts: int = 5) -> httpx.Response:
        """Call again (up to ``attempts`` times) while the server answers 5xx or drops the connection."""
        for attempt in range(attempts):
            try:
                response = call()
            except httpx.TransportError:
                if attempt == attempts - 1:
                    raise
            else:
                if response.status_code < 500 or attempt == attempts - 1:
                    return response
            time.sleep(0.2 * (attempt + 1))
        raise AssertionError("unreachable")

    def request(self, method: str, path: str, *, retry: bool = True, **kwargs: Any) -> httpx.Response:
        """One REST call; ``retry`` only for calls that are safe to repeat. A write waits for the
        write in flight, if any, to be answered (see the class docstring)."""

        def call() -> httpx.Response:
            if method.upper() in READS:
                return self._http.request(method, path, **kwargs)
            with self._writes:
                return self._http.request(method, path, **kwargs)

        return self._retry(call) if retry else call()

    def json(self, method: str, path: str, *, expect: Iterable[int] = (200,), **kwargs: Any) -> Any:
        """A REST call whose status must be in ``expect``; returns the JSON body."""
        response = self.request(method, path, **kwargs)
        if response.status_code not in tuple(expect):
            raise AssertionError(f"{method} {path} -> {response.status_code}: {response.text}")
        return response.json() if response.content else None

    def close(self) -> None:
        self._http.close()
