"""A CeleryExecutor Airflow on loopback: a private ``redis-server``, the three components, workers.

``CeleryStack`` is an :class:`~tests.e2e.airflow_stack.AirflowStack` whose executor is Celery
(broker and result backend in a ``redis-server`` it starts on a free loopback port, nothing
saved to disk). Workers are components too (``worker-NAME``), each with its own queues and
extra environment (``REMAP_SIGTERM``, ``AIRFLOW__CELERY__EXTRA_CELERY_CONFIG`` ...), so a test
can kill one on purpose (mark it ``expendable`` first). The test process talks to the workers
the way ``celery control`` does (a plain Celery app on the same broker): ``ping`` for readiness,
``add_consumer`` to let a standby worker take a queue over once try 1 is running elsewhere.

Measured facts this relies on: celery 5.7.0 breaks the Celery provider's import (pyproject's
``celery`` extra pins below it), and a worker answers ``ping`` ~40 s after its start on 2 cores.
"""

from __future__ import annotations

import contextlib
import shutil
import socket
from pathlib import Path
from typing import Any

from tests.e2e.airflow_stack import AirflowStack, Component, free_port, wait_until

REDIS_SERVER = shutil.which("redis-server")
#: Scheduler's orphan detection, kept short so a try whose supervisor vanished is retried fast
#: (default 300 s). The supervisor heartbeats every 5 s ([workers] min_heartbeat_interval), so
#: 12 s tolerates one late heartbeat on a loaded machine.
HEARTBEAT_TIMEOUT_S = 12
HEARTBEAT_DETECTION_S = 2


class CeleryStack(AirflowStack):
    """``AirflowStack`` with ``CeleryExecutor``, a private Redis and Celery workers."""

    def __init__(
        self, home: Path, dags_folder: Path, extra_env: dict[str, str], *, database_url: str | None = None
    ) -> None:
        if REDIS_SERVER is None:
            raise RuntimeError("redis-server is not installed; run `make system-deps`")
        self.redis_port = free_port()
        self.broker_url = f"redis://127.0.0.1:{self.redis_port}/0"
        celery_env = {
            "AIRFLOW__CORE__EXECUTOR": "CeleryExecutor",
            "AIRFLOW__CELERY__BROKER_URL": self.broker_url,
            "AIRFLOW__CELERY__RESULT_BACKEND": f"redis://127.0.0.1:{self.redis_port}/1",
            "AIRFLOW__CELERY__WORKER_CONCURRENCY": "2",
            "AIRFLOW__SCHEDULER__TASK_INSTANCE_HEARTBEAT_TIMEOUT": str(HEARTBEAT_TIMEOUT_S),
            "AIRFLOW__SCHEDULER__TASK_INSTANCE_HEARTBEAT_TIMEOUT_DETECTION_INTERVAL": str(
                HEARTBEAT_DETECTION_S
            ),
        }
        super().__init__(home, dags_folder, {**celery_env, **extra_env}, database_url=database_url)
        self.host = socket.gethostname()
        self._control: Any = None

    # -- lifecycle -------------------------------------------------------------------------

    def start(self) -> None:
        """Redis first (the scheduler connects to it at start), then the three components."""
        assert REDIS_SERVER is not None
        argv = [REDIS_SERVER, "--port", str(self.redis_port), "--bind", "127.0.0.1"]
        argv += ["--save", "", "--appendonly", "no", "--dir", str(self.home)]
        self._spawn("redis", [], argv=argv)
        wait_until(self._redis_answers, 15, "redis-server to answer PING", on_timeout=self.logs)
        super().start()

    def _redis_answers(self) -> bool:
        self.check_alive()
        try:
            with socket.create_connection(("127.0.0.1", self.redis_port), timeout=1) as sock:
                sock.sendall(b"PING\r\n")
                return sock.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def start_worker(
        self, name: str, queues: list[str], env: dict[str, str] | None = None, concurrency: int = 2
    ) -> Component:
        """``airflow celery worker`` named ``NAME@host`` serving ``queues`` (not yet ready)."""
        args = ["celery", "worker", "--concurrency", str(concurrency), "--celery-hostname", f"{name}@%h"]
        args += ["--queues", ",".join(queues), "--skip-serve-logs", "--without-gossip", "--without-mingle"]
        # One pid file per worker: they share AIRFLOW_HOME, where the default one would clash.
        args += ["--pid", str(self.home / f"worker-{name}.pid")]
        return self._spawn(f"worker-{name}", args, env=env)

    def worker(self, name: str) -> Component:
        return self.components[f"worker-{name}"]

    def hostname(self, name: str) -> str:
        return f"{name}@{self.host}"

    def wait_workers(self, names: list[str], timeout: float = 120) -> None:
        """Until every named worker answers a ``ping`` (its consumer is up)."""
        wanted = {self.hostname(n) for n in names}

        def answered() -> bool:
            self.check_alive()
            replies = self.control().ping(destination=sorted(wanted), timeout=1.0) or []
            return wanted <= {host for reply in replies for host in reply}

        wait_until(answered, timeout, f"workers {sorted(wanted)} to answer ping", on_timeout=self.logs)

    def add_consumer(self, name: str, queue: str) -> None:
        """Make worker ``name`` consume ``queue`` too; returns once the worker confirmed it."""
        replies = self.control().add_consumer(queue, destination=[self.hostname(name)], reply=True, timeout=5)
        if not replies:
            raise AssertionError(f"worker {name} did not confirm add_consumer({queue!r})")

    def control(self) -> Any:
        """Celery's remote control over our broker (a bare app: no Airflow in the test process)."""
        if self._control is None:
            from celery import Celery

            self._control = Celery("cancellable-agents-e2e", broker=self.broker_url).control
        return self._control

    def stop(self) -> None:
        if self._control is not None:
            with contextlib.suppress(Exception):
                self._control.app.close()
        super().stop()


def worker_of(stack: CeleryStack, pid: int, ancestors: list[int]) -> str | None:
    """The name of the worker whose tree ``pid`` (with its ``ancestors``) is in, if any."""
    chain = {pid, *ancestors}
    for name, component in stack.components.items():
        if name.startswith("worker-") and component.proc.pid in chain:
            return name.removeprefix("worker-")
    return None


def kill_tree(root: int) -> list[int]:
    """Node loss: freeze ``root`` and every descendant (SIGSTOP), then SIGKILL them all at once."""
    import psutil

    try:
        procs = [psutil.Process(root), *psutil.Process(root).children(recursive=True)]
    except psutil.Error:
        return []
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            proc.suspend()
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            proc.kill()
    return [p.pid for p in procs]
