"""Delegation to sub-agents that stop when their parent stops: in order, with no lost interrupt.

[`SubagentToolset`][] lets any pydantic-ai agent hand a task to named sub-agents (each a
pydantic-ai agent, with its own tools and toolsets, e.g. a sandbox)::

    researcher = Agent("openai:gpt-4o-mini", toolsets=[SandboxToolset()])
    AgentOperator(task_id="lead", prompt="...", toolsets=[SubagentToolset({"researcher": researcher})])

The model gets one tool, ``delegate(agent, task) -> str`` (name configurable; ``agent`` is an
enum of the sub-agent names, the tool description lists their descriptions). Every delegation
runs under a *child* of the run's [`TaskCancellation`][cancellable_agents.core.scope.TaskCancellation]:

- the parent's cancel cancels the child with cause ``PARENT`` (``root_cause`` still says why the
  task stopped); the child's grace budget is what the parent has left, and a child run started
  from a tool inherits the parent run's deadline (pydantic-ai's ``RunContext.deadline``);
- no lost interrupt: a cancel that lands while the child is being created, before its run has
  registered, still reaches it; the child refuses to start and makes no model request;
- a cancelled child never becomes a tool result, a ``ModelRetry`` or a retry of the delegation:
  the delegation ends as cancellation. A child cancelled on its own (its own deadline, someone
  cancelling its scope) cancels the parent with the same cause, so the task stops;
- order: the whole scope tree is flagged before the parent's ``cancel()`` returns and unwinds
  concurrently (children before the parent's own token); each run stops its in-flight work
  (model request, tools, its children's in-flight work) before its toolsets tear down, and a
  cancelled child's teardown overlaps its parent's teardown instead of preceding it, so nesting
  depth does not add up teardown times;
- the delegation owns the child scope and settles it (``COMPLETED`` only if nothing above was
  cancelled by then); the child's partial transcript, message count and usage are attached to
  its record (``attached``), which the parent's record lists under ``children``; the child's
  usage is also added to the parent run's usage.

Two ways to drive a child. ``SubagentToolset(...)`` (default) awaits the child on the parent's
event loop, in its own asyncio task so a cancel reaches it as pydantic-ai's own first-party
cancellation (``RunCancelled`` with the transcript) rather than as a bare ``CancelledError``.
``SubagentToolset(..., threaded=True)`` makes ``delegate`` a sync tool that drives the child with
``asyncio.run`` on the tool's worker thread (``Agent.run_sync`` is refused inside a sync tool).
From your own tools, call [`run_subagent`][] (async) or [`run_subagent_sync`][] (threads).

How to write sync tools that stop in time: ``docs/content/tools.md``. This module imports no Airflow.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

from pydantic_ai import ModelRetry, RunContext
from pydantic_ai.agent import AbstractAgent
from pydantic_ai.messages import ModelMessage, ModelMessagesTypeAdapter
from pydantic_ai.toolsets import FunctionToolset
from pydantic_ai.usage import RunUsage

from cancellable_agents.core._shield import wait_shielded
from cancellable_agents.core._usage import usage_dict
from cancellable_agents.core.causes import CancelCause
from cancellable_agents.core.exceptions import TaskCancelled
from cancellable_agents.core.scope import Outcome, TaskCancellation, current_cancellation
from cancellable_agents.run._tracker import RunTracker, current_run_tracker
from cancellable_agents.run.runner import run_agent_in_scope_async
from cancellable_agents.toolsets.subagent_toolset import Subagent, by_name

__all__ = ["SubagentTools", "run_subagent", "run_subagent_sync"]

log = logging.getLogger(__name__)


class SubagentTools(FunctionToolset[Any]):
    """A ``delegate(agent, task) -> str`` tool that runs named sub-agents under child scopes: the
    pydantic-ai toolset a
    [`SubagentToolset`][cancellable_agents.toolsets.subagent_toolset.SubagentToolset] makes when
    the task runs (same arguments).

    :param agents: ``{"name": agent}`` or a sequence of [`Subagent`][] (names must be unique).
    :param tool_name: the tool's name (default ``delegate``).
    :param threaded: drive each child from the tool's worker thread (``asyncio.run``) instead of
        awaiting it on the parent's loop. Both are cancelled the same way.
    :param id: the toolset id (pydantic-ai durable execution needs one).

    The child's output is returned as text (non-string outputs as JSON). Deep-copying the toolset
    (Airflow copies operators) shares the agents, which hold no per-run state, and copies nothing
    else; the toolset itself keeps no per-run state either, so one instance can serve many runs.
    """

    def __init__(
        self,
        agents: Mapping[str, AbstractAgent[Any, Any]] | Sequence[Subagent],
        *,
        tool_name: str = "delegate",
        threaded: bool = False,
        id: str | None = None,
    ) -> None:
        super().__init__(id=id)
        self.subagents = by_name(agents)
        self.tool_name = tool_name
        self.threaded = threaded
        self.add_function(
            self._tool_function(), name=tool_name, description=self._description(), takes_ctx=True
        )

    def __deepcopy__(self, memo: dict[int, Any]) -> SubagentTools:
        return type(self)(
            list(self.subagents.values()), tool_name=self.tool_name, threaded=self.threaded, id=self.id
        )

    def __repr__(self) -> str:
        return f"{type(self).__name__}({list(self.subagents)!r}, tool_name={self.tool_name!r})"

    async def ask(self, agent: str, task: str, *, usage: RunUsage | None = None, model: Any = None) -> str:
        """Run sub-agent ``agent`` on ``task`` (awaited on this loop) and return its output as text.

        ``model`` (the parent's) is used by a sub-agent built without a model of its own.
        """
        sub = self._get(agent)
        kwargs = _with_fallback_model(sub, model)
        result = await run_subagent(sub.the_agent(), task, name=sub.name, parent_usage=usage, **kwargs)
        return _as_text(result.output)

    def ask_sync(self, agent: str, task: str, *, usage: RunUsage | None = None, model: Any = None) -> str:
        """Run sub-agent ``agent`` on ``task`` from this thread and return its output as text."""
        sub = self._get(agent)
        kwargs = _with_fallback_model(sub, model)
        result = run_subagent_sync(sub.the_agent(), task, name=sub.name, parent_usage=usage, **kwargs)
        return _as_text(result.output)

    def _get(self, name: str) -> Subagent:
        sub = self.subagents.get(name)
        if sub is None:
            raise ModelRetry(f"unknown sub-agent {name!r}; choose one of {sorted(self.subagents)}")
        return sub

    def _description(self) -> str:
        lines = [
            f"- {sub.name}: {sub.description}" if sub.description else f"- {sub.name}"
            for sub in self.subagents.values()
        ]
        return (
            "Delegate a self-contained task to a sub-agent and return its final answer. The sub-agent "
            "does not see this conversation: put everything it needs into `task`. Sub-agents:\n"
            + "\n".join(lines)
        )

    def _tool_function(self) -> Callable[..., Any]:
        """The tool, with ``agent`` typed as a ``Literal`` of the names (an enum in the schema)."""
        if self.threaded:

            def delegate(ctx: RunContext[Any], agent: str, task: str) -> str:
                """Delegate a task to a sub-agent.

                Args:
                    agent: Which sub-agent to ask.
                    task: The complete task, with all context the sub-agent needs.
                """
                return self.ask_sync(agent, task, usage=ctx.usage, model=ctx.model)

            tool: Callable[..., Any] = delegate
        else:

            async def delegate_async(ctx: RunContext[Any], agent: str, task: str) -> str:
                """Delegate a task to a sub-agent.

                Args:
                    agent: Which sub-agent to ask.
                    task: The complete task, with all context the sub-agent needs.
                """
                return await self.ask(agent, task, usage=ctx.usage, model=ctx.model)

            tool = delegate_async
        names = tuple(self.subagents)
        tool.__annotations__ = {
            "ctx": RunContext[Any],
            "agent": Literal[names],  # type: ignore[valid-type]
            "task": str,
            "return": str,
        }
        return tool


# -- running one child --------------------------------------------------------------------


async def run_subagent(
    agent: AbstractAgent[Any, Any],
    user_prompt: Any = None,
    *,
    name: str | None = None,
    scope: TaskCancellation | None = None,
    parent_usage: RunUsage | None = None,
    **run_kwargs: Any,
) -> Any:
    """``await agent.run(...)`` as a sub-agent of ``scope`` (default: the current run's scope).

    Returns the ``AgentRunResult``. The child runs in its own asyncio task under
    ``scope.child(name)``. If the awaiting task (the delegating tool) is cancelled, the child is
    cancelled (``PARENT``), this waits, within the child's budget, until the child's in-flight
    work has stopped, hands the child's remaining teardown to the parent run (which awaits it
    after its own teardown) and re-raises ``CancelledError``. If the child is cancelled on its
    own, the parent scope is cancelled with the same cause and the delegation ends as
    cancellation too (``CancelledError`` once the parent run tells this tool to stop, or
    [`TaskCancelled`][] where no run of ours is around). Never returns a cancelled child's
    result. ``parent_usage`` (e.g. ``ctx.usage``) gets the child's usage added.
    """
    parent = scope if scope is not None else current_cancellation()
    child = _child_scope(parent, name or _agent_name(agent))
    tracker = RunTracker(child)
    task = asyncio.create_task(
        _run_child(child, agent, user_prompt, tracker, parent_usage, run_kwargs),
        name=f"subagent-{child.name}",
    )
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        await _hand_over(child, task, tracker)
        raise
    except TaskCancelled as exc:
        await _propagate(parent, child, exc)
        raise


def run_subagent_sync(
    agent: AbstractAgent[Any, Any],
    user_prompt: Any = None,
    *,
    name: str | None = None,
    scope: TaskCancellation | None = None,
    parent_usage: RunUsage | None = None,
    **run_kwargs: Any,
) -> Any:
    """Run ``agent`` as a sub-agent from a thread (a sync tool): ``asyncio.run`` on this thread.

    Same child scope, cancellation and record as [`run_subagent`][]. A parent's cancel reaches
    the child's own event loop from the unwind thread; this returns or raises once the child has
    unwound (its run ended), so no work is left on this thread. A child cancelled on its own
    cancels the parent scope and raises [`TaskCancelled`][] after the parent run was told to
    stop, so the exception cannot be taken for a tool error. Let it propagate.
    """
    parent = scope if scope is not None else current_cancellation()
    child = _child_scope(parent, name or _agent_name(agent))
    try:
        return asyncio.run(_run_child(child, agent, user_prompt, RunTracker(child), parent_usage, run_kwargs))
    except TaskCancelled as exc:
        if parent is not None:
            _cancel_parent(parent, child, exc)
            parent.wait(parent.remaining())
        raise


def _child_scope(parent: TaskCancellation | None, name: str) -> TaskCancellation:
    """A child of ``parent`` (born cancelled if the parent already is), or a scope of its own."""
    if parent is None:
        return TaskCancellation(name)
    return parent.child(name)


async def _run_child(
    child: TaskCancellation,
    agent: AbstractAgent[Any, Any],
    user_prompt: Any,
    tracker: RunTracker,
    parent_usage: RunUsage | None,
    run_kwargs: dict[str, Any],
) -> Any:
    """The child's run; whatever way it ends, its transcript and usage go on its record.

    The delegation owns the child scope, so it settles it: ``COMPLETED`` only if neither the
    child nor any ancestor was cancelled by then, else the result is discarded as cancelled.
    """
    try:
        result = await run_agent_in_scope_async(child, agent, user_prompt, tracker=tracker, **run_kwargs)
    except TaskCancelled as exc:
        child.settle(Outcome.CANCELLED)
        _attach_run(child, exc.all_messages(), exc.usage, parent_usage)
        raise
    except Exception:
        child.settle(Outcome.FAILED)
        raise
    _attach_run(child, result.all_messages(), result.usage, parent_usage)
    if child.settle(Outcome.COMPLETED) is not Outcome.COMPLETED:
        child.record("result_discarded", reason="cancelled before the delegation accepted the result")
        raise await asyncio.to_thread(
            child.cancelled_error, "cancelled after its result arrived; it is discarded", source=result
        )
    return result


async def _hand_over(child: TaskCancellation, task: asyncio.Task[Any], tracker: RunTracker) -> None:
    """The delegating tool was cancelled: stop the child's in-flight work, then let it tear down.

    Waiting for the child's *in-flight* work keeps the order (work stops before the parent's
    toolsets tear down); not waiting for the child's *teardown* keeps depth from adding up: a
    run of ours around this tool awaits it after its own teardown. Without one, the whole child
    is awaited. Either wait lasts through repeated cancels, within the child's budget, and then
    raises the cancel it absorbed (the caller re-raises its own if there was none).
    """
    child.cancel(CancelCause.PARENT, detail="the delegating tool was cancelled")
    task.add_done_callback(_retrieve)
    holder = current_run_tracker()
    awaited: list[asyncio.Future[Any]] = [task]
    if holder is not None:
        awaited.append(asyncio.ensure_future(tracker.in_flight_stopped.wait()))
    first_done = asyncio.wait(awaited, return_when=asyncio.FIRST_COMPLETED)
    try:
        await wait_shielded(first_done, f"sub-agent {child.name!r}'s hand-over", timeout=child.remaining())
    finally:
        for future in awaited[1:]:
            future.cancel()
        if holder is not None and not task.done():
            child.record("teardown_handed_to_parent")
            holder.linger(task)


async def _propagate(parent: TaskCancellation | None, child: TaskCancellation, exc: TaskCancelled) -> None:
    """The child was cancelled while this tool was not: stop the parent too, as cancellation.

    With a run of ours around this tool, wait (within the budget) to be cancelled by it, so the
    tool ends with ``CancelledError``, which no capability or retry logic can turn into a result.
    """
    if parent is None or current_run_tracker() is None:
        return
    _cancel_parent(parent, child, exc)
    never = asyncio.get_running_loop().create_future()
    try:
        await asyncio.wait([never], timeout=parent.remaining())
    finally:
        never.cancel()


def _cancel_parent(parent: TaskCancellation, child: TaskCancellation, exc: TaskCancelled) -> None:
    if not parent.cancelled:
        parent.cancel(exc.cause, detail=f"sub-agent {child.name!r} was cancelled ({exc.cause.value})")


def _retrieve(task: asyncio.Task[Any]) -> None:
    """Mark a handed-over child's outcome as seen (it is on the child's record already)."""
    if not task.cancelled():
        task.exception()


# -- the record ---------------------------------------------------------------------------


def _attach_run(
    child: TaskCancellation,
    messages: list[ModelMessage],
    usage: RunUsage | None,
    parent_usage: RunUsage | None,
) -> None:
    if usage is not None and parent_usage is not None and parent_usage is not usage:
        parent_usage.incr(usage)
    child.attach(messages=len(messages), usage=usage_dict(usage), transcript=_transcript(messages))


def _transcript(messages: list[ModelMessage]) -> list[Any]:
    try:
        return list(ModelMessagesTypeAdapter.dump_python(messages, mode="json"))
    except Exception as exc:  # a record must never fail the unwind
        log.warning("could not serialise a sub-agent transcript: %r", exc)
        return []


# -- helpers ------------------------------------------------------------------------------


def _agent_name(agent: AbstractAgent[Any, Any]) -> str:
    return getattr(agent, "name", None) or "subagent"


def _with_fallback_model(sub: Subagent, parent_model: Any) -> dict[str, Any]:
    """A sub-agent built without a model (``Agent(None, ...)``) runs on its parent's, so it can
    use the task's connection instead of needing one of its own."""
    kwargs = _run_kwargs(sub)
    if parent_model is not None and getattr(sub.the_agent(), "model", None) is None and "model" not in kwargs:
        kwargs["model"] = parent_model
    return kwargs


def _run_kwargs(sub: Subagent) -> dict[str, Any]:
    """Keyword arguments for the child's run."""
    kwargs = dict(sub.run_kwargs)
    if sub.stream:
        kwargs.setdefault("event_stream_handler", _drain_events)
    return kwargs


def _as_text(output: Any) -> str:
    if isinstance(output, str):
        return output
    dump = getattr(output, "model_dump", None)
    return json.dumps(dump(mode="json") if callable(dump) else output, default=str)


async def _drain_events(ctx: Any, events: Any) -> None:
    """Passing an event handler makes pydantic-ai stream the model response."""
    async for _ in events:
        pass
