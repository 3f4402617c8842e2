"""The kill-latency scenarios: what each one runs (child side) and when to kill it (parent side).

Every scenario is the same workload for both implementations: ``ours`` builds the provider's
operators (``LLMOperator`` / ``AgentOperator`` through the ``cancellable_agents_model``
connection, ``SandboxToolset``, ``SubagentToolset``); ``common-ai`` runs the same pydantic-ai agent
through ``airflow.providers.common.ai``'s ``CancellableAgentRunMixin``. Where the two differ in
what a user would write, the difference is named in :attr:`Scenario.note`:

- sub-agents under common.ai delegate with a plain async tool (``await sub.run(...)``), the way
  pydantic-ai documents delegation, since common.ai has no sub-agent toolset;
- a "cooperative" sync tool asks :func:`cancellable_agents.current_cancellation`; common.ai offers
  no such signal, so there the same tool cannot notice the kill and runs to its own end.

Processes a repetition starts carry its *marker* in their command line (``sleep 6NN.XXXXXXXX``), so
the parent can tell, with psutil, when the last of them is gone, and kill leftovers by pid.
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Literal
from urllib.parse import urlencode

from pydantic_ai import RunContext

CONN_ID = "bench_model"
CONN_ENV = "AIRFLOW_CONN_BENCH_MODEL"
#: Base URL of a second model server that only serves the children's warm-up runs.
WARMUP_ENV = "BENCH_WARMUP_URL"

#: A streamed answer that would take ~20 s: the kill always lands mid-stream.
LONG_STREAM = "slow?" + urlencode({"tokens": 2000, "delay": 0.01})
#: A non-streamed answer the server sends after 30 s of silence.
LONG_SILENCE = "slow?" + urlencode({"tokens": 3, "delay": 10})
#: How long the uncooperative and the unnoticing tools run (longer than Airflow's grace).
TOOL_SECONDS = 20.0
#: ``execution_timeout`` of the timeout scenario.
TIMEOUT_SECONDS = 2.5

Impl = Literal["ours", "common-ai"]
Ready = Literal["tokens", "request", "tool_started", "markers", "ready", "none"]


@dataclass(frozen=True)
class Scenario:
    """One measured situation.

    :param ready: when the parent sends the SIGTERM: ``tokens`` (the server streamed some),
        ``request`` (the server holds the request), ``tool_started`` / ``ready`` (the child said
        so), ``markers`` (``marker_count`` marked processes run), ``none`` (no SIGTERM: timeout).
    :param straggler: the workload ignores cancellation on purpose (excluded from the targets).
    """

    name: str
    title: str
    ready: Ready
    marker_count: int = 0
    straggler: bool = False
    trigger: Literal["sigterm", "timeout"] = "sigterm"
    note: str = ""
    reps: int | None = None


SCENARIOS: tuple[Scenario, ...] = (
    Scenario("stream", "streaming model request", "tokens"),
    Scenario("nonstream", "non-streaming model request", "request"),
    Scenario("async-tool", "async tool (runs a CLI subprocess)", "tool_started", marker_count=1),
    Scenario(
        "sync-coop",
        "cooperative sync tool",
        "tool_started",
        note="common.ai has no cancellation signal for tools: there the tool runs to its end",
    ),
    Scenario("sync-uncoop", "uncooperative sync tool", "tool_started", straggler=True),
    Scenario("sandbox-namespace", "sandbox tree (namespace)", "markers", marker_count=3),
    Scenario("sandbox-pgroup", "sandbox tree (process group)", "markers", marker_count=3),
    Scenario("subagent-1", "sub-agents, depth 1", "tokens", note="common.ai: plain delegation tool"),
    Scenario("subagent-2", "sub-agents, depth 2", "tokens", note="common.ai: plain delegation tool"),
    Scenario("subagent-3", "sub-agents, depth 3", "tokens", note="common.ai: plain delegation tool"),
    Scenario("before-run", "kill before the run", "ready"),
    Scenario(
        "timeout",
        f"execution_timeout ({TIMEOUT_SECONDS:g} s)",
        "none",
        trigger="timeout",
        note="trigger = the deadline the implementation acts on (ours: the run's own, 2 s early; "
        "common.ai: SIGALRM)",
    ),
    Scenario(
        "stream-dagtest",
        "streaming request via real dag.test()",
        "tokens",
        note="the real Task SDK path (incl. the cause query); ours only",
        reps=5,
    ),
)

BY_NAME = {s.name: s for s in SCENARIOS}


def model_string(behaviour: str, **params: Any) -> str:
    """``behaviour?k=v...`` for the local model server, percent-encoded (commands contain ``&``)."""
    encoded = {k: json.dumps(v) if isinstance(v, dict) else v for k, v in params.items()}
    return f"{behaviour}?{urlencode(encoded)}" if encoded else behaviour


# -- child side ---------------------------------------------------------------------------------
# Everything below runs in the task process; heavy imports stay inside the functions.

Emit = Callable[..., None]


@dataclass
class Rep:
    """One repetition's parameters, as the child sees them."""

    scenario: Scenario
    impl: Impl
    marker: str
    emit: Emit
    tool_threads: set[threading.Thread]


def base_url() -> str:
    return str(json.loads(os.environ[CONN_ENV])["host"])


def warm_up() -> None:
    """Import and exercise what a run and an unwind need, so no repetition pays for a cold process.

    Real task processes are cold (``stream-dagtest`` shows that path): the first cancellation in
    a process pays for lazy initialisation (e.g. pydantic's serializer for transcripts). The
    warm-up runs, and cancels, a delegating agent against its own server, so its requests never
    mix with a measured repetition's.
    """
    import contextlib

    from pydantic_ai import Agent

    from cancellable_agents.core.exceptions import TaskCancelled
    from cancellable_agents.core.scope import TaskCancellation
    from cancellable_agents.hooks.model import ModelHook, build_model
    from cancellable_agents.run.runner import run_agent_in_scope
    from cancellable_agents.toolsets.subagent_toolset import Subagent, SubagentToolset

    with contextlib.suppress(ImportError):
        import airflow.providers.common.ai.mixins.cancellable_run  # noqa: F401
    import cancellable_agents.operators.agent
    import cancellable_agents.toolsets.sandbox  # noqa: F401

    ModelHook(llm_conn_id=CONN_ID, model="openai:echo").get_model()
    url = os.environ.get(WARMUP_ENV)
    if not url:
        return
    for stream in (False, True):
        kwargs: dict[str, Any] = {"event_stream_handler": drain_events} if stream else {}
        run_agent_in_scope(
            TaskCancellation("warm-up"), Agent(build_model("openai:echo", base_url=url)), "hi", **kwargs
        )
    leaf = Subagent("leaf", Agent(build_model(f"openai:{LONG_STREAM}", base_url=url)), stream=True)
    lead = Agent(build_model(f"openai:{_delegate('leaf')}", base_url=url), toolsets=[SubagentToolset([leaf])])
    scope = TaskCancellation("warm-up")
    timer = threading.Timer(0.5, scope.cancel)  # any moment mid-run will do: this is not measured
    timer.start()
    with contextlib.suppress(TaskCancelled):
        run_agent_in_scope(scope, lead, "warm up")
    timer.join()
    scope.wait_released(5)


def build_task(rep: Rep) -> Any:
    """A fresh operator for ``rep`` (a cancellation scope is per task instance)."""
    name = rep.scenario.name
    if name.startswith("subagent-"):
        depth = int(name.rsplit("-", 1)[1])
        return _subagent_task(rep, depth)
    builders: dict[str, Callable[[Rep], Any]] = {
        "stream": lambda r: _llm_task(r, LONG_STREAM, stream=True),
        "nonstream": lambda r: _llm_task(r, LONG_SILENCE, stream=False),
        "before-run": lambda r: _llm_task(r, LONG_STREAM, stream=True),
        "timeout": lambda r: _llm_task(
            r, LONG_STREAM, stream=True, execution_timeout=timedelta(seconds=TIMEOUT_SECONDS)
        ),
        "async-tool": _async_tool_task,
        "sync-coop": lambda r: _sync_tool_task(r, cooperative=True),
        "sync-uncoop": lambda r: _sync_tool_task(r, cooperative=False),
        "sandbox-namespace": lambda r: _sandbox_task(r, "namespace"),
        "sandbox-pgroup": lambda r: _sandbox_task(r, "process-group"),
    }
    return builders[name](rep)


def _operator(
    rep: Rep, behaviour: str, *, stream: bool, tools: Any = (), toolsets: Any = (), **kw: Any
) -> Any:
    """Ours: the provider's ``AgentOperator`` through the connection; common.ai: its mixin."""
    if rep.impl == "ours":
        from cancellable_agents import AgentOperator

        return AgentOperator(
            task_id="agent",
            prompt="go",
            llm_conn_id=CONN_ID,
            model=f"openai:{behaviour}",
            stream=stream,
            tools=list(tools),
            toolsets=list(toolsets),
            **kw,
        )
    from pydantic_ai import Agent

    from cancellable_agents.hooks.model import build_model

    agent = Agent(
        build_model(f"openai:{behaviour}", base_url=base_url()), tools=list(tools), toolsets=list(toolsets)
    )
    return common_ai_operator(agent, stream=stream, **kw)


def common_ai_operator(agent: Any, *, stream: bool, **kw: Any) -> Any:
    """An operator that runs ``agent`` through common.ai's ``CancellableAgentRunMixin``."""
    from airflow.providers.common.ai.mixins.cancellable_run import CancellableAgentRunMixin
    from airflow.sdk.bases.operator import BaseOperator

    class CommonAIAgentOperator(CancellableAgentRunMixin, BaseOperator):  # type: ignore[misc]
        def __init__(self, **kwargs: Any) -> None:
            super().__init__(**kwargs)
            self.agent = agent

        def execute(self, context: Any) -> Any:
            kwargs: dict[str, Any] = {"event_stream_handler": drain_events} if stream else {}
            return self.run_agent_sync(self.agent, "go", **kwargs).output

    return CommonAIAgentOperator(task_id="agent", **kw)


async def drain_events(ctx: Any, events: Any) -> None:
    """Passing an event handler makes pydantic-ai stream the model response."""
    async for _ in events:
        pass


def _llm_task(rep: Rep, behaviour: str, *, stream: bool, **kw: Any) -> Any:
    if rep.impl == "ours":
        from cancellable_agents import LLMOperator

        return LLMOperator(
            task_id="agent",
            prompt="go",
            llm_conn_id=CONN_ID,
            model=f"openai:{behaviour}",
            stream=stream,
            **kw,
        )
    return _operator(rep, behaviour, stream=stream, **kw)


def _async_tool_task(rep: Rep) -> Any:
    marker, emit = rep.marker, rep.emit

    async def run_cli() -> str:
        """Run a command-line program and wait for it (a typical async tool)."""
        proc = await asyncio.create_subprocess_exec("sleep", marker)
        emit("tool_started", pid=proc.pid)
        await proc.wait()
        return "finished"

    return _operator(rep, model_string("tool", name="run_cli"), stream=False, tools=[run_cli])


def _sync_tool_task(rep: Rep, *, cooperative: bool) -> Any:
    emit, threads = rep.emit, rep.tool_threads

    def work() -> str:
        """A long blocking job in a sync tool."""
        threads.add(threading.current_thread())
        emit("tool_started")
        try:
            scope = _current_scope() if cooperative else None
            if scope is not None:
                scope.wait(TOOL_SECONDS)  # wakes at once when the run is cancelled
                return "stopped"
            deadline = time.monotonic() + TOOL_SECONDS
            while time.monotonic() < deadline:
                time.sleep(0.02)  # busy work that never looks at cancellation
            return "done"
        finally:
            emit("tool_exited")
            threads.discard(threading.current_thread())

    return _operator(rep, model_string("tool", name="work"), stream=False, tools=[work])


def _current_scope() -> Any:
    from cancellable_agents import current_cancellation

    return current_cancellation()


def _sandbox_task(rep: Rep, isolation: str) -> Any:
    from cancellable_agents.toolsets.sandbox import SandboxToolset

    m = rep.marker
    command = f"setsid sleep {m} & (sleep {m} &) ; sleep {m}"
    behaviour = model_string("tool", name="run_shell", args={"command": command})
    toolset = SandboxToolset(isolation=isolation)  # type: ignore[arg-type]
    return _operator(rep, behaviour, stream=False, toolsets=[toolset])


def _subagent_task(rep: Rep, depth: int) -> Any:
    """The task's agent delegates to level1, which delegates ... to level``depth``, which streams."""
    if rep.impl == "ours":
        from cancellable_agents.toolsets.subagent_toolset import Subagent, SubagentToolset

        below = Subagent("level1", _our_level(1, depth), stream=depth == 1)
        return _operator(rep, _delegate("level1"), stream=False, toolsets=[SubagentToolset([below])])
    return _operator(
        rep,
        model_string("tool", name="delegate", args={"task": "dig"}),
        stream=False,
        tools=[_plain_delegation(_plain_level(1, depth), stream=depth == 1)],
    )


def _delegate(name: str) -> str:
    return model_string("tool", name="delegate", args={"agent": name, "task": "dig deeper"})


def _local_agent(behaviour: str, **kw: Any) -> Any:
    from pydantic_ai import Agent

    from cancellable_agents.hooks.model import build_model

    return Agent(build_model(f"openai:{behaviour}", base_url=base_url()), **kw)


def _our_level(level: int, depth: int) -> Any:
    from cancellable_agents.toolsets.subagent_toolset import Subagent, SubagentToolset

    if level == depth:
        return _local_agent(LONG_STREAM)
    below = Subagent(f"level{level + 1}", _our_level(level + 1, depth), stream=level + 1 == depth)
    return _local_agent(_delegate(below.name), toolsets=[SubagentToolset([below])])


def _plain_level(level: int, depth: int) -> Any:
    if level == depth:
        return _local_agent(LONG_STREAM)
    tool = _plain_delegation(_plain_level(level + 1, depth), stream=level + 1 == depth)
    return _local_agent(model_string("tool", name="delegate", args={"task": "dig"}), tools=[tool])


def _plain_delegation(sub: Any, *, stream: bool) -> Any:
    async def delegate(ctx: RunContext[Any], task: str) -> str:
        """Delegate a task to a sub-agent."""
        kwargs: dict[str, Any] = {"event_stream_handler": drain_events} if stream else {}
        result = await sub.run(task, usage=ctx.usage, **kwargs)
        return str(result.output)

    return delegate
