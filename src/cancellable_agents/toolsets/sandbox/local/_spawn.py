"""Starting a sandbox command's process: one long-lived spawning thread, stdin fed and output
drained on threads of their own, so neither a chatty command nor a full pipe blocks the caller.
This module imports no Airflow.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import threading
from collections.abc import Callable
from typing import IO, TypeVar

from cancellable_agents.core._workers import JobThread

__all__ = ["BoundedReader", "feed_stdin", "start_process"]

T = TypeVar("T")


class BoundedReader:
    """Drains one pipe on its own thread, keeping at most ``limit`` bytes.

    Reading on a thread means a chatty command never blocks on a full pipe; the cap means it
    never costs more than ``limit`` bytes of memory however much it writes.
    """

    def __init__(self, pipe: IO[bytes], limit: int, name: str) -> None:
        self._pipe = pipe
        self._limit = limit
        self._data = bytearray()
        self._dropped = 0
        self._lock = threading.Lock()
        self.thread = threading.Thread(target=self._drain, name=name, daemon=True)
        self.thread.start()

    def _drain(self) -> None:
        fd = self._pipe.fileno()
        try:
            while chunk := os.read(fd, 65536):
                with self._lock:
                    room = max(0, self._limit - len(self._data))
                    self._data += chunk[:room]
                    self._dropped += len(chunk) - min(room, len(chunk))
        except OSError:
            pass
        finally:
            with contextlib.suppress(OSError):
                self._pipe.close()

    def text(self) -> tuple[str, bool]:
        """The captured text (with a truncation marker) and whether anything was dropped."""
        with self._lock:
            text = bytes(self._data).decode("utf-8", "replace")
            dropped = self._dropped
        if dropped:
            text += f"\n[... truncated {dropped} bytes ...]"
        return text, dropped > 0


class _Spawner:
    """Starts every command from one thread that lives as long as the process.

    ``--die-with-parent`` is ``PR_SET_PDEATHSIG``, which fires when the *thread* that forked the
    child exits, not the process. Sync tools run on one short-lived thread per call, so a
    command started there would be SIGKILLed (and its namespace orphaned) as the tool returns.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._thread: JobThread | None = None  # guarded by _lock
        self._owner: int | None = None  # guarded by _lock: the pid the thread belongs to

    def call(self, fn: Callable[[], T]) -> T:
        with self._lock:
            # After a fork the thread is gone; the child gets its own.
            if self._thread is None or self._owner != os.getpid():
                self._thread = JobThread("cancellable-agents-spawner")
                self._owner = os.getpid()
            thread = self._thread
        return thread.submit(fn).result()


_spawner = _Spawner()


def start_process(
    argv: list[str],
    *,
    cwd: str | os.PathLike[str],
    env: dict[str, str],
    piped_stdin: bool,
    pass_fds: tuple[int, ...] = (),
) -> subprocess.Popen[bytes]:
    """Start a command's main process on the spawning thread, its output piped, ``pass_fds``
    (the seccomp filter bubblewrap or the Landlock helper loads, the Landlock ruleset) inherited
    and nothing else."""

    def popen() -> subprocess.Popen[bytes]:
        return subprocess.Popen(
            argv,
            cwd=cwd,
            env=env,
            stdin=subprocess.PIPE if piped_stdin else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            # Its own session: Airflow's SIGTERM to the task's process group does not cut the
            # tree up behind the sandbox's back; the sandbox's stop is the one way it ends.
            start_new_session=True,
            close_fds=True,
            pass_fds=pass_fds,
        )

    return _spawner.call(popen)


def feed_stdin(proc: subprocess.Popen[bytes], data: bytes) -> None:
    """Write ``data`` to a command's stdin on a thread of its own (a full pipe must not block the
    caller), then close it."""

    def feed() -> None:
        assert proc.stdin is not None
        with contextlib.suppress(OSError):
            proc.stdin.write(data)
        with contextlib.suppress(OSError):
            proc.stdin.close()

    threading.Thread(target=feed, name=f"sandbox-stdin-{proc.pid}", daemon=True).start()
