"""The helper process of :class:`tests.process.helper_backend.HelperSandbox`.

Reads JSON requests (one a line) on stdin, answers on stdout. ``start`` runs the command in a new
session, waits ``reply_delay`` and only then answers (and counts the command as *announced*: what
``stop_all`` stops, as the protocol says). Each request runs on its own thread. When stdin closes
(the task side went away or destroyed the sandbox) every command is stopped, and the requests
still running (a ``wait`` on a command just stopped) answer before the helper exits: a wait the
task sent before it destroyed the sandbox gets its result, not a closed pipe.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from typing import IO, Any


class _Helper:
    def __init__(self, reply_delay: float) -> None:
        self.reply_delay = reply_delay
        self.procs: dict[str, subprocess.Popen[str]] = {}
        self.announced: list[str] = []  # ids whose start was answered: what stop_all stops
        self.stopped: set[str] = set()
        self.timed_out: set[str] = set()
        self.out_lock = threading.Lock()
        self.handlers: list[threading.Thread] = []  # each request's thread
        self.waits: list[threading.Thread] = []  # each wait's, until its command ends

    @staticmethod
    def spawn(into: list[threading.Thread], target: Any, *args: Any) -> None:
        thread = threading.Thread(target=target, args=args, daemon=True)
        into.append(thread)
        thread.start()

    def reply(self, req: str, **fields: Any) -> None:
        with self.out_lock:
            sys.stdout.write(json.dumps({"req": req, **fields}) + "\n")
            sys.stdout.flush()

    def handle(self, msg: dict[str, Any]) -> None:
        op, req = msg["op"], msg["req"]
        if op == "start":
            command_id = uuid.uuid4().hex[:12]
            proc = subprocess.Popen(
                msg["argv"],
                stdin=subprocess.PIPE,  # never the helper's own stdin: that is its request pipe
                stdout=subprocess.PIPE,
                text=True,
                start_new_session=True,
                env={**os.environ, **msg.get("env", {})},
            )
            _feed(proc, msg.get("stdin") or "")
            self.procs[command_id] = proc
            if msg.get("timeout_s") is not None:  # the backend enforces a command's timeout
                timer = threading.Timer(msg["timeout_s"], self._time_out, args=(command_id,))
                timer.daemon = True
                timer.start()
            time.sleep(self.reply_delay)  # the command runs; the task has no id for it yet
            self.announced.append(command_id)
            self.reply(req, id=command_id)
        elif op == "wait":
            self.spawn(self.waits, self._wait, req, msg["id"], msg.get("wait_s"))
        elif op == "stop":
            self._stop(msg["id"])
            self.reply(req)
        elif op == "stop_all":
            for command_id in list(self.announced):
                self._stop(command_id)
            self.reply(req)

    def _wait(self, req: str, command_id: str, wait_s: float | None) -> None:
        proc = self.procs[command_id]
        try:
            out, _ = proc.communicate(timeout=wait_s)
        except subprocess.TimeoutExpired:
            self.reply(req, timeout=True)
            return
        stopped, timed_out = command_id in self.stopped, command_id in self.timed_out
        self.reply(req, exit_code=proc.returncode, stdout=out, stopped=stopped, timed_out=timed_out)

    def _time_out(self, command_id: str) -> None:
        if self.procs[command_id].poll() is None:
            self.timed_out.add(command_id)
            self._stop(command_id)

    def _stop(self, command_id: str) -> None:
        proc = self.procs.get(command_id)
        if proc is None or proc.poll() is not None:
            return
        self.stopped.add(command_id)
        for sig, grace in ((signal.SIGTERM, 0.5), (signal.SIGKILL, 2.0)):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, sig)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(grace)
                return


def _feed(proc: subprocess.Popen[str], text: str) -> None:
    """Write the command's stdin and close it; ``communicate`` then has no stdin to handle (the
    tests' inputs are small: a pipe's buffer holds them)."""
    assert proc.stdin is not None
    with contextlib.suppress(OSError):
        proc.stdin.write(text)
        proc.stdin.close()
    proc.stdin = None


def _serve(stdin: IO[str], reply_delay: float) -> None:
    helper = _Helper(reply_delay)
    for line in stdin:  # each request on its own thread: a slow start does not hold up a stop
        helper.spawn(helper.handlers, helper.handle, json.loads(line))
    deadline = time.monotonic() + 10
    for thread in helper.handlers:  # a start in progress adds its command before the stop
        thread.join(max(0.0, deadline - time.monotonic()))
    for command_id in list(helper.procs):  # the task side went away: nothing outlives it
        helper._stop(command_id)
    for thread in list(helper.waits):  # the waits on what was just stopped answer before the exit
        thread.join(max(0.0, deadline - time.monotonic()))


if __name__ == "__main__":
    _serve(sys.stdin, float(sys.argv[1]))
