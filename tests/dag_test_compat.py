"""Make ``dag.test()`` on Airflow 3.1/3.2 behave like the production task path where tests look.

The real-signal tests run tasks with ``dag.test()`` in a child process: the Task SDK's own
``run()``, SIGTERM handler and SIGALRM path, with an in-process execution API instead of an API
server. On Airflow before 3.3 that test path differs from production in two ways that have
nothing to do with the provider; :func:`prepare_dag_test` closes both (on 3.3 it changes
nothing). Call it in the child, before ``dag.test()``.

A third difference holds on every version: the in-process comms remove ``SUPERVISOR_COMMS`` from
``task_runner`` while they serve a request (so the serving code does not think it runs in a
task), which other threads see as "no comms". In production the comms are a socket every thread
of the task shares, requests serialised by a lock. :func:`prepare_dag_test` restores that: one
request at a time, and only the thread serving one stops seeing the comms meanwhile (a cause
query from a helper thread, a durable journal write, while the main thread is in a request).

1. ``on_failure_callback`` gets no ``context["exception"]``: the real ``task_runner.main()`` sets
   it before ``finalize()``; 3.1/3.2's ``supervisor.run_task_in_process`` does not.
2. The in-process execution API of 3.1/3.2 starts its lifespan without waiting for it, and the
   lifespan lives in the ``InProcessExecutionAPI`` object, which nothing keeps once the client is
   built: when it is collected, the lifespan unwinds and removes the app's service registry. Then
   requests fail with ``'State' object has no attribute 'svcs_registry'`` (on 3.2 here, every
   ``dag.test()`` task failed before it ran; keeping the object fixes that, waiting for the
   startup closes the remaining race). A real API server starts before it serves and stays up;
   3.3 waits for the startup and ties the lifespan to the transport.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any, NoReturn

#: How long the in-process execution API may take to start (it takes milliseconds).
_STARTUP_TIMEOUT = 60.0

#: The in-process execution APIs started in this process, kept so their lifespans stay up.
_STARTED_APIS: list[Any] = []


def prepare_dag_test() -> None:
    """Apply both fixes; idempotent, and a no-op in effect on Airflow 3.3+."""
    _give_failure_callbacks_the_exception()
    _serve_only_after_startup()
    _serialise_in_process_comms()


def _give_failure_callbacks_the_exception() -> None:
    from airflow.sdk.execution_time import task_runner

    finalize = task_runner.finalize
    if getattr(finalize, "_sets_exception", False):
        return

    def finalize_with_exception(ti: Any, state: Any, context: Any, log: Any, error: Any = None) -> Any:
        if "exception" not in context:
            context["exception"] = error  # what task_runner.main() does before finalize()
        return finalize(ti, state, context, log, error)

    finalize_with_exception._sets_exception = True  # type: ignore[attr-defined]
    task_runner.finalize = finalize_with_exception


def _serve_only_after_startup() -> None:
    from airflow.sdk.execution_time import supervisor

    start_api = supervisor.in_process_api_server
    if getattr(start_api, "_waits_for_startup", False):
        return

    def started_api_server() -> Any:
        api = start_api()
        api.transport  # noqa: B018 - creating the (cached) transport is what schedules the lifespan
        _wait_for_startup(api.app)
        _STARTED_APIS.append(api)
        return api

    started_api_server._waits_for_startup = True  # type: ignore[attr-defined]
    supervisor.in_process_api_server = started_api_server


def _wait_for_startup(app: Any) -> None:
    """Return once the lifespan registered its services (the JWT validator is registered last).

    Airflow drops the future of the startup coroutine, so there is nothing to await: poll its
    effect, bounded.
    """
    from airflow.api_fastapi.execution_api import app as execution_app

    deadline = time.monotonic() + _STARTUP_TIMEOUT
    while True:
        registry = getattr(app.state, "svcs_registry", None)
        if registry is not None and execution_app.JWTValidator in registry:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"the in-process execution API did not start within {_STARTUP_TIMEOUT}s")
        time.sleep(0.005)


def _serialise_in_process_comms() -> None:
    """One request at a time, and ``SUPERVISOR_COMMS`` hidden only from the thread serving one.

    Airflow's in-process comms hide the comms by deleting the module attribute, which every
    thread sees: ``task_runner``'s own code reads it as a global (no module ``__getattr__`` can
    answer that), so the main thread's final ``SUPERVISOR_COMMS.send(TaskState)`` raised
    ``NameError`` while a cause query served on a helper thread (3.1 CI: a burst of SIGTERMs on a
    loaded machine, the task ended before its callbacks ran), and a helper's query failed while
    the main thread was in a request. Here the attribute stays; the thread in a request, and only
    it, does not see it (its serving code, e.g. ``mask_secret``, must not send again).
    """
    from airflow.sdk.execution_time import supervisor, task_runner

    comms_class = getattr(supervisor, "InProcessSupervisorComms", None)
    if comms_class is None or getattr(comms_class.send, "_serialised", False):
        return
    send = comms_class.send
    lock = threading.RLock()  # like the real comms' lock; re-entrant for a signal handler's request
    serving = threading.local()  # .depth: requests this thread is in (a signal handler nests one)
    hide_all = supervisor.set_supervisor_comms

    class CommsModule(type(task_runner)):  # type: ignore[misc]
        def __getattribute__(self, name: str) -> Any:
            if name == "SUPERVISOR_COMMS" and getattr(serving, "depth", 0):
                raise AttributeError(f"module {task_runner.__name__!r} has no attribute {name!r}")
            return super().__getattribute__(name)

    @contextlib.contextmanager
    def set_supervisor_comms(temp_comms: Any) -> Iterator[None]:
        if temp_comms is not None:
            with hide_all(temp_comms):
                yield
            return
        serving.depth = getattr(serving, "depth", 0) + 1
        try:
            yield
        finally:
            serving.depth -= 1

    def serialised_send(self: Any, msg: Any) -> Any:
        with lock:
            return send(self, msg)

    serialised_send._serialised = True  # type: ignore[attr-defined]
    comms_class.send = serialised_send
    supervisor.set_supervisor_comms = set_supervisor_comms
    task_runner.__class__ = CommsModule


def exit_as_the_task_sdk_does(code: int = 0) -> NoReturn:
    """End a ``dag.test()`` child the way a production task process ends: atexit hooks, flushed
    output, then ``os._exit`` (the Task SDK's ``_fork_main`` exits so after its task).

    A plain interpreter exit would instead run CPython's final garbage collection over the
    ~730k objects Airflow, pydantic-ai and the model SDKs leave: 2.1-2.5 s on an idle 2-core
    machine and over 10 s on a loaded one, a cost no production task pays, which a test of
    "the process exits promptly" would then measure instead of the provider.
    """
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(ValueError, OSError):
            stream.flush()
    os._exit(code)
