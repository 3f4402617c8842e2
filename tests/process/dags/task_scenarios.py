"""Child process for the real-signal tests: runs one scenario (env ``SCENARIO``) via ``dag.test()``.

``dag.test()`` executes the task with the Task SDK's own ``run()``, which installs the real
SIGTERM handler (``_on_term`` -> ``task.on_kill()``) and the real ``execution_timeout`` SIGALRM
path, so the parent kills this process exactly as Airflow's supervisor would.

Events go to the file descriptor in ``SCENARIO_EVENTS_FD`` as JSON lines (the parent awaits
them instead of sleeping). This folder is the child's DAGs folder: ``dag.test()`` needs the DAG
to be parseable from there. Usage: ``SCENARIO=stream python task_scenarios.py``.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import threading
import time
from datetime import datetime, timedelta, timezone
from typing import Any

from airflow.sdk import DAG
from airflow.sdk.bases.operator import BaseOperator
from pydantic_ai import Agent
from pydantic_ai.toolsets import FunctionToolset

from cancellable_agents import (
    AgentOperator,
    CancellableAgentMixin,
    LLMOperator,
    PollTrigger,
    current_cancellation,
    defer_to,
)
from cancellable_agents.core.unwind import Phase
from cancellable_agents.hooks.model import build_model
from cancellable_agents.testing import jobs as deferred_jobs
from cancellable_agents.toolsets.subagent_toolset import Subagent, SubagentToolset

_FD = int(os.environ["SCENARIO_EVENTS_FD"])
CONN = "local_model"
#: ``dag.test()`` has no supervisor and so no local evidence: a SIGTERM's cause comes from the
#: in-process execution API, which on a loaded CI machine can take over the default 1 s to answer
#: (the tests that a slow answer must not hold the unwind are in ``test_cause_evidence.py``).
CLASSIFY_TIMEOUT_S = 3.0


def emit(event: str, **data: Any) -> None:
    line = json.dumps({"event": event, "t": time.monotonic(), **data}, default=str) + "\n"
    os.write(_FD, line.encode())


def on_failure(context: Any) -> None:
    exc = context.get("exception")
    emit(
        "task_failed",
        exc_type=type(exc).__name__,
        message=str(exc),
        cause=getattr(getattr(exc, "cause", None), "value", None),
        record=context["task"].cancellation.summary(),
    )


def on_success(context: Any) -> None:
    emit("task_succeeded", record=context["task"].cancellation.summary())


def _wait_until(predicate: Any, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)  # the SIGTERM handler runs between these sleeps, on this thread
    return False


# -- tools --------------------------------------------------------------------------------


async def wait_async() -> str:
    """An async tool that waits for a long time."""
    emit("tool_started", tool="wait_async")
    try:
        await asyncio.sleep(300)
    except asyncio.CancelledError:
        emit("tool_cancelled", tool="wait_async")
        raise
    return "finished"


def wait_cooperatively() -> str:
    """A sync tool that blocks on the task's cancellation scope."""
    emit("tool_started", tool="wait_cooperatively")
    scope = current_cancellation()
    assert scope is not None, "the tool must see the task's scope"
    noticed = scope.wait(300)
    emit("tool_noticed", tool="wait_cooperatively", noticed=noticed)
    return "stopped"


def ignore_cancellation() -> str:
    """A sync tool that ignores cancellation: loops for 30 s."""
    emit("tool_started", tool="ignore_cancellation")
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        time.sleep(0.05)
    return "done"


# -- operators ----------------------------------------------------------------------------


class BusyOperator(CancellableAgentMixin, BaseOperator):
    """Holds a registered resource and busy-waits, so SIGALRM (not the run) ends it."""

    def execute(self, context: Any) -> None:
        scope = self.cancellation
        scope.register(lambda: emit("resource_released"), name="busy-resource", phase=Phase.IN_FLIGHT)
        emit("busy_started")
        _wait_until(lambda: False, 60)


def _model(behaviour: str) -> str:
    return f"openai:{behaviour}"


def build_task(scenario: str) -> BaseOperator:
    common: dict[str, Any] = {
        "task_id": "agent",
        "llm_conn_id": CONN,
        "on_failure_callback": on_failure,
        "on_success_callback": on_success,
        "classify_timeout": CLASSIFY_TIMEOUT_S,
    }
    if scenario in ("stream", "burst"):
        return LLMOperator(
            prompt="write a lot", model=_model("slow?tokens=600&delay=0.05"), stream=True, **common
        )
    if scenario == "nonstream":
        return LLMOperator(prompt="think hard", model=_model("slow?tokens=3&delay=30"), **common)
    if scenario == "async_tool":
        return AgentOperator(prompt="go", model=_model("tool?name=wait_async"), tools=[wait_async], **common)
    if scenario == "sync_coop":
        return AgentOperator(
            prompt="go", model=_model("tool?name=wait_cooperatively"), tools=[wait_cooperatively], **common
        )
    if scenario == "sync_uncoop":
        return AgentOperator(
            prompt="go", model=_model("tool?name=ignore_cancellation"), tools=[ignore_cancellation], **common
        )
    if scenario == "before_run":
        return LLMOperator(prompt="hello", model=_model("echo"), pre_execute=_block_until_killed, **common)
    if scenario == "after_run":
        return LLMOperator(
            prompt="hello", model=_model("echo"), post_execute=_block_until_kill_ignored, **common
        )
    if scenario == "timeout":
        return LLMOperator(
            prompt="write a lot",
            model=_model("slow?tokens=1200&delay=0.05"),
            stream=True,
            # Long enough for a loaded CI machine to build the agent and send the request (a CI
            # run took over 6 s for that, so an 8 s timeout's deadline came first); the stream
            # (60 s) still outlasts it.
            execution_timeout=timedelta(seconds=30),
            **common,
        )
    if scenario == "timeout_sigalrm":
        return BusyOperator(
            task_id="agent",
            execution_timeout=timedelta(seconds=2),
            on_failure_callback=on_failure,
            on_success_callback=on_success,
        )
    if scenario.startswith("wind_down"):
        return build_wind_down_task(scenario, common)
    if scenario.startswith("subagent_"):
        return build_subagent_task(scenario, common)
    if scenario.startswith("mcp_"):
        return build_mcp_task(scenario, common)
    if scenario.startswith("provider_"):
        return build_provider_task(scenario, common)
    if scenario == "deferred":
        return AgentOperator(
            prompt="run the job",
            model=_model('tool?name=start_job&args={"job":"j1"}&then=finished'),
            tools=[start_job],
            durable=True,
            **common,
        )
    raise SystemExit(f"unknown scenario {scenario!r}")


def start_job(job: str) -> str:
    """Start outside work (``cancellable_agents.testing.jobs``: a file the test finishes) and defer to it."""
    root = os.environ["JOBS_DIR"]
    deferred_jobs.start(root, job)
    emit("job_started", job=job, pid=os.getpid())
    defer_to(
        PollTrigger(
            "cancellable_agents.testing.jobs.status",
            {"root": root, "job": job, "events_fd": _FD},
            interval=0.05,
            cancel="cancellable_agents.testing.jobs.cancel",
        )
    )


def _block_until_killed(context: Any) -> None:
    emit("pre_execute")
    _wait_until(lambda: context["task"].cancellation.cancelled, 20)


def _block_until_kill_ignored(context: Any, result: Any = None) -> None:
    emit("post_execute", result=result)
    scope = context["task"].cancellation
    _wait_until(lambda: any(e.event == "cancel_ignored" for e in scope.timeline), 20)


# -- wind-down scenarios (issue 41) -------------------------------------------------------

#: ``execution_timeout`` and ``wind_down`` of the wind-down scenarios: the wind-down starts
#: ``WIND_DOWN_TIMEOUT - timeout_margin (2) - WIND_DOWN`` seconds into the try, late enough for a
#: loaded CI machine to build the agent and make a few steps first.
WIND_DOWN_TIMEOUT = 24.0
WIND_DOWN = 10.0


def step_work(n: int) -> str:
    """One step of work the scripted model keeps asking for while it is offered."""
    emit("step", n=n)
    time.sleep(0.3)
    return f"result {n}"


def _emit_result(context: Any, result: Any = None) -> None:
    emit("result", output=result)


def build_wind_down_task(scenario: str, common: dict[str, Any]) -> BaseOperator:
    """``wind_down``: a model that calls its tool while offered it answers at the wind-down;
    ``wind_down_slow``: its final answer takes 60 s (past the deadline: killed as today)."""
    behaviour = {"wind_down": "loop?name=step_work", "wind_down_slow": "loop?name=step_work&final_delay=60"}
    return AgentOperator(
        prompt="go",
        model=_model(behaviour[scenario]),
        tools=[step_work],
        execution_timeout=timedelta(seconds=WIND_DOWN_TIMEOUT),
        wind_down=WIND_DOWN,
        post_execute=_emit_result,
        **common,
    )


# -- sub-agent scenarios (issue 5) ---------------------------------------------------------

#: Seconds each level's toolset takes to tear down: nested teardowns must overlap, not add up.
SUBAGENT_TEARDOWN = 0.3
_LEAF_STREAM = "slow?tokens=600&delay=0.05"


class SlowTeardownToolset(FunctionToolset[Any]):
    """A toolset whose ``__aexit__`` takes ``SUBAGENT_TEARDOWN`` seconds; reports start and end."""

    def __init__(self, level: str) -> None:
        super().__init__()
        self.level = level

    def __deepcopy__(self, memo: dict[int, Any]) -> SlowTeardownToolset:
        return SlowTeardownToolset(self.level)

    async def __aexit__(self, *args: Any) -> bool | None:
        emit("teardown_started", level=self.level, seconds=SUBAGENT_TEARDOWN)
        done = asyncio.ensure_future(asyncio.sleep(SUBAGENT_TEARDOWN))
        while not done.done():
            try:
                await asyncio.shield(done)
            except asyncio.CancelledError:
                continue  # a teardown that is cancelled again still finishes, like a real one
        emit("teardown_finished", level=self.level)
        return await super().__aexit__(*args)


def _local_model(behaviour: str) -> Any:
    """The model a sub-agent uses: the same local server as the task's connection."""
    conn = json.loads(os.environ["AIRFLOW_CONN_LOCAL_MODEL"])
    return build_model(_model(behaviour), base_url=conn["host"])


def _delegate_to(name: str) -> str:
    """The scripted behaviour: call ``delegate`` once with sub-agent ``name``, then answer."""
    return f'tool?name=delegate&args={{"agent":"{name}","task":"dig deeper"}}'


def _nested_agent(level: int, depth: int) -> Agent[Any, Any]:
    """Level ``level`` of a chain of ``depth`` agents; the last one streams slowly."""
    teardown = SlowTeardownToolset(f"level{level}")
    if level == depth:
        return Agent(_local_model(_LEAF_STREAM), toolsets=[teardown])
    below = Subagent(f"level{level + 1}", _nested_agent(level + 1, depth), stream=level + 1 == depth)
    return Agent(
        _local_model(_delegate_to(below.name)),
        toolsets=[SubagentToolset([below]), teardown],
    )


def child_work() -> str:
    """A sync tool of a thread-driven sub-agent: cooperative polling until cancelled."""
    scope = current_cancellation()
    assert scope is not None, "a sub-agent's tool must see a scope"
    emit("work_started", scope=scope.name, thread=threading.current_thread().name)
    while not scope.wait(0.05):
        emit("work_tick")
    emit("work_stopped", scope=scope.name)
    return "stopped"


def _threads_after_failure(context: Any) -> None:
    on_failure(context)
    # The contract is about the state 1 s after the task raised; this wait is the measurement.
    time.sleep(1.0)
    emit("threads_after", names=sorted(t.name for t in threading.enumerate() if t.is_alive()))


def build_subagent_task(scenario: str, common: dict[str, Any]) -> BaseOperator:
    depth = {"subagent_depth1": 1, "subagent_depth2": 2, "subagent_depth3": 3}.get(scenario)
    if depth == 1:
        return AgentOperator(
            prompt="go",
            model=_model(_LEAF_STREAM),
            stream=True,
            toolsets=[SlowTeardownToolset("level1")],
            **common,
        )
    if depth is not None:
        below = Subagent("level2", _nested_agent(2, depth), stream=depth == 2)
        return AgentOperator(
            prompt="go",
            model=_model(_delegate_to("level2")),
            toolsets=[SubagentToolset([below]), SlowTeardownToolset("level1")],
            **common,
        )
    if scenario == "subagent_thread":
        worker = Agent(_local_model("tool?name=child_work"), tools=[child_work])
        return AgentOperator(
            prompt="go",
            model=_model(_delegate_to("worker")),
            toolsets=[SubagentToolset({"worker": worker}, threaded=True)],
            **{**common, "on_failure_callback": _threads_after_failure},
        )
    raise SystemExit(f"unknown scenario {scenario!r}")


# -- MCP scenarios (issue 32) -------------------------------------------------------------

_MCP_SERVER = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "mcp_server.py")


def build_mcp_task(scenario: str, common: dict[str, Any]) -> BaseOperator:
    """``mcp_MODE`` / ``mcp_MODE_noreap``: an agent whose one toolset is a real MCP server
    (``tests/process/mcp_server.py MODE``; over stdio, or streamable HTTP for ``http``, a server the
    test started) and whose model calls its ``work`` tool once. ``_noreap``: without the
    descendant reaper. The server's events file and marker come from the test (``MCP_EVENTS``,
    ``MCP_MARKER``; ``MCP_URL`` for ``http``)."""
    from fastmcp.client.transports import StdioTransport
    from pydantic_ai.mcp import MCPToolset

    mode = scenario.removeprefix("mcp_").removesuffix("_noreap")
    if mode == "http":
        toolset = MCPToolset(os.environ["MCP_URL"])
    else:
        args = [_MCP_SERVER, mode, os.environ["MCP_EVENTS"], os.environ["MCP_MARKER"]]
        # The server's environment is the SDK's reduced default plus what it needs to import mcp.
        toolset = MCPToolset(StdioTransport(sys.executable, args), init_timeout=120)
    return AgentOperator(
        prompt="go",
        model=_model("tool?name=work"),
        toolsets=[toolset],
        reap_descendants=not scenario.endswith("_noreap"),
        **common,
    )


# -- per-provider kills (issue 44, item 3) --------------------------------------------------

#: What each provider's model streams: 600 tokens 50 ms apart (30 s), killed mid-stream.
PROVIDER_STREAM = "slow?tokens=600&delay=0.05"


class ProviderOperator(LLMOperator):
    """``LLMOperator`` whose model is provider ``provider``'s real SDK pointed at the local server
    (``tests/provider_models.py``), built when the task runs."""

    def __init__(self, *, provider: str, script: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.provider = provider
        self.script = script

    def build_agent(self) -> Any:
        from tests.provider_models import build

        root = json.loads(os.environ["AIRFLOW_CONN_LOCAL_MODEL"])["host"].removesuffix("/v1")
        return Agent(build(self.provider, self.script, root))


def _resources_after_failure(context: Any) -> None:
    """The failure report, then what of the request outlives the unwind: threads other than the
    main one, and this process's TCP connections to the model server still established."""
    on_failure(context)
    import psutil

    port = int(json.loads(os.environ["AIRFLOW_CONN_LOCAL_MODEL"])["host"].rsplit(":", 1)[1].split("/")[0])
    connections = [
        c.status
        for c in psutil.Process().net_connections(kind="tcp")
        if c.raddr and c.raddr.port == port and c.status == psutil.CONN_ESTABLISHED
    ]
    threads = [
        (t.name, t.daemon) for t in threading.enumerate() if t.is_alive() and t is not threading.main_thread()
    ]
    emit("resources_after_unwind", connections=connections, threads=threads)


#: When the kill lands in the request (``provider_NAME_MOMENT``): ``stream``: mid-stream, tokens
#: flowing; ``first``: streaming, before the first byte (the model still thinking, headers not
#: sent); ``whole``: a non-streaming request, before its answer.
PROVIDER_MOMENTS = {
    "stream": (PROVIDER_STREAM, True),
    "first": (PROVIDER_STREAM + "&delay_first=30", True),
    "whole": ("slow?tokens=3&delay=10", False),
}


def build_provider_task(scenario: str, common: dict[str, Any]) -> BaseOperator:
    """``provider_NAME_MOMENT``: one request of provider ``NAME``'s SDK, 30 s long, to be killed
    at ``MOMENT`` (`PROVIDER_MOMENTS`)."""
    provider, _, moment = scenario.removeprefix("provider_").rpartition("_")
    script, stream = PROVIDER_MOMENTS[moment]
    return ProviderOperator(
        provider=provider,
        script=script,
        prompt="write a lot",
        stream=stream,
        **{**common, "on_failure_callback": _resources_after_failure},
    )


SCENARIO = os.environ.get("SCENARIO", "stream")

with DAG(f"scenario_{SCENARIO}", schedule=None, start_date=datetime(2026, 1, 1, tzinfo=timezone.utc)) as dag:
    build_task(SCENARIO)


if __name__ == "__main__":
    import faulthandler
    import signal

    from tests.dag_test_compat import exit_as_the_task_sdk_does, prepare_dag_test

    faulthandler.register(signal.SIGUSR1, all_threads=True)  # TaskChild.dump_stacks on a hang
    emit("starting", pid=os.getpid())
    prepare_dag_test()  # Airflow 3.1/3.2's dag.test() path, made to behave like production
    dag.test()
    # What of ours still runs once the task is over: nothing may keep the process alive.
    emit("exited", threads=[(t.name, t.daemon) for t in threading.enumerate() if t.is_alive()])
    exit_as_the_task_sdk_does()
