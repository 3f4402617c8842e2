"""Fork server for the durable process tests: imports once, then forks one real process per try.

Importing pydantic-ai, the OpenAI client and Airflow's ObjectStoragePath takes seconds on a busy
machine; forking a process that has them loaded takes milliseconds. Each try is a forked child
running one durable run against the local model server (real HTTP), journaled into files under
an ``ObjectStoragePath`` (``PathStore``): the parent SIGKILLs it, really, at the moment it chooses.

Protocol: one JSON command per stdin line, ``{"try": N, "store": URL, "lines": PATH, "stop_after":
K, "block_in": S, "release": PATH, "wait": true, "parallel": false, "flush": F, "write_ahead":
false}``; events as JSON lines on the fd in ``EVENTS_FD``: ``started`` (pid), ``recorded`` (the
child appended its K-th entry and now waits to be killed), ``tool_running`` (step S wrote its line
and blocks until the file ``release`` exists, if given), ``completed``, ``cancelled`` (cause,
detail) and ``exited`` (status as ``os.waitstatus_to_exitcode``; only for ``wait``: the others run
beside the next try). ``flush``: the journal's ``returns_flush_s`` (``0``: each tool's return is
appended at once, a boundary of its own). ``write_ahead``: the journal's (each step stored before
its tools start, so the run stops dead at a boundary a ``stop_after`` store sleeps in).
``store_delay``: each store call takes that many seconds more (an API server that answers late);
``max_unconfirmed``: the journal's; ``steps``: how many steps the model asks for (default
``STEPS``). ``mcp``: the steps are the tool ``step`` of a real MCP stdio server
(``mcp_server.py steps``), which appends each execution to the file ``mcp`` names.
``parallel``: one model response calls ``fetch`` and ``slow`` at once; ``slow`` (try 1 only)
emits ``tool_running`` and blocks;
``tool_result_recorded`` says a parallel call's result was appended.
Each tool execution appends a line to ``lines``: the step, the try, ``is_rerun``, the call's
idempotency key and its tool call id.
Single-threaded between forks, so forking is safe.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from airflow.sdk import ObjectStoragePath
from pydantic_ai import Agent, RunContext
from pydantic_ai.models.openai import OpenAIChatModel
from pydantic_ai.providers.openai import OpenAIProvider

from cancellable_agents.core.exceptions import TaskCancelled
from cancellable_agents.core.scope import TaskCancellation
from cancellable_agents.durable import Journal, PathStore, current_resume
from cancellable_agents.run.runner import run_agent_in_scope
from cancellable_agents.run.tool_calls import RunIdentity, current_tool_call

FD = int(os.environ["EVENTS_FD"])
STEPS = int(os.environ.get("STEPS", "3"))
#: The task instance every try belongs to (its tool calls' keys derive from it).
TASK_INSTANCE = ("durable_kill", "agent", "manual__1", 0)


def emit(event: str, **data: Any) -> None:
    line = {"event": event, "pid": os.getpid(), "t": time.monotonic(), **data}
    os.write(FD, (json.dumps(line) + "\n").encode())


class KilledAtBoundary(PathStore):
    """A PathStore whose writer stops dead after its K-th entry (a SIGKILL lands right there)."""

    stop_after = 0
    entries = 0
    delay = 0.0

    def set(self, key: str, value: Any) -> None:
        time.sleep(type(self).delay)
        super().set(key, value)
        for entry in value if isinstance(value, list) else [value]:
            if entry["kind"] == "tool_result":
                emit("tool_result_recorded", tool=entry["tool"])
            type(self).entries += 1
            if type(self).entries == type(self).stop_after:
                emit("recorded", key=key, kind=entry["kind"], entries=entry["i"] + 1)
                time.sleep(300)


def run_try(
    try_number: int,
    store_url: str,
    lines: Path,
    block_in: int,
    release: str | None,
    parallel: bool = False,
    flush: float | None = None,
    write_ahead: bool = False,
    mcp: str | None = None,
    steps: int = STEPS,
    max_unconfirmed: int | None = None,
) -> None:
    behaviour = (
        "tools?names=fetch,slow&then=all+done" if parallel else f"steps?name=step&count={steps}&then=all+done"
    )
    model = OpenAIChatModel(behaviour, provider=OpenAIProvider(base_url=os.environ["BASE_URL"], api_key="x"))
    toolsets = []
    if mcp is not None:
        from fastmcp.client.transports import StdioTransport
        from pydantic_ai.mcp import MCPToolset

        server = [str(Path(__file__).with_name("mcp_server.py")), "steps", mcp, "0"]
        toolsets.append(MCPToolset(StdioTransport(sys.executable, server), init_timeout=120))
    agent: Agent[None, str] = Agent(model, system_prompt="do the steps in order", toolsets=toolsets)

    def ran(name: str | int, ctx: RunContext[None]) -> None:
        resume = current_resume()
        rerun = bool(resume and resume.is_rerun(ctx.tool_call_id))
        call = current_tool_call()
        key = call.idempotency_key if call is not None else None
        line = {"n": name, "try": try_number, "rerun": rerun, "key": key, "id": ctx.tool_call_id}
        with lines.open("a") as out:
            out.write(json.dumps(line) + "\n")

    if parallel:

        @agent.tool
        async def fetch(ctx: RunContext[None]) -> str:
            ran("fetch", ctx)
            return "42 orders"

        @agent.tool
        def slow(ctx: RunContext[None]) -> str:
            ran("slow", ctx)
            if try_number == 1:
                emit("tool_running", n="slow")
                time.sleep(60)  # SIGKILLed here
            return "slow ok"

    def step(ctx: RunContext[None], n: int) -> str:
        ran(n, ctx)
        if n == block_in:
            emit("tool_running", n=n)
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and not (release and os.path.exists(release)):
                time.sleep(0.01)
        return f"step {n} ok"

    if mcp is None:
        agent.tool(step)
    scope = TaskCancellation(f"try{try_number}")
    store = KilledAtBoundary(ObjectStoragePath(store_url))
    options: dict[str, Any] = {} if flush is None else {"returns_flush_s": flush}
    if max_unconfirmed is not None:
        options["max_unconfirmed"] = max_unconfirmed
    journal = Journal(store, try_number=try_number, scope=scope, write_ahead=write_ahead, **options)
    try:
        with scope.activate():
            identity = RunIdentity(TASK_INSTANCE, origin_try=try_number)
            result = run_agent_in_scope(scope, agent, f"do {steps} steps", journal=journal, identity=identity)
    except TaskCancelled as exc:
        emit("cancelled", cause=exc.cause.value, detail=exc.detail)
        return
    resumed = journal.resume
    emit("completed", output=result.output, resumed_messages=resumed.messages if resumed else 0)


def warm_up() -> None:
    """Import in the zygote what a first run imports, without starting a thread (forking a
    process with threads can deadlock the child): a FunctionModel run, the HTTP stack, the store."""
    import importlib
    import threading

    from pydantic_ai.messages import ModelResponse, TextPart
    from pydantic_ai.models.function import FunctionModel

    from cancellable_agents.durable import MemoryStore

    for name in ("anyio._backends._asyncio", "httpcore", "genai_prices.data", "openai.types.chat"):
        importlib.import_module(name)
    PathStore(ObjectStoragePath("file:///nonexistent-warm-up"))
    agent: Agent[None, str] = Agent(FunctionModel(lambda m, i: ModelResponse(parts=[TextPart("ok")])))
    scope = TaskCancellation("warm-up")
    journal = Journal(MemoryStore(), try_number=1, scope=scope)
    with scope.activate():
        run_agent_in_scope(scope, agent, "warm up", journal=journal)
    assert threading.active_count() == 1, f"the zygote must fork single-threaded: {threading.enumerate()}"


def main() -> None:
    warm_up()
    emit("ready")
    for line in sys.stdin:
        command = json.loads(line)
        _reap_quietly()
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                KilledAtBoundary.stop_after = command.get("stop_after", 0)
                KilledAtBoundary.delay = command.get("store_delay", 0.0)
                run_try(
                    command["try"],
                    command["store"],
                    Path(command["lines"]),
                    command.get("block_in", 0),
                    command.get("release"),
                    command.get("parallel", False),
                    command.get("flush"),
                    command.get("write_ahead", False),
                    command.get("mcp"),
                    command.get("steps", STEPS),
                    command.get("max_unconfirmed"),
                )
            except BaseException as exc:
                emit("failed", error=repr(exc))
                code = 1
            os._exit(code)
        emit("started", child=pid)
        if command.get("wait", True):
            _, status = os.waitpid(pid, 0)
            emit("exited", child=pid, code=os.waitstatus_to_exitcode(status))


def _reap_quietly() -> None:
    """Collect tries that ran beside others (``wait: false``) and have exited since."""
    try:
        while os.waitpid(-1, os.WNOHANG)[0]:
            pass
    except ChildProcessError:
        pass


if __name__ == "__main__":
    main()
