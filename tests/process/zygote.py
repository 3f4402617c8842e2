"""The parent's end of ``_scenario_zygote.py``: a fork server for ``dag.test()`` task processes.

:class:`ScenarioZygote` starts the server once per session (it pays the imports); each
:meth:`ScenarioZygote.start` forks one task process from it and returns a :class:`ForkedProcess`,
which :class:`tests.process.harness.TaskProcess` uses where it would use a ``Popen``. What the
child runs and what the test does to it are unchanged (see the server's docstring).
"""

from __future__ import annotations

import json
import os
import queue
import socket
import subprocess
import sys
import threading
from pathlib import Path
from typing import IO, Any

from tests.taskproc import ROOT, STARTUP

SERVER = Path(__file__).with_name("_scenario_zygote.py")

#: Variables read when the interpreter starts or Airflow is imported (``PYTHON*``; Airflow's home and
#: configuration, partly cached at import): a child's must be the server's. Connections and
#: variables are looked up when used; what else a child sets (``SCENARIO``, ``MCP_*``,
#: ``PYTEST_CURRENT_TEST``) is read by the scenario after the fork.
IMPORT_TIME = ("PYTHON", "AIRFLOW", "_AIRFLOW")
LOOKED_UP_WHEN_USED = ("AIRFLOW_CONN_", "AIRFLOW_VAR_")


class ForkedProcess:
    """A task process forked by the zygote, with the part of ``Popen``'s interface tests use."""

    def __init__(self, zygote: ScenarioZygote, pid: int, stdin: IO[bytes]) -> None:
        self._zygote, self.pid, self.stdin = zygote, pid, stdin
        self.returncode: int | None = None

    def poll(self) -> int | None:
        self.returncode = self._zygote.exit_code(self.pid, timeout=0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        code = self._zygote.exit_code(self.pid, timeout)
        if code is None:
            raise subprocess.TimeoutExpired(str(self.pid), timeout or 0)
        self.returncode = code
        return code

    def kill(self) -> None:
        if self.poll() is None:
            os.kill(self.pid, 9)


class ScenarioZygote:
    """The fork server; ``env`` is the environment every child shares (Airflow's home, config):
    a child's ``PYTHON*`` and ``AIRFLOW*`` variables must be these."""

    def __init__(self, env: dict[str, str], log_path: Path) -> None:
        self.env = env
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._log = log_path.open("ab")
        self.log_path = log_path
        self.proc = subprocess.Popen(
            [sys.executable, str(SERVER)],
            env={**self.env, "ZYGOTE_SOCKET": str(theirs.fileno())},
            cwd=ROOT,
            pass_fds=(theirs.fileno(),),
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )
        theirs.close()
        self._sock = ours
        self._replies: queue.Queue[dict[str, Any]] = queue.Queue()
        self._exits: dict[int, int] = {}
        self._exited = threading.Condition()
        self._lock = threading.Lock()
        self._reader = threading.Thread(target=self._read, daemon=True, name="zygote-reader")
        self._reader.start()
        try:
            ready = self._replies.get(timeout=STARTUP)
        except queue.Empty:
            ready = {}
        assert ready.get("ready"), f"the zygote did not start:\n{self.tail()}"

    def _read(self) -> None:
        while message := self._sock.recv(1 << 16):
            reply = json.loads(message)
            if "exited" in reply:
                with self._exited:
                    self._exits[reply["exited"]] = reply["code"]
                    self._exited.notify_all()
            else:
                self._replies.put(reply)
        self._replies.put({})  # the server is gone

    def exit_code(self, pid: int, timeout: float | None) -> int | None:
        with self._exited:
            self._exited.wait_for(lambda: pid in self._exits, timeout)
            return self._exits.get(pid)

    def start(
        self,
        argv: list[str],
        env: dict[str, str],
        stdout: int,
        stderr: int | None = None,
        *,
        events: tuple[str, int] | None = None,
        new_session: bool = False,
    ) -> ForkedProcess:
        """Fork ``python SCRIPT ARGS...`` (``argv``) with ``env``, writing to the fds ``stdout`` and
        ``stderr`` (``stdout`` if not given); ``events``: the variable naming its events fd, and
        that fd. ``new_session``: ``setsid()`` first, as ``Popen(start_new_session=True)``."""
        assert argv[0] == sys.executable and len(argv) >= 2, f"the zygote runs a script: {argv}"
        differs = {k for k in env.keys() | self.env.keys() if env.get(k) != self.env.get(k)}
        imported = sorted(
            k for k in differs if k.startswith(IMPORT_TIME) and not k.startswith(LOOKED_UP_WHEN_USED)
        )
        assert not imported, f"these would differ from what the zygote imported Airflow with: {imported}"
        stdin_r, stdin_w = os.pipe()
        request = {
            "argv": argv[1:],
            "env": env,
            "cwd": str(ROOT),
            "setsid": new_session,
            "events_env": events[0] if events else None,
        }
        fds = [stdin_r, stdout, stdout if stderr is None else stderr, *([events[1]] if events else [])]
        try:
            with self._lock:
                socket.send_fds(self._sock, [json.dumps(request).encode()], fds)
                reply = self._replies.get(timeout=STARTUP)
        finally:
            os.close(stdin_r)
        assert "pid" in reply, f"the zygote did not fork:\n{self.tail()}"
        return ForkedProcess(self, int(reply["pid"]), os.fdopen(stdin_w, "wb"))

    def tail(self, lines: int = 60) -> str:
        self._log.flush()
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def close(self) -> None:
        self._sock.shutdown(socket.SHUT_RDWR)
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
        self._sock.close()
        self._log.close()
