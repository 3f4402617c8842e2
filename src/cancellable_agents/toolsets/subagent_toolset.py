"""How a DAG file describes delegation to sub-agents: [`Subagent`][] and [`SubagentToolset`][].

Light on purpose (a DAG file imports this on every parse): no pydantic-ai here. A sub-agent is a
pydantic-ai agent you built (then your DAG file chose that import), or a description of one
(``model``, ``instructions``, ``tools``, ``toolsets``) that becomes an ``Agent`` when the task
runs. [`SubagentToolset`][] is a light description too; the toolset that runs the children is
[`cancellable_agents.toolsets.subagent_tools.SubagentTools`][].
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from cancellable_agents.core.exceptions import ConfigurationError
from cancellable_agents.toolsets._toolset_description import ToolsetDescription, built

if TYPE_CHECKING:
    from pydantic_ai.agent import AbstractAgent

__all__ = ["Subagent", "SubagentToolset"]


@dataclass(frozen=True)
class Subagent:
    """One named sub-agent of a [`SubagentToolset`][].

    :param name: what the model passes as ``agent`` (also the child scope's name in the record).
    :param agent: any pydantic-ai agent (with its own tools, toolsets, model, instructions); or
        ``None``, and the sub-agent is described by ``model``, ``instructions``, ``tools`` and
        ``toolsets``, made into an ``Agent`` when the task runs (a DAG file then pays nothing).
    :param description: when to use it; shown to the model in the tool description.
    :param stream: request streamed model responses (a cancel then closes a live stream).
    :param run_kwargs: extra arguments for ``agent.run`` (``model_settings``, ``usage_limits``,
        ``deps``, ``timeout`` ...). A ``timeout`` here is the child's own deadline: when it
        passes, the child ends as ``TIMEOUT`` and, like any child cancellation, stops the parent.
    :param model: a described sub-agent's pydantic-ai model id (``"openai:gpt-4o-mini"``);
        ``None``: its parent's model (the task's connection).
    :param instructions: a described sub-agent's instructions.
    :param tools: a described sub-agent's tools (functions or pydantic-ai ``Tool``\\ s).
    :param toolsets: a described sub-agent's toolsets (``SandboxToolset()`` and other descriptions
        are made when it is).
    """

    name: str
    agent: AbstractAgent[Any, Any] | None = None
    description: str = ""
    stream: bool = False
    run_kwargs: Mapping[str, Any] = field(default_factory=dict)
    model: str | None = None
    instructions: str = ""
    tools: Sequence[Any] = ()
    toolsets: Sequence[Any] = ()
    _made: list[Any] = field(default_factory=list, init=False, repr=False, compare=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False, compare=False)

    def the_agent(self) -> AbstractAgent[Any, Any]:
        """The pydantic-ai agent: the one given, or the described one (made once, when first run)."""
        if self.agent is not None:
            return self.agent
        with self._lock:
            if not self._made:
                from pydantic_ai import Agent

                made: AbstractAgent[Any, Any] = Agent(
                    self.model,
                    name=self.name,
                    instructions=self.instructions or None,
                    tools=list(self.tools),
                    toolsets=built(self.toolsets),
                )
                self._made.append(made)
            return self._made[0]

    def __deepcopy__(self, memo: dict[int, Any]) -> Subagent:
        """Shared, not copied, when Airflow copies an operator: a sub-agent holds no per-run state."""
        return self


class SubagentToolset(ToolsetDescription):
    """A ``delegate(agent, task) -> str`` tool that runs named sub-agents under child scopes.

    :param agents: ``{"name": agent}`` or a sequence of [`Subagent`][] (names must be unique).
    :param tool_name: the tool's name (default ``delegate``).
    :param threaded: drive each child from the tool's worker thread (``asyncio.run``) instead of
        awaiting it on the parent's loop. Both are cancelled the same way.
    :param id: the toolset id (pydantic-ai durable execution needs one).

    A light description: the toolset
    ([`SubagentTools`][cancellable_agents.toolsets.subagent_tools.SubagentTools]) is made when the
    task runs; ``Agent(toolsets=[SubagentToolset(...)])`` works as it is.
    Copying it (Airflow copies operators) shares the sub-agents, which hold no per-run state.
    """

    toolset_class = "cancellable_agents.toolsets.subagent_tools:SubagentTools"

    def __init__(
        self,
        agents: Mapping[str, AbstractAgent[Any, Any]] | Sequence[Subagent],
        *,
        tool_name: str = "delegate",
        threaded: bool = False,
        id: str | None = None,
    ) -> None:
        super().__init__(list(by_name(agents).values()), tool_name=tool_name, threaded=threaded, id=id)

    def __deepcopy__(self, memo: dict[int, Any]) -> SubagentToolset:
        return type(self)(*self._args, **self._kwargs)


def by_name(agents: Mapping[str, AbstractAgent[Any, Any]] | Sequence[Subagent]) -> dict[str, Subagent]:
    """The sub-agents by name, refusing none, duplicates and anything but [`Subagent`][]\\ s."""
    subs = (
        [Subagent(name, agent) for name, agent in agents.items()]
        if isinstance(agents, Mapping)
        else list(agents)
    )
    if not subs:
        raise ConfigurationError(
            "SubagentToolset needs at least one sub-agent, e.g. SubagentToolset({'helper': agent})."
        )
    found: dict[str, Subagent] = {}
    for sub in subs:
        if not isinstance(sub, Subagent):
            raise TypeError(f"expected Subagent(name, agent) items, got {sub!r}")
        if not sub.name or sub.name in found:
            raise ConfigurationError(
                f"sub-agent names must be unique and non-empty, got {sub.name!r} twice or empty"
            )
        found[sub.name] = sub
    return found
