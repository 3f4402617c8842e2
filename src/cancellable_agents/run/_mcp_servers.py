"""MCP stdio servers a run started, closed the protocol's way when its scope is cancelled.

An MCP toolset over stdio (pydantic-ai's ``MCPToolset(StdioTransport(...))``, any client built on
the ``mcp`` SDK's ``stdio_client``) runs its server as a child of the task process, in a session
of its own (``start_new_session=True``: Airflow's group kill misses it). Left alone on a kill:

- the transport keeps the server alive by default (fastmcp's ``keep_alive=True``): leaving the
  toolset does not close it, so it lives until the task process exits;
- the SDK's own shutdown waits 2 s after closing stdin and 2 s after SIGTERM before SIGKILL,
  more than Airflow's grace;
- the descendant reaper (a ``Phase.TEARDOWN`` resource) SIGTERMs it milliseconds after the kill,
  before its in-flight tool has handled the client's ``notifications/cancelled``.

So each server the ``mcp`` SDK spawns inside a run is registered with the run's scope as a
``Phase.SERVERS`` resource ([`watch_spawns`][] hooks the SDK's spawn function). On a cancel the
scope first cancels in-flight tool calls (``Phase.IN_FLIGHT``: the SDK sends
``notifications/cancelled`` as each call's task is cancelled), then [`StdioServer.close`][]
runs the MCP shutdown sequence within the budget: wait for the run's tool tasks to end, close the
server's stdin, wait (`STDIN_GRACE`, less if the budget is short) for it to exit, then stop
whatever is left of its process group, its process tree and its environment tag (SIGTERM,
`TERM_GRACE`, SIGKILL). The tag (`SERVER_TAG`, set in the environment the server is
spawned with) is inherited by everything its tools start, so a ``setsid`` grandchild whose parent
exited, out of the group and the tree, is still found; only a process that drops its environment
(``env -i``) escapes it, and is left to ``Phase.TEARDOWN`` (the reaper), which runs after. The
same happens with ``reap_descendants=False``, the reaper's part aside. A server spawned after the
cancel (one still starting) is registered late and so closed at once. A server that has not yet
answered the handshake (nothing read from its stdout: it has not read its stdin either) has no
session to close and would not notice its stdin closing: it is stopped at once, without the
`STDIN_GRACE` wait (``booting`` on its ``mcp_server_closed`` event).

Each server's outcome is on the scope's timeline (``mcp_server_closed``: how it ended, ms) and
what had to be killed in its ``killed`` list (source ``mcp_stdio``). Remote servers (streamable
HTTP) need nothing here: the SDK aborts or cancels the call and ends the session itself.

Every MCP tool call of a run also carries its idempotency key ([`cancellable_agents.run.tool_calls`][])
in the request's ``_meta`` ([`carry_idempotency_keys`][]), so a server can recognise a call that
a resumed try runs again. Airflow-free.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import os
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from cancellable_agents.core.scope import Phase, TaskCancellation, current_cancellation
from cancellable_agents.core.timeline import KillRecord
from cancellable_agents.procs._proc import (
    ProcKey,
    all_pids,
    command_line,
    environ_contains,
    is_running,
    read_proc,
    terminate,
    wait_gone,
    wait_until,
    walk_descendants,
)
from cancellable_agents.run.tool_calls import IDEMPOTENCY_META_KEY, current_tool_call

log = logging.getLogger(__name__)


class RunTracker(Protocol):
    """What a server needs of the run that spawned it
    ([`RunTracker`][cancellable_agents.run._tracker.RunTracker] is one; a protocol, as the
    tracker imports this module)."""

    scope: TaskCancellation
    lock: threading.Lock
    tool_tasks: set[asyncio.Task[Any]]
    stdio_servers: list[Any]


#: How long a server gets to exit on its own once its stdin is closed (the spec's first wait).
#: Long enough for a tool's cleanup on cancel (the SDK server cancels every handler on stdin EOF
#: and exits when they end); the SDK's own 2 s would leave too little of Airflow's 5 s grace.
STDIN_GRACE = 1.5
#: Between SIGTERM and SIGKILL of what is left of the server's process group and tree.
TERM_GRACE = 0.5
#: How long to wait for a SIGKILLed process to be gone.
KILL_WAIT = 0.3
#: The environment variable each stdio server is spawned with (a value of its own): what its
#: tools start inherits it, so a process that left the server's group and tree is still its.
SERVER_TAG = "CANCELLABLE_AGENTS_MCP_SERVER"

#: The tracker of the run whose toolsets are being entered (a server spawned there is the run's).
_entering: contextvars.ContextVar[RunTracker | None] = contextvars.ContextVar(
    "cancellable_agents_mcp_entering", default=None
)
_hook_lock = threading.Lock()
_HOOKED = "_cancellable_agents_spawn_hook"
_KEYED = "_cancellable_agents_keyed"


def carry_idempotency_keys(toolset: Any) -> None:
    """Make every pydantic-ai ``MCPToolset`` in ``toolset``'s tree send each tool call's
    idempotency key in the request's ``_meta`` (``{IDEMPOTENCY_META_KEY: key}``). Idempotent.

    Through the toolset's documented hook, ``process_tool_call`` (its call function takes
    ``metadata=``, the request's ``_meta``): a hook the author set is kept and called with a call
    function that adds the key, and ``_meta`` the hook passes wins over ours. Outside a run's
    tool call (no key) the call goes as before. A no-op where pydantic-ai's MCP module is not loaded.
    """
    module = sys.modules.get("pydantic_ai.mcp")
    toolset_type = getattr(module, "MCPToolset", None)
    if toolset_type is None:
        return

    def visit(leaf: Any) -> None:
        if isinstance(leaf, toolset_type) and not getattr(leaf.process_tool_call, _KEYED, False):
            leaf.process_tool_call = _keyed(leaf.process_tool_call)

    toolset.apply(visit)


def _keyed(inner: Any) -> Any:
    """``process_tool_call`` that puts the call's key into ``_meta``, then defers to ``inner``."""

    async def process_tool_call(ctx: Any, call_tool: Any, name: str, args: dict[str, Any]) -> Any:
        call = current_tool_call()
        send = call_tool if call is None else _with_key(call_tool, call.idempotency_key)
        if inner is None:
            return await send(name, args)
        return await inner(ctx, send, name, args)

    setattr(process_tool_call, _KEYED, True)
    return process_tool_call


def _with_key(call_tool: Any, key: str) -> Any:
    """``call_tool`` with ``key`` added to the request's ``_meta``."""

    async def send(name: str, args: dict[str, Any], *, metadata: Any = None, **kwargs: Any) -> Any:
        return await call_tool(name, args, metadata={IDEMPOTENCY_META_KEY: key, **(metadata or {})}, **kwargs)

    return send


@contextlib.contextmanager
def entering(tracker: RunTracker) -> Iterator[None]:
    """Around a run's toolsets' ``__aenter__``: stdio servers spawned inside belong to the run.

    Hooks the SDK's spawn function first if the ``mcp`` SDK's stdio client is loaded (a run
    without MCP toolsets never imports it, and pays nothing).
    """
    if "mcp.client.stdio" in sys.modules:
        watch_spawns()
    token = _entering.set(tracker)
    try:
        yield
    finally:
        _entering.reset(token)


def watch_spawns() -> bool:
    """Wrap ``mcp.client.stdio._create_platform_compatible_process`` (idempotent); return whether
    spawns are watched.

    The SDK spawns every stdio server through that one function and exposes the process nowhere
    else (fastmcp keeps it inside a task); the wrapper only notes what it returns. An SDK without
    the function (renamed) is left alone, and its servers are stopped by the reaper as before.
    """
    try:
        from mcp.client import stdio
    except ImportError:
        return False
    with _hook_lock:
        spawn = getattr(stdio, "_create_platform_compatible_process", None)
        if spawn is None:
            return False
        if getattr(spawn, _HOOKED, False):
            return True

        async def spawn_watched(*args: Any, **kwargs: Any) -> Any:
            tag = uuid.uuid4().hex
            args, kwargs = _with_tag(args, kwargs, tag)
            process = await spawn(*args, **kwargs)
            _spawned(process, f"{SERVER_TAG}={tag}".encode())
            return process

        setattr(spawn_watched, _HOOKED, True)
        stdio._create_platform_compatible_process = spawn_watched  # type: ignore[attr-defined]
        return True


SpawnArguments = tuple[tuple[Any, ...], dict[str, Any]]


def _with_tag(args: tuple[Any, ...], kwargs: dict[str, Any], tag: str) -> SpawnArguments:
    """The spawn's arguments with `SERVER_TAG` added to its ``env`` (the third argument)."""

    def tagged(env: dict[str, str] | None) -> dict[str, str]:
        return {**(os.environ if env is None else env), SERVER_TAG: tag}

    if len(args) > 2:
        return (*args[:2], tagged(args[2]), *args[3:]), kwargs
    return args, {**kwargs, "env": tagged(kwargs.get("env"))}


def _spawned(process: Any, tag: bytes) -> None:
    """A stdio server was spawned: register it with the scope of the run this code is part of."""
    scope = current_cancellation()
    pid = getattr(process, "pid", None)
    info = read_proc(pid) if isinstance(pid, int) else None
    if scope is None or info is None:
        return  # outside a run (or already gone): nothing of ours
    server = StdioServer(
        process=process,
        key=ProcKey(info.pid, info.start),
        tag=tag,
        command=command_line(info.pid),
        loop=asyncio.get_running_loop(),
        # A server a session reconnects to in the middle of a tool call has no run to wait with:
        # it is still closed, but the run may have ended first (then it is killed, not closed).
        tracker=_entering.get(),
        scope=scope,
    )
    server.watch_for_answer()
    scope.record("mcp_server_started", pid=info.pid, server=server.command)
    if server.tracker is not None:
        with server.tracker.lock:
            server.tracker.stdio_servers.append(server)
    # A server spawned after the cancel (still starting when the kill landed) is released at once.
    scope.register(server.close, name=f"mcp server {info.pid}", phase=Phase.SERVERS)


@dataclass
class StdioServer:
    """One MCP stdio server process a run's transport spawned; [`close`][] stops it and its tree."""

    process: Any  # the SDK's anyio Process: its stdin is the transport's end of the pipe
    key: ProcKey
    tag: bytes  # ``SERVER_TAG=value`` as it appears in the environment of what it started
    command: str
    loop: asyncio.AbstractEventLoop
    tracker: RunTracker | None
    scope: TaskCancellation
    _closing: threading.Lock = field(default_factory=threading.Lock)
    closed: threading.Event = field(default_factory=threading.Event)
    """Set once [`close`][] is done (whatever the outcome)."""
    answered: threading.Event = field(default_factory=threading.Event)
    """Set once the server wrote anything to its stdout: it read the client's ``initialize`` and
    answered (an MCP server writes nothing else before). Set at once where that cannot be watched."""

    def watch_for_answer(self) -> None:
        """Set [`answered`][] on the first bytes read from the server's stdout (the transport's
        reads, wrapped on this process's stream); where the stream cannot be wrapped, assume it
        answered (the graceful close, as before)."""
        stdout = getattr(self.process, "stdout", None)
        receive = getattr(stdout, "receive", None)
        if receive is None:
            self.answered.set()
            return

        async def receive_noting(*args: Any, **kwargs: Any) -> Any:
            data = await receive(*args, **kwargs)
            self.answered.set()
            return data

        try:
            stdout.receive = receive_noting  # type: ignore[union-attr]
        except AttributeError:  # a stream type with slots: no way to tell, so no shortcut
            self.answered.set()

    def close(self) -> None:
        """The MCP stdio shutdown, inside the scope's remaining budget; records what happened.

        1. wait for the run's in-flight tool calls to end (their cancel notifications are sent);
        2. close the server's stdin (on the loop that owns the pipe) and wait for it to exit;
        3. SIGTERM, then SIGKILL what is left of its process group, its process tree and its
           tag (a tool's children outlive a server that exited on EOF, in its group or not).
        """
        if not self._closing.acquire(blocking=False):
            return
        try:
            self._close()
        finally:
            self.closed.set()

    def _close(self) -> None:
        scope = self.scope
        started = scope.now()
        reserve = TERM_GRACE + KILL_WAIT + 0.1
        calls = self._wait_for_calls(max(0.0, scope.remaining() - reserve))
        calls_ms = _ms(scope.now() - started)
        if not is_running(self.key):
            self._record(started, "exited", calls, calls_ms, killed=self._stop_leftovers([]))
            return
        tree = [ProcKey(pid, info.start) for pid, info in walk_descendants(self.key.pid).items()]
        if not self.answered.is_set():
            # Still booting: it has not read its stdin yet, so closing it would only wait the
            # whole grace; nothing of a session can be lost. Stopped at once.
            killed = self._stop_leftovers([self.key, *tree])
            self._record(started, "killed", calls, calls_ms, killed=killed, booting=True)
            return
        stdin_closed = self._close_stdin()
        grace = max(0.0, min(STDIN_GRACE, scope.remaining() - reserve)) if stdin_closed else 0.0
        exited = wait_gone([self.key], grace)
        killed = self._stop_leftovers(tree if exited else [self.key, *tree])
        outcome = "exited" if exited else "killed"
        self._record(started, outcome, calls, calls_ms, killed=killed, stdin_closed=stdin_closed)

    def _wait_for_calls(self, timeout: float) -> int:
        """Wait (bounded) until the run's tool tasks ended; return how many were still running."""
        if self.tracker is None:
            return 0
        with self.tracker.lock:
            tasks = [t for t in self.tracker.tool_tasks if not t.done()]
        if tasks:
            wait_until(lambda: all(t.done() for t in tasks), timeout)
        return len(tasks)

    def _close_stdin(self) -> bool:
        """Close the transport's end of the server's stdin on the loop that owns it; whether it was.

        A server reads EOF as "shut down" (the spec's first step). The loop has ended if the run
        already returned: then there is no graceful step and the server is killed at once.
        """
        stdin = getattr(self.process, "stdin", None)
        if stdin is None or self.loop.is_closed() or not self.loop.is_running():
            return False

        async def close() -> None:
            with contextlib.suppress(Exception):
                await stdin.aclose()

        try:
            asyncio.run_coroutine_threadsafe(close(), self.loop).result(min(0.2, self.scope.remaining()))
        except Exception:  # the loop stopped under us, or it is too busy to answer in time
            return False
        return True

    def _stop_leftovers(self, known: list[ProcKey]) -> list[KillRecord]:
        """SIGTERM, then SIGKILL, ``known`` and every process still in the server's group or
        carrying its tag."""
        targets = {k for k in [*known, *_left_by(self.key, self.tag)] if is_running(k)}
        if not targets:
            return []
        commands = {k: command_line(k.pid) for k in targets}
        remaining = self.scope.remaining()
        signals = terminate(
            targets, max(0.0, min(TERM_GRACE, remaining - KILL_WAIT)), kill_wait=min(KILL_WAIT, remaining)
        )
        records = []
        for key in targets:
            if key.pid not in signals:
                continue
            record = KillRecord(
                source="mcp_stdio",
                pid=key.pid,
                signal=signals[key.pid],
                command=commands[key],
                reason="MCP server" if key == self.key else f"left by MCP server {self.key.pid}",
                at=round(time.time(), 3),
            )
            self.scope.record_killed(record)
            records.append(record)
        wait_gone(targets, min(KILL_WAIT, self.scope.remaining()))
        return records

    def _record(
        self,
        started: float,
        outcome: str,
        calls: int,
        calls_ms: float,
        *,
        killed: list[KillRecord],
        stdin_closed: bool = False,
        booting: bool = False,
    ) -> None:
        took = _ms(self.scope.now() - started)
        log.info(
            "%s: MCP server %d (%s) %s in %.0f ms", self.scope.name, self.key.pid, self.command, outcome, took
        )
        self.scope.record(
            "mcp_server_closed",
            server=self.command,
            pid=self.key.pid,
            outcome=outcome,
            calls_cancelled=calls,
            calls_ended_ms=calls_ms,
            stdin_closed=stdin_closed,
            booting=booting,
            killed=[k.pid for k in killed],
            took_ms=took,
        )


async def wait_closed(tracker: RunTracker) -> None:
    """On a cancelled run's loop, before it ends: wait (within the budget) until the run's stdio
    servers were closed. Closing one needs this loop (its stdin pipe belongs to it): a run that
    returned first would leave only the kill, and a tool's cleanup on cancel no time to finish."""
    with tracker.lock:
        servers = list(tracker.stdio_servers)
    deadline = tracker.scope.now() + tracker.scope.remaining()
    while not all(s.closed.is_set() for s in servers) and tracker.scope.now() < deadline:
        await asyncio.sleep(_POLL)


#: How often a cancelled run's loop checks whether its servers were closed.
_POLL = 0.005


def _left_by(server: ProcKey, tag: bytes) -> list[ProcKey]:
    """Running processes started since ``server`` that are in its process group (found by
    scanning: the leader may be gone) or carry its ``tag`` (a ``setsid`` daemon of a tool)."""
    found = []
    for pid in all_pids():
        info = read_proc(pid)
        if info is None or info.exited or info.start < server.start or pid == os.getpid():
            continue
        if info.pgid == server.pid or environ_contains(pid, tag):
            found.append(ProcKey(pid, info.start))
    return found


def _ms(seconds: float) -> float:
    return round(seconds * 1000, 1)
