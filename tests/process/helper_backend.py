"""A second, real :class:`Sandbox` backend for the tests: commands run by a separate helper process.

The task side (:class:`HelperSandbox`) never forks a command itself: it sends JSON lines to a
helper (``python helper_backend.py``) that starts each command in a new session and answers
with its id. The task does not know the commands' pids, as with a container or a remote API.
``reply_delay`` makes the helper answer ``start`` late, *after* the command is running: the
window in which a cancel finds a running command that has no id on the task's side yet (and
that the helper's ``stop_all``, like the protocol says, does not cover: only the attachment's
race handling stops it).

The helper itself is ``_helper_process.py`` (standard library only: it starts in milliseconds).
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import threading
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from cancellable_agents.toolsets.sandbox import CommandResult, SandboxCapabilities, SandboxClosed

HELPER = Path(__file__).with_name("_helper_process.py")


class HelperSandbox:
    """The task side: implements the :class:`Sandbox` protocol over the helper's pipe.

    It declares no capability beyond the protocol but its interpreter: the attachment records its
    kills (one per command, no pid) and stops each command it started on a kill."""

    capabilities = SandboxCapabilities(python=sys.executable)

    def __init__(self, reply_delay: float = 0.0) -> None:
        self.helper = subprocess.Popen(
            [sys.executable, str(HELPER), str(reply_delay)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            bufsize=1,
        )
        self._lock = threading.Lock()
        self._replies: dict[str, dict[str, Any]] = {}  # guarded by _lock
        self._arrived = threading.Condition(self._lock)
        self._closed = False
        self._gone = False  # guarded by _lock: the helper's stdout closed, no reply comes any more
        self.pending = 0  # guarded by _lock: calls sent to the helper and not answered yet
        self.started: list[str] = []
        self.argvs: list[list[str]] = []  # what each start was given to run, as it was given
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.helper.stdout is not None
        for line in self.helper.stdout:
            reply = json.loads(line)
            with self._arrived:
                self._replies[reply["req"]] = reply
                self._arrived.notify_all()
        # The helper exited (destroyed, or killed) with calls pending, e.g. the wait a cancelled
        # tool left behind: they fail now instead of waiting out their timeout.
        with self._arrived:
            self._gone = True
            self._arrived.notify_all()

    def _call(self, op: str, timeout: float = 30.0, **args: Any) -> dict[str, Any]:
        req = uuid.uuid4().hex
        with self._lock:
            if self._closed:
                raise SandboxClosed("helper sandbox destroyed")
            if self._gone:
                raise SandboxClosed(f"the helper exited; it cannot {op}")
            assert self.helper.stdin is not None
            try:
                self.helper.stdin.write(json.dumps({"req": req, "op": op, **args}) + "\n")
                self.helper.stdin.flush()
            except BrokenPipeError as exc:  # it died before its stdout's end was read
                raise SandboxClosed(f"the helper exited; it cannot {op}") from exc
            self.pending += 1
            try:
                answered = self._arrived.wait_for(lambda: req in self._replies or self._gone, timeout)
            finally:
                self.pending -= 1
            if not answered:
                raise TimeoutError(f"helper did not answer {op} within {timeout}s")
            if req not in self._replies:
                raise SandboxClosed(f"the helper exited before it answered {op}")
            return self._replies.pop(req)

    def start(
        self,
        command: str | Sequence[str],
        *,
        timeout: float | None = None,
        stdin: str | bytes | None = None,
        env: Mapping[str, str] | None = None,
    ) -> str:
        argv = ["/bin/sh", "-c", command] if isinstance(command, str) else list(command)
        self.argvs.append(list(command) if not isinstance(command, str) else [command])
        text = stdin.decode() if isinstance(stdin, bytes) else stdin
        command_id = str(
            self._call("start", argv=argv, timeout_s=timeout, stdin=text, env=dict(env or {}))["id"]
        )
        self.started.append(command_id)
        return command_id

    def wait(self, command_id: str, timeout: float | None = None) -> CommandResult:
        reply = self._call("wait", timeout=(timeout or 3600) + 5, id=command_id, wait_s=timeout)
        if reply.get("timeout"):
            raise TimeoutError(command_id)
        return CommandResult(
            command_id,
            reply["exit_code"],
            reply["stdout"],
            "",
            stopped=reply["stopped"],
            timed_out=reply["timed_out"],
        )

    def stop(self, command_id: str) -> None:
        with contextlib.suppress(SandboxClosed):
            self._call("stop", id=command_id)

    def stop_all(self) -> None:
        with contextlib.suppress(SandboxClosed):
            self._call("stop_all")

    def destroy(self) -> None:
        with contextlib.suppress(SandboxClosed, TimeoutError, OSError):
            self._call("stop_all")
        with self._lock:
            self._closed = True
        if self.helper.stdin is not None:
            with contextlib.suppress(OSError):
                self.helper.stdin.close()
        try:
            self.helper.wait(5)
        except subprocess.TimeoutExpired:
            self.helper.kill()
            self.helper.wait(5)
