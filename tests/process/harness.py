"""Start a real task process, await its events, and signal it the way Airflow does."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

DAGS_FOLDER = Path(__file__).with_name("dags")
SCENARIOS = DAGS_FOLDER / "task_scenarios.py"


class TaskProcess:
    """A child running ``task_scenarios.py SCENARIO``; events arrive over a pipe as JSON lines."""

    def __init__(self, scenario: str, env: dict[str, str], log_dir: Path, script: Path = SCENARIOS) -> None:
        read_fd, write_fd = os.pipe()
        self.log_path = log_dir / f"{scenario}.log"
        self._log = self.log_path.open("wb")
        self.proc = subprocess.Popen(
            [sys.executable, str(script)],
            env={
                **env,
                "SCENARIO": scenario,
                "SCENARIO_EVENTS_FD": str(write_fd),
                # dag.test() parses the script's whole folder: one scenario file per folder.
                "AIRFLOW__CORE__DAGS_FOLDER": str(script.parent),
            },
            pass_fds=(write_fd,),
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )
        os.close(write_fd)
        self.events: list[dict[str, Any]] = []
        self._queue: queue.Queue[dict[str, Any]] = queue.Queue()
        self._reader = threading.Thread(target=self._read, args=(read_fd,), daemon=True)
        self._reader.start()

    def _read(self, fd: int) -> None:
        with os.fdopen(fd, "rb") as pipe:
            for line in pipe:
                event = json.loads(line)
                self.events.append(event)
                self._queue.put(event)

    def wait_for(self, name: str | tuple[str, ...], timeout: float = 30.0, **fields: Any) -> dict[str, Any]:
        """Return the first event called ``name`` (or any of the names) with ``fields``, waiting up to
        ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        names = (name,) if isinstance(name, str) else name

        def matches(event: dict[str, Any]) -> bool:
            return event["event"] in names and all(event.get(k) == v for k, v in fields.items())

        for event in list(self.events):
            if matches(event):
                return event
        while (left := deadline - time.monotonic()) > 0:
            try:
                event = self._queue.get(timeout=left)
            except queue.Empty:
                break
            if matches(event):
                return event
        raise AssertionError(f"no {name!r} event within {timeout}s; events: {self.names()}\n{self.tail()}")

    def event(self, name: str) -> dict[str, Any] | None:
        return next((e for e in self.events if e["event"] == name), None)

    def names(self) -> list[str]:
        return [e["event"] for e in self.events]

    def sigterm(self, times: int = 1) -> float:
        """Send SIGTERM to the task pid only (as the supervisor does); return when (monotonic)."""
        sent = time.monotonic()
        for _ in range(times):
            os.kill(self.proc.pid, signal.SIGTERM)
        return sent

    def wait_exit(self, timeout: float = 30.0) -> int:
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired as exc:
            raise AssertionError(f"task process still running after {timeout}s\n{self.tail()}") from exc
        self._reader.join(5)
        return code

    def tail(self, lines: int = 60) -> str:
        self._log.flush()
        text = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(text[-lines:])

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self._log.close()
