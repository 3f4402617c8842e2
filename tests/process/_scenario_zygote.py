"""Fork server for the tests' ``dag.test()`` children (``tests/process/zygote.py``, the parent's end).

A cold ``task_scenarios.py`` child spends ~5 s (far more on a loaded CI machine) importing
Airflow, its execution API, pydantic-ai, the model SDKs and fastmcp before ``dag.test()`` starts.
This server imports them once, single-threaded, then forks one child per request; each child
becomes the scenario script as a fresh interpreter would run it: the requested environment in
``os.environ``, its own stdin, stdout/stderr and events pipe, ``sys.argv``/``sys.path[0]`` of the
script, default signal dispositions, then ``runpy`` runs the script as ``__main__``. From there it
is the same ``dag.test()`` as before: the DAG is parsed from its folder, the Task SDK's own
``run()`` installs the real SIGTERM handler and SIGALRM path, the task talks to the in-process
execution API and the metadata DB, and the test signals the child's own pid. Nothing of Airflow
ran here before the fork beyond its imports (``import airflow`` configures settings and an ORM
engine without connecting; Airflow disposes the engine in a forked child itself) and building,
not starting, the in-process execution API's app (:func:`_build_execution_api`).

A forked task process is what production runs too: the Task SDK's supervisor forks each task
process (``_fork_main``) from a process that imported Airflow already.

Protocol: a ``SOCK_SEQPACKET`` socket on the fd in ``ZYGOTE_SOCKET``. The server sends
``{"ready": true}``; then each request is one JSON message ``{"argv", "env", "cwd", "setsid",
"events_env"}`` with the child's stdin, stdout and stderr fds and, if ``events_env`` names the
variable for it, its events fd; answered with ``{"pid": N}``. When a child exits the server sends
``{"exited": N, "code": C}``. ``env`` replaces the whole environment. The server exits when the
socket closes.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import signal
import socket
import sys
import threading
from typing import Any

#: What a ``dag.test()`` task process imports that costs time; a name missing on this Airflow or
#: pydantic-ai (the floor venvs) is skipped: the child then imports what it needs itself.
WARM = (
    "airflow.sdk",
    "airflow.sdk.bases.operator",
    "airflow.sdk.bases.sensor",
    "airflow.sdk.execution_time.task_runner",
    "airflow.sdk.execution_time.supervisor",
    "airflow.sdk.execution_time.cache",
    "airflow.sdk.definitions.connection",
    "airflow.models.dag",
    "airflow.models.dagbag",
    "airflow.models.serialized_dag",
    "airflow.models.renderedtifields",
    "airflow.models.taskinstance",
    "airflow.api.common.trigger_dag",
    "airflow.dag_processing.dagbag",
    "airflow.dag_processing.collection",
    "airflow.dag_processing.bundles.local",
    "airflow.serialization.serialized_objects",
    "airflow.api_fastapi.common.dagbag",
    "airflow.api_fastapi.execution_api.app",
    "airflow.api_fastapi.execution_api.routes",
    "airflow.providers.standard.operators.empty",
    "airflow.providers.standard.operators.trigger_dagrun",
    "airflow.providers.standard.sensors.external_task",
    "airflow.jobs.triggerer_job_runner",
    "pydantic_ai",
    "pydantic_ai.models.openai",
    "pydantic_ai.providers.openai",
    "pydantic_ai.models.anthropic",
    "pydantic_ai.models.bedrock",
    "pydantic_ai.models.google",
    "pydantic_ai.models.groq",
    "pydantic_ai.models.mistral",
    "pydantic_ai.mcp",
    "fastmcp.client.transports",
    "openai.types.chat",
    "openai.resources.chat",
    "openai.lib.streaming.chat",
    "httpcore",
    "anyio._backends._asyncio",
    "anyio._core._subprocesses",
    "genai_prices.data",
    "jinja2.ext",
    "encodings.idna",
    "faulthandler",
    "tests.dag_test_compat",
)


def warm_up() -> None:
    import pkgutil

    import cancellable_agents

    ours = [m.name for m in pkgutil.walk_packages(cancellable_agents.__path__, "cancellable_agents.")]
    for name in (*WARM, *ours):
        with contextlib.suppress(ImportError):
            importlib.import_module(name)
    _build_execution_api()
    # Forking a process with threads can leave the child holding a lock no thread will release.
    assert threading.active_count() == 1, f"the zygote must fork single-threaded: {threading.enumerate()}"


_SOCK: socket.socket | None = None


def _build_execution_api() -> None:
    """Build the in-process execution API's app, the stand-in ``dag.test()`` uses for Airflow's API
    server, as far as it goes without a thread: cadwyn generates its versioned routers on the
    first request, ~5 s of CPU per task process that a real API server spends once, before it
    serves. ``in_process_api_server`` caches the object; the child starts its transport (loop
    thread) and lifespan itself, when ``dag.test()`` builds the client."""
    from airflow.sdk.execution_time import supervisor

    app = supervisor.in_process_api_server().app
    initialize = getattr(app, "_cadwyn_initialize", None)
    if initialize is not None and not getattr(app, "_cadwyn_initialized", True):
        initialize()


def _reap(signum: int, frame: Any) -> None:
    """Collect exited children and tell the parent their exit codes (it cannot wait for them)."""
    with contextlib.suppress(ChildProcessError):
        while True:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if not pid:
                return
            if _SOCK is not None:
                with contextlib.suppress(OSError):
                    _SOCK.send(
                        json.dumps({"exited": pid, "code": os.waitstatus_to_exitcode(status)}).encode()
                    )


def serve(sock: socket.socket) -> dict[str, Any]:
    """Fork one child per request; return the request in the child (the server never returns)."""
    global _SOCK
    _SOCK = sock
    signal.signal(signal.SIGCHLD, _reap)
    sock.send(json.dumps({"ready": True}).encode())
    while True:
        message, fds, _, _ = socket.recv_fds(sock, 1 << 20, 4)
        if not message:
            # Skips the interpreter's final collection of everything imported (seconds under load).
            os._exit(0)
        request = json.loads(message)
        for stream in (sys.stdout, sys.stderr):
            stream.flush()  # or the child writes the server's buffered output again
        pid = os.fork()
        if pid == 0:
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            _SOCK = None
            sock.close()
            if request.get("setsid"):
                os.setsid()
            for target, fd in enumerate(fds[:3]):
                os.dup2(fd, target)
            for fd in set(fds[:3]):
                if fd > 2:
                    os.close(fd)
            if request.get("events_env"):
                os.set_inheritable(fds[3], True)  # as Popen's pass_fds leaves it
                request["env"][request["events_env"]] = str(fds[3])
            return dict(request)
        for fd in fds:
            os.close(fd)
        sock.send(json.dumps({"pid": pid}).encode())


def become(request: dict[str, Any]) -> None:
    """Turn this forked child into ``python SCRIPT ARGS...`` with the request's environment."""
    import runpy

    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    sys.argv = list(request["argv"])
    sys.path.insert(0, os.path.dirname(sys.argv[0]))
    runpy.run_path(sys.argv[0], run_name="__main__")


def main() -> None:
    # This file's folder is not the script's: nothing may be imported from it, as in the child.
    del sys.path[0]
    sock = socket.socket(fileno=int(os.environ["ZYGOTE_SOCKET"]))
    warm_up()
    become(serve(sock))


if __name__ == "__main__":
    main()
