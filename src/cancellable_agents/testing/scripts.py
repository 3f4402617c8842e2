"""What the scripted test model answers: the model-string grammar and the OpenAI JSON shapes.

The server ([`cancellable_agents.testing.openai_server`][]) chooses each answer by the request's
``model`` string; this module parses that string and plans the reply, without any HTTP.

Model-string grammar: ``NAME`` or ``NAME?k=v&k=v``. The part after the first ``?`` is parsed with
``urllib.parse.parse_qs``, so values are percent-decoded and ``+`` means a space. Build the string with
``urllib.parse.urlencode`` to be safe; unencoded values also work as long as they contain no ``&``, ``+``,
``%`` or ``#`` (so ``tool?name=add&args={"a":1,"b":2}`` is fine as written). Unknown parameters are rejected.

* ``echo``: answers ``echo: <text of the last user message>`` at once.
* ``slow?tokens=N&delay=S``: answers ``tok0 tok1 ... tok<N-1>``, sleeping ``S`` seconds before each token
  (streaming: one chunk per token; non-streaming: sleeps ``N*S`` in total, then answers).
  Defaults: ``tokens=50``, ``delay=0.1``.
* ``tool?name=TOOL&args=JSON&then=TEXT``: until the conversation holds a ``role: "tool"`` message, answers
  with one call of ``TOOL`` with arguments ``JSON`` (default ``{}``); afterwards answers ``TEXT``
  (default ``done``).
* ``tools?names=A,B&args=JSON&then=TEXT``: like ``tool`` but calls all named tools in one response
  (parallel tool calls), each with the same arguments.
* ``steps?name=TOOL&count=N&then=TEXT``: sequential tool calls: while the conversation holds fewer than
  ``N`` ``role: "tool"`` messages, answers with one call of ``TOOL`` with arguments ``{"n": k}`` (``k`` = tool
  messages so far + 1); afterwards answers ``TEXT``. ``N + 1`` requests in all for an uninterrupted run.
  With ``stall_at=K`` the response after ``K`` tool messages first streams ``tokens`` text tokens ``delay``
  apart (as ``slow``), but only the first time the server sees that conversation (its first user message)
  at that step: a retry of the request (a resumed run repeating its in-flight step) is answered at once.
  With ``reason=TEXT`` each response that calls the tool also says ``TEXT`` (the model's reason for it).
* ``loop?name=TOOL&then=TEXT&final_delay=S&stubborn=1&count=N``: keeps calling ``TOOL`` (arguments
  ``{"n": k}``, ``k`` = tool messages so far + 1) for as long as the request offers a tool named ``TOOL``;
  once it is offered none (a wound-down run's final request), answers ``TEXT (after K tool results)``
  (default ``TEXT``: ``final answer``), after sleeping ``final_delay`` seconds (default 0; more: a model
  too slow to answer in time). With ``stubborn=1`` it calls ``TOOL`` even when it is not offered (a model
  that ignores the wind-down); with ``count=N`` it answers on its own after ``N`` tool results.
* Every behaviour also takes ``delay_first=S``: sleep ``S`` seconds before sending anything (headers
  included), like a slow non-streaming model; and ``cost=USD``: each answer's usage reports that cost
  the way the Pydantic AI Gateway does (``usage.logfire_ai_gateway.cost``), so ``cost_limit`` applies.

Unknown names or bad parameters get a ``400`` OpenAI-style error listing the supported behaviours.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from dataclasses import dataclass, field, replace
from typing import Any
from urllib.parse import parse_qs

BEHAVIOURS: dict[str, str] = {
    "echo": "echo - answers 'echo: <last user message>'",
    "slow": "slow?tokens=N&delay=S - N tokens 'tok0 tok1 ...', S seconds before each (defaults 50, 0.1)",
    "tool": "tool?name=TOOL&args=JSON&then=TEXT - calls TOOL once, then answers TEXT (default 'done')",
    "tools": "tools?names=A,B&args=JSON&then=TEXT - calls all tools in parallel, then answers TEXT",
    "steps": "steps?name=TOOL&count=N&then=TEXT&stall_at=K&reason=TEXT - calls TOOL(n=k) for k = 1..N, "
    "one per response (saying reason), then TEXT; the first response after K tool results streams slowly "
    "(tokens, delay)",
    "loop": "loop?name=TOOL&then=TEXT&final_delay=S&stubborn=1 - calls TOOL(n=k) while TOOL is offered, "
    "then answers 'TEXT (after K tool results)' S seconds later; stubborn=1: calls TOOL even unoffered; "
    "count=N: answers on its own after N tool results",
}
"""Supported behaviour names and their usage; every behaviour also accepts ``delay_first=S``, ``cost=USD``."""

_COMMON = frozenset({"delay_first", "cost"})
_PARAMS: dict[str, frozenset[str]] = {
    "echo": _COMMON,
    "slow": frozenset({"tokens", "delay"}) | _COMMON,
    "tool": frozenset({"name", "args", "then"}) | _COMMON,
    "tools": frozenset({"names", "args", "then"}) | _COMMON,
    "steps": frozenset({"name", "count", "then", "stall_at", "tokens", "delay", "reason"}) | _COMMON,
    "loop": frozenset({"name", "then", "final_delay", "stubborn", "count"}) | _COMMON,
}


# --------------------------------------------------------------------------------------------------------
# Model-string grammar
# --------------------------------------------------------------------------------------------------------


class ScriptError(ValueError):
    """The ``model`` string names no supported behaviour or carries invalid parameters."""


@dataclass(frozen=True)
class Script:
    """A parsed model string: which behaviour to play and with which parameters."""

    behaviour: str
    tokens: int = 50
    delay: float = 0.1
    delay_first: float = 0.0
    tool_names: tuple[str, ...] = ()
    tool_args: str = "{}"
    then: str = "done"
    #: ``steps``: how many tool calls; ``loop``: after how many it answers on its own (``None``: never).
    count: int | None = 1
    #: ``steps``: the step whose first response stalls (streams ``tokens`` slowly); ``None``: none.
    stall_at: int | None = None
    #: ``steps``: what a response that calls the tool also says; empty: nothing.
    reason: str = ""
    #: Every behaviour: the cost each answer's usage reports (``None``: none).
    cost: float | None = None
    #: ``loop``: seconds before the answer given once the tool is no longer offered.
    final_delay: float = 0.0
    #: ``loop``: call the tool even when the request does not offer it.
    stubborn: bool = False


def parse_model(model: str) -> Script:
    """Parse ``NAME`` or ``NAME?k=v&k=v`` into a `Script`; raise `ScriptError` with a helpful message."""
    name, _, query = model.partition("?")
    if name not in _PARAMS:
        raise ScriptError(f"unknown behaviour {name!r} in model {model!r}; {supported()}")
    params = _parse_query(model, query)
    unknown = sorted(set(params) - _PARAMS[name])
    if unknown:
        allowed = ", ".join(sorted(_PARAMS[name]))
        raise ScriptError(f"unknown parameter(s) {unknown} for {name!r} (allowed: {allowed}); {supported()}")
    delay_first = _number(params, "delay_first", 0.0)
    if "cost" in params:
        return replace(_parse_behaviour(name, params, delay_first), cost=_number(params, "cost", 0.0))
    return _parse_behaviour(name, params, delay_first)


def _parse_behaviour(name: str, params: dict[str, str], delay_first: float) -> Script:
    if name == "loop":
        return Script(
            name,
            delay_first=delay_first,
            tool_names=_tool_names("tool", params),
            then=params.get("then", "final answer"),
            final_delay=_number(params, "final_delay", 0.0),
            stubborn=params.get("stubborn", "0") not in ("0", "", "false"),
            count=int(_number(params, "count", 0, integer=True)) if "count" in params else None,
        )
    if name == "slow":
        tokens = int(_number(params, "tokens", 50, integer=True))
        return Script(name, tokens=tokens, delay=_number(params, "delay", 0.1), delay_first=delay_first)
    if name == "steps":
        return Script(
            name,
            delay_first=delay_first,
            tool_names=_tool_names("tool", params),
            count=int(_number(params, "count", 1, integer=True)),
            then=params.get("then", "done"),
            stall_at=int(_number(params, "stall_at", 0, integer=True)) if "stall_at" in params else None,
            tokens=int(_number(params, "tokens", 50, integer=True)),
            delay=_number(params, "delay", 0.1),
            reason=params.get("reason", ""),
        )
    if name in ("tool", "tools"):
        return Script(
            name,
            delay_first=delay_first,
            tool_names=_tool_names(name, params),
            tool_args=_json_object(params.get("args", "{}")),
            then=params.get("then", "done"),
        )
    return Script(name, delay_first=delay_first)


def supported() -> str:
    return "supported behaviours: " + "; ".join(BEHAVIOURS.values()) + "; all accept delay_first=S"


def _parse_query(model: str, query: str) -> dict[str, str]:
    if not query:  # Python 3.10's strict parse_qs rejects an empty query
        return {}
    try:
        parsed = parse_qs(query, keep_blank_values=True, strict_parsing=True)
    except ValueError as exc:
        raise ScriptError(f"malformed parameters in model {model!r}: {exc}") from exc
    return {key: values[-1] for key, values in parsed.items()}


def _number(params: dict[str, str], key: str, default: float, *, integer: bool = False) -> float:
    if key not in params:
        return default
    try:
        value = int(params[key]) if integer else float(params[key])
    except ValueError as exc:
        kind = "an integer" if integer else "a number"
        raise ScriptError(f"parameter {key}={params[key]!r} must be {kind}") from exc
    if value < 0:
        raise ScriptError(f"parameter {key}={params[key]!r} must not be negative")
    return value


def _tool_names(behaviour: str, params: dict[str, str]) -> tuple[str, ...]:
    key = "name" if behaviour == "tool" else "names"
    names = tuple(part.strip() for part in params.get(key, "").split(",") if part.strip())
    if not names:
        raise ScriptError(f"behaviour {behaviour!r} needs a non-empty {key}= parameter")
    if behaviour == "tool" and len(names) > 1:
        raise ScriptError("behaviour 'tool' calls one tool; use 'tools?names=a,b' for several")
    return names


def _json_object(text: str) -> str:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ScriptError(f"parameter args={text!r} is not valid JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise ScriptError(f"parameter args={text!r} must be a JSON object")
    return json.dumps(value)


# --------------------------------------------------------------------------------------------------------
# What to answer
# --------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str


@dataclass(frozen=True)
class Reply:
    """An answer to send: text pieces (each one streamed chunk and one token) or tool calls."""

    pieces: tuple[str, ...] = ()
    piece_delay: float = 0.0
    tool_calls: tuple[ToolCall, ...] = ()
    #: Seconds to think before the answer starts (headers already sent when streaming).
    wait_first: float = 0.0

    @property
    def finish_reason(self) -> str:
        return "tool_calls" if self.tool_calls else "stop"

    @property
    def completion_tokens(self) -> int:
        return len(self.tool_calls) if self.tool_calls else len(self.pieces)


def plan_reply(
    script: Script, messages: list[dict[str, Any]], *, repeated: bool = False, offered: tuple[str, ...] = ()
) -> Reply:
    """Decide the answer for ``script`` given the conversation so far (``repeated``: the server
    already saw this conversation at this step; ``offered``: the names of the tools the request
    offers)."""
    if script.behaviour == "loop":
        done = sum(message.get("role") == "tool" for message in messages)
        tool = script.tool_names[0]
        if script.count is not None and done >= script.count:
            return Reply(pieces=_split_tokens(f"{script.then} (after {done} tool results)"))
        if tool in offered or script.stubborn:
            return Reply(
                tool_calls=(ToolCall(f"call_{uuid.uuid4().hex[:24]}", tool, json.dumps({"n": done + 1})),)
            )
        return Reply(
            pieces=_split_tokens(f"{script.then} (after {done} tool results)"), wait_first=script.final_delay
        )
    if script.behaviour == "echo":
        return Reply(pieces=_split_tokens("echo: " + _last_user_text(messages)))
    if script.behaviour == "slow":
        return Reply(pieces=_slow_pieces(script.tokens), piece_delay=script.delay)
    if script.behaviour == "steps":
        done = sum(message.get("role") == "tool" for message in messages)
        if done >= (script.count or 0):
            return Reply(pieces=_split_tokens(script.then))
        call = ToolCall(f"call_{uuid.uuid4().hex[:24]}", script.tool_names[0], json.dumps({"n": done + 1}))
        if done == script.stall_at and not repeated:
            return Reply(pieces=_slow_pieces(script.tokens), piece_delay=script.delay, tool_calls=(call,))
        return Reply(pieces=_split_tokens(script.reason) if script.reason else (), tool_calls=(call,))
    if any(message.get("role") == "tool" for message in messages):
        return Reply(pieces=_split_tokens(script.then))
    calls = tuple(
        ToolCall(f"call_{uuid.uuid4().hex[:24]}", name, script.tool_args) for name in script.tool_names
    )
    return Reply(tool_calls=calls)


def _slow_pieces(tokens: int) -> tuple[str, ...]:
    return tuple(f"tok{i}" if i == 0 else f" tok{i}" for i in range(tokens))


def step_key(model: str, messages: list[dict[str, Any]]) -> tuple[str, str, int]:
    """A conversation at one step: its model, first user message and tool results so far."""
    first_user = next((message_text(m) for m in messages if m.get("role") == "user"), "")
    return model, first_user, sum(m.get("role") == "tool" for m in messages)


def _split_tokens(text: str) -> tuple[str, ...]:
    """Split text into word tokens that keep their leading whitespace, so ``"".join`` restores it."""
    return tuple(re.findall(r"\s*\S+|\s+$", text))


def message_text(message: dict[str, Any]) -> str:
    content = message.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(str(part.get("text", "")) for part in content if isinstance(part, dict))
    return ""


def _last_user_text(messages: list[dict[str, Any]]) -> str:
    for message in reversed(messages):
        if message.get("role") == "user":
            return message_text(message)
    return ""


@dataclass(frozen=True)
class Completion:
    """Identity of one completion, and the OpenAI JSON shapes built from it."""

    model: str
    prompt_tokens: int
    #: The cost each answer's usage reports, as the Pydantic AI Gateway does; ``None``: none.
    cost: float | None = None
    id: str = field(default_factory=lambda: f"chatcmpl-{uuid.uuid4().hex[:24]}")
    created: int = field(default_factory=lambda: int(time.time()))

    def usage(self, completion_tokens: int) -> dict[str, Any]:
        usage: dict[str, Any] = {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": self.prompt_tokens + completion_tokens,
        }
        if self.cost is not None:
            usage["logfire_ai_gateway"] = {"cost": str(self.cost)}
        return usage

    def body(self, reply: Reply) -> dict[str, Any]:
        """A complete ``chat.completion`` object for ``reply``."""
        message: dict[str, Any] = {"role": "assistant", "content": None, "refusal": None}
        if reply.tool_calls:
            message["tool_calls"] = [_tool_call_json(call) for call in reply.tool_calls]
            message["content"] = "".join(reply.pieces) or None  # what the model said beside its calls
        else:
            message["content"] = "".join(reply.pieces)
        choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": reply.finish_reason}
        return {
            **self._header("chat.completion"),
            "choices": [choice],
            "usage": self.usage(reply.completion_tokens),
        }

    def chunk(self, delta: dict[str, Any], finish_reason: str | None = None) -> dict[str, Any]:
        """A ``chat.completion.chunk`` carrying ``delta`` (and ``finish_reason`` on the last one)."""
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        return {**self._header("chat.completion.chunk"), "choices": [choice]}

    def usage_chunk(self, completion_tokens: int) -> dict[str, Any]:
        """The trailing usage-only chunk OpenAI sends when ``stream_options.include_usage`` is set."""
        return {
            **self._header("chat.completion.chunk"),
            "choices": [],
            "usage": self.usage(completion_tokens),
        }

    def _header(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}


def _tool_call_json(call: ToolCall) -> dict[str, Any]:
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


def error_json(message: str, code: str, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": "invalid_request_error", "param": param, "code": code}}
