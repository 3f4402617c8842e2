"""A light, real task process: the Task SDK's kill paths without the cost of ``dag.test()``.

Each ``dag.test()`` child costs seconds to start, too slow for hundreds of measured kills. The
child processes of the benchmarks and of the kill-timing stress test therefore build the operator
themselves and run it the way the Task SDK's ``run()`` does, copying the parts that decide what a
kill does (``airflow/sdk/execution_time/task_runner.py``, Airflow 3.3.2):

- the SIGTERM handler (:func:`install_sigterm_handler`) is ``_on_term``: in the task's own process
  it calls ``ti.task.on_kill()`` on the main thread and returns; Airflow raises nothing;
- :func:`execute_like_task_sdk` is ``_execute_task`` + ``_run_execute_callable``: templates,
  the ``pre_execute=`` hook and ``pre_execute`` (when overridden), ``execute`` in a copied
  context carrying the ``ExecutorSafeguard`` sentinel, and with ``execution_timeout`` the SDK's own
  ``timeout`` context manager (SIGALRM), calling ``on_kill()`` in its ``except AirflowTaskTimeout``.

One child runs many repetitions (a scope is per task instance, so every repetition builds a
fresh operator). Children talk to the parent with JSON lines on a pipe (events, each stamped with
``time.monotonic()``, which is one clock for all processes on Linux) and read commands from stdin.
This module is imported by both sides; the parent half is :class:`TaskChild` and the marker helpers.
It lives with the tests (the process, stress and e2e suites); the benchmarks import it from here.
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import os
import queue
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import psutil

ROOT = Path(__file__).resolve().parents[1]
EVENTS_FD_ENV = "BENCH_EVENTS_FD"

#: Airflow SIGKILLs a task this long after the SIGTERM (user stops); the supervisor's grace.
GRACE = 5.0

#: Longest a task child may take to reach the moment a test kills it (import Airflow, parse the
#: DAG, start the task, reach the tool). About 5 s on an idle 2-core machine; a CI machine running
#: the Airflow suites beside this one took 60 s. Not what any test measures: a kill is timed from
#: its signal, with its own tight bound.
STARTUP = 240.0

#: Longest Airflow's own work around a kill may take on a loaded machine: the Task SDK's failure
#: handling and callbacks after the unwind, the DagRun's end, the process's exit. Not what a test
#: measures: a kill is bounded on the task's own timeline (:func:`unwound_ms`) or from its signal.
SETTLE = 60.0


def unwound_ms(record: dict[str, Any]) -> float:
    """Milliseconds from ``kill_received`` (0 on the record's timeline) until the run unwound and
    every resource was released: the unwind as the task itself timed it, whatever the machine's
    load did to the Airflow work before and after it."""
    ends = [e["ms"] for e in record["timeline"] if e["event"] in ("run_unwound", "resources_released")]
    assert ends, f"the record has no unwind on its timeline: {[e['event'] for e in record['timeline']]}"
    return float(max(ends))


# -- child side: the Task SDK's kill paths -------------------------------------------------------


def install_sigterm_handler(task: Any, before: Callable[[], None] | None = None) -> None:
    """Install the Task SDK's SIGTERM handler for ``task`` (a faithful copy of ``_on_term``).

    ``task_runner.run()`` does, on the main thread::

        parent_pid = os.getpid()
        def _on_term(signum, frame):
            pid = os.getpid()
            if pid != parent_pid:
                return
            ti.task.on_kill()
        signal.signal(signal.SIGTERM, _on_term)

    ``before`` is the harness's instrumentation (a timestamp, nothing that changes behaviour); it
    runs first so the measurement starts when the handler does.
    """
    parent_pid = os.getpid()

    def _on_term(signum: int, frame: Any) -> None:
        pid = os.getpid()
        if pid != parent_pid:
            return
        if before is not None:
            before()
        task.on_kill()

    signal.signal(signal.SIGTERM, _on_term)


def execute_like_task_sdk(
    task: Any, context: dict[str, Any], *, timeout_armed: Callable[[], None] | None = None
) -> Any:
    """Run ``task`` as ``_execute_task`` / ``_run_execute_callable`` do; return its result.

    ``timeout_armed`` (instrumentation) is called just before the SIGALRM timer is armed.
    """
    from airflow.sdk.bases.operator import BaseOperator, ExecutorSafeguard
    from airflow.sdk.exceptions import AirflowTaskTimeout
    from airflow.sdk.execution_time.timeout import timeout

    task.render_template_fields(context)  # _prepare -> ti.render_templates()
    if (pre_execute_hook := getattr(task, "_pre_execute_hook", None)) is not None:
        pre_execute_hook(context)
    if getattr(task.pre_execute, "__func__", None) is not BaseOperator.pre_execute:
        task.pre_execute(context)
    ctx = contextvars.copy_context()
    ctx.run(ExecutorSafeguard.tracker.set, task)
    if not task.execution_timeout:
        result = ctx.run(task.execute, context=context)
    else:
        seconds = task.execution_timeout.total_seconds()
        try:
            if seconds <= 0:
                raise AirflowTaskTimeout()
            if timeout_armed is not None:
                timeout_armed()
            with timeout(seconds):
                result = ctx.run(task.execute, context=context)
        except AirflowTaskTimeout:
            task.on_kill()
            raise
    if (post_execute_hook := getattr(task, "_post_execute_hook", None)) is not None:
        post_execute_hook(context, result)
    if getattr(task.post_execute, "__func__", None) is not BaseOperator.post_execute:
        task.post_execute(context, result)
    return result


#: Longest the main thread stays in C while it waits for a signal (the provider's own poll: 50 ms).
SIGNAL_SLICE = 0.05


class SignalLatch:
    """A flag a signal handler sets and the main thread waits for: a pipe, not a lock.

    ``threading.Event`` deadlocks here: the handler runs on the main thread, possibly inside
    ``Event.wait()``, and ``set()`` needs the condition lock that ``wait()`` holds.
    """

    def __init__(self) -> None:
        self._read, self._write = os.pipe()
        os.set_blocking(self._read, False)
        os.set_blocking(self._write, False)
        self._set = False

    def set(self) -> None:
        """Safe from a signal handler: a flag and one non-blocking write."""
        self._set = True
        with contextlib.suppress(BlockingIOError):
            os.write(self._write, b"x")

    def is_set(self) -> bool:
        return self._set

    def wait(self, timeout: float) -> bool:
        """Wait until set or ``timeout`` seconds; return whether set.

        A handler that runs before the ``select`` has written to the pipe, one that interrupts
        it makes it readable once ``select`` is retried (PEP 475). In slices: the kernel may
        deliver the SIGTERM to another thread, which interrupts no ``select`` here, and Python
        runs the handler only once the main thread is back in bytecode (seen: 10 s late).
        """
        deadline = time.monotonic() + timeout
        while not self._set and (left := deadline - time.monotonic()) > 0:
            select.select([self._read], [], [], min(left, SIGNAL_SLICE))
        return self._set

    def clear(self) -> None:
        self._set = False
        with contextlib.suppress(BlockingIOError):
            while os.read(self._read, 4096):
                pass


class FakeTI:
    """What the operators read from ``context["ti"]``: the task instance's key."""

    def __init__(self, task_id: str, run_id: str, dag_id: str = "bench") -> None:
        self.dag_id, self.task_id, self.run_id, self.map_index = dag_id, task_id, run_id, -1


class Channel:
    """The child's end: events out (JSON lines on the inherited fd), commands in (stdin)."""

    def __init__(self) -> None:
        self._fd = int(os.environ[EVENTS_FD_ENV])

    def emit(self, event: str, **data: Any) -> None:
        """Write one event; safe from signal handlers and threads (one ``os.write`` per line)."""
        line = json.dumps({"event": event, "t": time.monotonic(), **data}, default=str) + "\n"
        os.write(self._fd, line.encode())

    @staticmethod
    def commands() -> Iterator[dict[str, Any]]:
        """Commands from the parent until it closes stdin."""
        for line in sys.stdin:
            if line.strip():
                yield json.loads(line)


#: Name prefixes of the threads the provider starts.
OUR_THREADS = ("cancellable-agents-", "tool-", "release-")


def our_threads() -> list[str]:
    """Names of live threads the provider starts (unwind, cause, release, sync tools, reaper)."""
    return sorted(t.name for t in threading.enumerate() if t.is_alive() and t.name.startswith(OUR_THREADS))


# -- parent side ---------------------------------------------------------------------------------


def with_root_on_path(env: dict[str, str]) -> dict[str, str]:
    """``env`` with the repository root first on ``PYTHONPATH`` (a child imports ``tests``)."""
    return {**env, "PYTHONPATH": os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])}


class TaskChild:
    """A real child task process; its events arrive on a reader thread. The one task-process
    harness of the benchmarks, the stress test and the process tests (``tests/process/harness.py``).

    ``command`` is a module (run as ``python -m MODULE`` from the repository root) or a whole argv.
    The child writes JSON-line events to the fd named by ``events_env`` and may read commands from
    stdin (:meth:`send`). Events can be consumed in order (:meth:`next_event`, :meth:`wait_for`) or
    looked up in everything seen so far (:meth:`expect`). The parent signals the task pid only, as
    the supervisor forwards a SIGTERM to the task pid.
    """

    def __init__(
        self,
        command: str | Sequence[str],
        env: dict[str, str],
        log_path: Path,
        *,
        events_env: str = EVENTS_FD_ENV,
    ) -> None:
        read_fd, write_fd = os.pipe()
        self.log_path = log_path
        self._log = log_path.open("ab")
        argv = [sys.executable, "-m", command] if isinstance(command, str) else list(command)
        self.proc = self._start(argv, with_root_on_path(env), events_env, write_fd)
        os.close(write_fd)
        self.pid = self.proc.pid
        self.exited_at: float | None = None
        #: Every event so far, in order (guarded by ``_seen``).
        self.events: list[dict[str, Any]] = []
        self._seen = threading.Condition()
        self._queue: queue.Queue[dict[str, Any]] = queue.Queue()
        self._reader = threading.Thread(target=self._read, args=(read_fd,), daemon=True)
        self._reader.start()

    def _start(self, argv: list[str], env: dict[str, str], events_env: str, write_fd: int) -> Any:
        """Start the process (a ``Popen`` or what behaves as one: ``pid``, ``stdin``, ``poll``,
        ``wait``) with ``write_fd`` as its events fd, named in ``events_env``."""
        return subprocess.Popen(
            argv,
            env={**env, events_env: str(write_fd)},
            cwd=ROOT,
            pass_fds=(write_fd,),
            stdin=subprocess.PIPE,
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )

    def _read(self, fd: int) -> None:
        with os.fdopen(fd, "rb") as pipe:
            for line in pipe:
                with contextlib.suppress(ValueError):
                    event = json.loads(line)
                    with self._seen:
                        self.events.append(event)
                        self._seen.notify_all()
                    self._queue.put(event)
        # EOF: every copy of the write end is closed, i.e. the process is gone.
        self.exited_at = time.monotonic()
        with self._seen:
            self._seen.notify_all()
        self._queue.put({"event": "_eof", "t": self.exited_at})

    @property
    def alive(self) -> bool:
        return self.exited_at is None and self.proc.poll() is None

    def send(self, command: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps(command) + "\n").encode())
        self.proc.stdin.flush()

    def next_event(self, timeout: float) -> dict[str, Any] | None:
        """The next event, or ``None`` if none arrives within ``timeout`` seconds."""
        try:
            return self._queue.get(timeout=max(0.0, timeout))
        except queue.Empty:
            return None

    def wait_for(self, names: set[str], timeout: float) -> dict[str, Any] | None:
        """The next event named in ``names`` (others are dropped); ``None`` on timeout or exit."""
        deadline = time.monotonic() + timeout
        while True:
            event = self.next_event(deadline - time.monotonic())
            if event is None or event["event"] in names:
                return event
            if event["event"] == "_eof":
                return None

    def expect(self, name: str | tuple[str, ...], timeout: float = 30.0, **fields: Any) -> dict[str, Any]:
        """The first event so far or to come named ``name`` (or any of the names) with ``fields``;
        an ``AssertionError`` with the log's tail if none comes within ``timeout`` seconds."""
        names = (name,) if isinstance(name, str) else name

        def found() -> dict[str, Any] | None:
            return next(
                (
                    e
                    for e in self.events
                    if e["event"] in names and all(e.get(k) == v for k, v in fields.items())
                ),
                None,
            )

        with self._seen:
            self._seen.wait_for(lambda: found() or self.exited_at is not None, timeout)
            event = found()
        if event is None:
            # A child still alive past its bound is a hang: its stacks are the only clue CI keeps.
            hung = self.exited_at is None
            if hung:
                self.dump_stacks(wait=1.0)
            tail = self.tail(250 if hung else 60)
            raise AssertionError(f"no {name!r} event within {timeout}s; events: {self.names()}\n{tail}")
        return event

    def event(self, name: str) -> dict[str, Any] | None:
        """The first event so far named ``name``."""
        return next((e for e in self.events if e["event"] == name), None)

    def names(self) -> list[str]:
        return [e["event"] for e in self.events]

    def sigterm(self, times: int = 1, gap: float = 0.0) -> float:
        """SIGTERM the task pid ``times`` times; return the monotonic time of the first."""
        sent = time.monotonic()
        for i in range(times):
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGTERM)
            if gap and i + 1 < times:
                time.sleep(gap)  # the burst's spacing is the thing being varied, not a sync wait
        return sent

    def dump_stacks(self, wait: float = 0.3) -> None:
        """Have the child's ``faulthandler`` write every thread's stack to its log (SIGUSR1)."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGUSR1)
            self.wait_exit(wait)  # it does not exit: this only gives the dump a moment

    def sigkill(self) -> None:
        """What the supervisor does when the grace runs out (and how a dirty child is retired)."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)

    def wait_exit(self, timeout: float) -> bool:
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return False
        self._reader.join(timeout)
        return True

    def close(self, timeout: float = 5.0) -> None:
        """Ask the child to finish (stdin closed) and give it ``timeout`` seconds; then SIGKILL it."""
        with contextlib.suppress(OSError, ValueError):
            assert self.proc.stdin is not None
            self.proc.stdin.close()
        if not self.wait_exit(timeout):
            self.sigkill()
            self.wait_exit(10)
        self._log.close()

    def tail(self, lines: int = 40) -> str:
        with contextlib.suppress(OSError, ValueError):  # closed already: what is on disk is all
            self._log.flush()
        with contextlib.suppress(OSError):
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        return ""


def marker_processes(marker: str) -> list[int]:
    """Running (non-zombie) processes whose command line contains ``marker``.

    A zombie's command line is empty, so a process counts as gone once it exited.
    """
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        try:
            cmdline = proc.info["cmdline"] or []
            if any(marker in part for part in cmdline) and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc.pid)
        except psutil.Error:
            continue
    return found


def _running(pid: int, marker: str) -> bool:
    try:
        proc = psutil.Process(pid)
        return proc.status() != psutil.STATUS_ZOMBIE and any(marker in p for p in proc.cmdline())
    except psutil.Error:
        return False


def wait_markers_gone(marker: str, deadline: float, known: list[int] | None = None) -> float | None:
    """Poll until no process carries ``marker``; return when that was first seen, or ``None``.

    Known pids are polled every millisecond (cheap); the whole process table every ~20 ms, to
    catch what started after they were listed.
    """
    pids = set(known if known is not None else marker_processes(marker))
    last_scan = time.monotonic()
    while True:
        now = time.monotonic()
        pids = {pid for pid in pids if _running(pid, marker)}
        if not pids or now - last_scan > 0.02:
            pids |= set(marker_processes(marker))
            last_scan = time.monotonic()
            if not pids:
                return now
        if now > deadline:
            return None
        time.sleep(0.001)  # a poll interval: processes ending is not an event we can await


def kill_markers(marker: str) -> list[int]:
    """SIGKILL leftovers carrying ``marker`` (started by this benchmark, identified per repetition)."""
    killed = []
    for pid in marker_processes(marker):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)
    return killed
