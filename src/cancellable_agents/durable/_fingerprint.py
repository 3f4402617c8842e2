"""What makes a run this run: the fingerprint a record is kept under, and what the run's
toolsets say about themselves.

A record is resumed only by a run with the same fingerprint (prompt, history given, system
prompt, instructions, model, tool names): anything else starts fresh.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable, Iterator
from typing import Any


def canonical(value: Any) -> str:
    """``value`` as JSON in one spelling (sorted keys, no spaces): what gets hashed (here and in
    the record's hash chain)."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), default=str)


#: The class attribute by which a toolset says whether what its tools wrote is still there on
#: the task's next try. ``False`` (a sandbox's workspace): a resumed run is told it is gone, or
#: the model would read files that no longer exist. Absent: it survives (nothing to tell).
WORKSPACE_SURVIVES_A_RETRY = "workspace_survives_a_retry"


def fingerprint(agent: Any, user_prompt: Any, run_kwargs: dict[str, Any]) -> str:
    """A hash of what makes a run this run: prompt, history given, system prompt, instructions,
    model and tool names. Dynamic (function) system prompts count by name, not by what they say."""
    facts = {
        "prompt": _jsonable(user_prompt),
        "history": len(run_kwargs.get("message_history") or ()),
        "system_prompt": [str(p) for p in getattr(agent, "_system_prompts", ())],
        "dynamic_system_prompt": [_name(f) for f in getattr(agent, "_system_prompt_functions", ())],
        "instructions": [_jsonable(getattr(i, "instruction", i)) for i in getattr(agent, "_instructions", ())]
        + [_jsonable(run_kwargs.get("instructions"))],
        "model": model_name(run_kwargs.get("model") or getattr(agent, "model", None)),
        "tools": sorted(tool_names(run_toolsets(agent, run_kwargs))),
    }
    return hashlib.sha256(canonical(facts).encode()).hexdigest()[:32]


def run_toolsets(agent: Any, run_kwargs: dict[str, Any]) -> list[Any]:
    """The toolsets a run has: the agent's and those given to the run."""
    return [*getattr(agent, "toolsets", ()), *(run_kwargs.get("toolsets") or ())]


def model_name(model: Any) -> str:
    """A model as ``system:name`` (a string model as itself)."""
    if model is None or isinstance(model, str):
        return str(model)
    return f"{getattr(model, 'system', '')}:{getattr(model, 'model_name', type(model).__name__)}"


def tool_names(toolsets: Iterable[Any]) -> list[str]:
    """Names of the tools of ``toolsets`` (function toolsets by tool, others by label), walking
    wrapper and combined toolsets."""
    names: list[str] = []
    for toolset in toolsets:
        names.extend(_toolset_names(toolset))
    return names


def workspace_lost_on_retry(toolsets: Iterable[Any]) -> bool:
    """Whether any of ``toolsets`` (walked) says its workspace does not survive a retry
    (`WORKSPACE_SURVIVES_A_RETRY` is ``False``)."""
    return any(getattr(t, WORKSPACE_SURVIVES_A_RETRY, True) is False for t in walk_toolsets(toolsets))


def walk_toolsets(toolsets: Iterable[Any]) -> Iterator[Any]:
    """Every toolset of ``toolsets`` and, depth first, those it wraps or combines.

    A light description ([`cancellable_agents.toolsets._toolset_description`][]) is a leaf: its toolset
    is made when the task runs, and asking it for its parts would make it here, at parse time.
    """
    for toolset in toolsets:
        yield toolset
        if is_description(toolset):
            continue
        made_by = getattr(toolset, "toolset_func", None)  # an Agent given a description directly
        if is_description(made_by):
            yield from walk_toolsets([made_by])
        wrapped = getattr(toolset, "wrapped", None)
        if wrapped is not None:
            yield from walk_toolsets([wrapped])
        inner = getattr(toolset, "toolsets", None)
        if isinstance(inner, (list, tuple)):
            yield from walk_toolsets(inner)


def _toolset_names(toolset: Any) -> list[str]:
    names: list[str] = []
    for item in walk_toolsets([toolset]):
        tools = getattr(item, "tools", None)
        if isinstance(tools, dict):
            names.extend(str(name) for name in tools)
        elif not hasattr(item, "wrapped") and not hasattr(item, "toolsets"):
            names.append(f"toolset:{_leaf_label(item)}")
    return names


def _leaf_label(toolset: Any) -> str:
    """A leaf toolset's label, the same in every process: without an ``id``, pydantic-ai labels an
    MCP toolset by its client's ``repr`` (a memory address), so a stored run could never match
    again; its transport (command and arguments, or URL) names it instead. Any other address in a
    label is dropped."""
    label = str(getattr(toolset, "label", type(toolset).__name__))
    transport = getattr(getattr(toolset, "client", None), "transport", None)
    if getattr(toolset, "id", None) is None and transport is not None:
        label = f"{type(toolset).__name__}({transport!r})"
    return re.sub(r" at 0x[0-9a-fA-F]+", "", label)


def _name(fn: Any) -> str:
    fn = getattr(fn, "function", fn)
    return f"{getattr(fn, '__module__', '')}.{getattr(fn, '__qualname__', repr(fn))}"


def _jsonable(value: Any) -> Any:
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return repr(value)
    return value


def tools_requiring_approval(
    tools: Iterable[Any] = (), toolsets: Iterable[Any] = (), agent: Any = None
) -> list[str]:
    """Names of the tools (plain ``Tool`` objects, an agent's, or in toolsets) that require
    approval (at DAG parse time, and before a durable run: it must be able to stop there). A
    toolset that decides per call at run time (``ApprovalRequiredToolset``) counts by its class
    name."""
    found: list[str] = []
    all_toolsets = [*toolsets, *(getattr(agent, "toolsets", ()) if agent is not None else ())]
    for tool in [*tools, *_toolset_tools(all_toolsets)]:
        if getattr(tool, "requires_approval", False):
            found.append(str(getattr(tool, "name", tool)))
    if any(not is_description(t) for t in all_toolsets):  # pydantic-ai's: loaded already
        from pydantic_ai.toolsets import ApprovalRequiredToolset

        found += [
            type(t).__name__ for t in walk_toolsets(all_toolsets) if isinstance(t, ApprovalRequiredToolset)
        ]
    return found


def is_description(toolset: Any) -> bool:
    """Whether ``toolset`` is a light description of one (it names the class it makes)."""
    return hasattr(type(toolset), "toolset_class")


def _toolset_tools(toolsets: Iterable[Any]) -> Iterator[Any]:
    for toolset in walk_toolsets(toolsets):
        if is_description(toolset):
            continue  # the toolsets described here (sandbox, sub-agents) require no approval
        tools = getattr(toolset, "tools", None)
        if isinstance(tools, dict):
            yield from tools.values()
