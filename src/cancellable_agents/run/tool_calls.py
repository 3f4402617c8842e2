"""Idempotency keys: what a tool call with a side effect (a charge, a message, a ticket) sends along
so that the system it calls can recognise a re-run of it and not do it twice.

A durable run never repeats a completed step, but a tool call cut by a kill runs again on the next
try (at-least-once). The key is how that re-run is recognised: the same logical call carries the
same key in every try, and any other call carries another one. Like a Temporal activity id or a
Stripe ``Idempotency-Key``, it is derived, never drawn from the clock or random state, so the next
try (another process) derives it again without having stored it.

What "the same logical call" is, and therefore what goes into the key ([`derive_key`][]):

- **Who runs it**: the task instance ``(dag_id, task_id, run_id, map_index)``, and which agent run
  of its ``execute`` (the run key, the order of ``run_agent_sync`` calls, which is also the key of
  a durable run's record). Another task instance, map index or run never shares a key.
- **Which transcript it belongs to**: the try whose run the record began in (``origin_try``). A
  resumed durable run continues its record, so its calls keep the keys they had; a try that
  starts fresh (no record, a user's Clear, a changed prompt) begins a new transcript whose calls
  are new calls, even where the model repeats a tool call id (some providers number their calls
  ``call_0``, ``call_1`` in every response). A run without ``durable=True`` starts fresh on every
  try: its keys are stable within the try and new on a retry, which is right, since a retry asks
  the model again and its calls may differ.
- **Where in the transcript**: the index of the model response that made the call among the run's
  messages (``step``), and the call's ``tool_call_id`` within that response (two calls of one
  response differ by their ids). A response in the record is replayed unchanged to the next try,
  with its ids, at the same index: a call re-run after a kill derives the key of the call that was
  cut.

The edge, stated honestly: a step's response is appended to the record while its tools run
(``write_ahead=True``: before they start). A SIGKILL that lands after a tool started but before
its response was stored leaves the step unrecorded: the next try asks the model again, gets a new
response with new ids, and its call gets a new key (and ``is_rerun`` is ``False``). Only
``write_ahead=True`` closes that window.

Light: no pydantic-ai. The key of the call in progress is set by the run's toolset wrapper
([`cancellable_agents.run._tracker`][]) and read here by tools, sandbox commands (the environment
variable `IDEMPOTENCY_KEY_ENV`) and HTTP clients ([`idempotency_headers`][]); a call to an
MCP server's tool carries it in the request's ``_meta`` under `IDEMPOTENCY_META_KEY`
([`cancellable_agents.run._mcp_servers.carry_idempotency_keys`][]).
"""

from __future__ import annotations

import contextvars
import hashlib
from dataclasses import dataclass, replace

from cancellable_agents.durable._fingerprint import canonical

__all__ = [
    "IDEMPOTENCY_HEADER",
    "IDEMPOTENCY_KEY_ENV",
    "IDEMPOTENCY_META_KEY",
    "ToolCall",
    "current_tool_call",
    "idempotency_headers",
]

#: The environment variable a sandbox command gets the key of its tool call in.
IDEMPOTENCY_KEY_ENV = "CANCELLABLE_AGENTS_IDEMPOTENCY_KEY"
#: The HTTP header `idempotency_headers` sets (the name Stripe and the IETF draft use).
IDEMPOTENCY_HEADER = "Idempotency-Key"
#: The ``_meta`` key of an MCP ``tools/call`` request that carries the call's key (a prefixed name,
#: as the MCP spec asks of names that are not its own).
IDEMPOTENCY_META_KEY = "cancellable-agents/idempotency-key"
#: Changes every key when the derivation changes (a new version must never reuse an old key).
_KEY_VERSION = "ca-idempotency-1"


@dataclass(frozen=True)
class RunIdentity:
    """Who an agent run is, for the keys of its tool calls.

    ``task``: ``(dag_id, task_id, run_id, map_index)``, ``None`` outside Airflow. ``run_key``: which
    run of the task's ``execute``. ``origin_try``: the try whose run began the transcript (a
    resumed durable run's record's first try; else this try). ``durable``: the run keeps a record.
    ``parent``: the key of the tool call a sub-agent runs in (its calls are that call's parts).
    """

    task: tuple[str, str, str, int] | None = None
    run_key: str = "0"
    origin_try: int = 0
    durable: bool = False
    parent: str = ""

    def durable_run(self, run_key: str, origin_try: int) -> RunIdentity:
        """This identity for the durable run ``run_key`` whose transcript began in ``origin_try``."""
        return replace(self, run_key=run_key, origin_try=origin_try, durable=True)


@dataclass(frozen=True)
class ToolCall:
    """The tool call this code runs in: what a tool needs to make its side effect idempotent.

    ``idempotency_key``: the same for the same logical call in every try (see the module);
    ``is_rerun``: the call already ran in an earlier try that was stopped while it ran (it was in
    flight: the earlier try's effect may or may not have happened); ``step``: the index of the
    model response that made the call among the run's messages.
    """

    tool_name: str
    tool_call_id: str
    step: int
    idempotency_key: str
    is_rerun: bool = False

    def headers(self) -> dict[str, str]:
        """``{"Idempotency-Key": key}``: the header for an HTTP request this call makes."""
        return {IDEMPOTENCY_HEADER: self.idempotency_key}

    def env(self) -> dict[str, str]:
        """``{IDEMPOTENCY_KEY_ENV: key}``: the environment a command this call starts gets."""
        return {IDEMPOTENCY_KEY_ENV: self.idempotency_key}


def derive_key(identity: RunIdentity, step: int, tool_call_id: str) -> str:
    """The idempotency key of the call ``tool_call_id`` of the response at ``step`` in the run
    ``identity``: 32 hex digits of a SHA-256 over all of them (a pure function: every try derives
    the same key from the same facts)."""
    task = identity.task or ("", "", "", -1)
    facts = [
        _KEY_VERSION,
        list(task),
        identity.run_key,
        identity.origin_try,
        identity.durable,
        identity.parent,
        step,
        tool_call_id,
    ]
    return hashlib.sha256(canonical(facts).encode()).hexdigest()[:32]


#: The tool call this context runs in (set by the run's toolset wrapper for each call).
active_tool_call: contextvars.ContextVar[ToolCall | None] = contextvars.ContextVar(
    "cancellable_agents_tool_call", default=None
)


def run_identity(given: RunIdentity | None) -> RunIdentity:
    """The identity of a run about to start: ``given``, else that of a sub-agent of the tool call
    this code runs in (its calls are parts of that call), else an anonymous one (outside Airflow:
    keys unique within the run only)."""
    if given is not None:
        return given
    parent = active_tool_call.get()
    return RunIdentity(parent=parent.idempotency_key) if parent is not None else RunIdentity()


def current_tool_call() -> ToolCall | None:
    """The [`ToolCall`][] this code runs in, or ``None`` outside a tool call of a run under a
    scope. Usable from async and sync tools, and from what they call."""
    return active_tool_call.get()


def idempotency_headers() -> dict[str, str]:
    """``{"Idempotency-Key": key}`` of the tool call this code runs in, for an HTTP request with a
    side effect; ``{}`` outside a tool call (the request then goes without one, as before)."""
    call = active_tool_call.get()
    return call.headers() if call is not None else {}
