"""A real MCP server (the ``mcp`` SDK's ``MCPServer``) for the MCP kill tests: ``python mcp_server.py
MODE EVENTS MARKER [PORT]``.

Its one tool, ``work``, blocks until cancelled; what it does around that is the ``MODE``:

- ``child``: starts ``sleep MARKER`` (in the server's process group) and leaves it running when
  cancelled, as a careless tool does;
- ``setsid``: double-forks ``sleep MARKER`` into a session of its own (its parent exits at once);
- ``cleanup``: on cancel runs a cleanup of :data:`CLEANUP` seconds (shielded, as a server must
  write it for the cleanup to outlast the cancel) and reports when it finished;
- ``boot``: never gets that far: it sleeps while it boots (before it reads stdin);
- ``http``: only blocks, served over streamable HTTP on 127.0.0.1:PORT (not stdio);
- ``steps``: a second tool, ``step(n)``, returns at once and reports each execution (``step``, with
  ``n``, the request's ``_meta``, its ``Authorization`` header over HTTP and the server's
  ``MCP_TEST_SECRET`` variable): the durable test counts them, the connection test reads them
  (``http`` serves ``step`` too).

Events (``server_started``, ``tool_started`` (with the request's ``_meta``), ``tool_cancelled``,
``cleanup_done``, ``server_exit``) are JSON lines appended to the file ``EVENTS``, each with the
server's pid and ``time.monotonic()`` (one clock for all processes on Linux). ``MARKER`` (a
``sleep`` duration) is on the server's and its children's command lines, so the test finds every
survivor.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from typing import Any

import anyio

try:
    from mcp.server.mcpserver import Context, MCPServer
except ImportError:  # mcp 1.x (pydantic-ai's floor): the same server under its old name
    from mcp.server.fastmcp import Context  # type: ignore[no-redef]
    from mcp.server.fastmcp import FastMCP as MCPServer

MODE, EVENTS, MARKER = sys.argv[1], sys.argv[2], sys.argv[3]
#: How long the ``cleanup`` server's tool cleans up after a cancel.
CLEANUP = 0.5


def emit(event: str, **data: Any) -> None:
    line = json.dumps({"event": event, "t": time.monotonic(), "pid": os.getpid(), "mode": MODE, **data})
    with open(EVENTS, "a") as events:
        events.write(line + "\n")


server: Any = MCPServer(f"kill-test-{MODE}")


def _meta(ctx: Context) -> dict[str, Any]:
    """The request's ``_meta`` as a dict."""
    meta = ctx.request_context.meta
    return meta.model_dump() if hasattr(meta, "model_dump") else dict(meta or {})


@server.tool()
async def work(ctx: Context, what: str = "") -> str:
    """Work until cancelled."""
    meta = _meta(ctx)
    children = []
    if MODE == "child":
        children.append(subprocess.Popen(["sleep", MARKER]).pid)
    elif MODE == "setsid":
        # sh exits at once: its `sleep` is orphaned in a session of its own (a daemon's double fork).
        subprocess.run(["sh", "-c", f"setsid sleep {MARKER} >/dev/null 2>&1 &"], check=True)
    emit("tool_started", children=children, meta=meta)
    try:
        await anyio.sleep(3600)
    except anyio.get_cancelled_exc_class():
        emit("tool_cancelled")
        if MODE == "cleanup":
            with anyio.CancelScope(shield=True):
                await anyio.sleep(CLEANUP)
            emit("cleanup_done")
        raise
    return "finished"


def _authorization(ctx: Context) -> str | None:
    """The HTTP request's ``Authorization`` header (``None`` over stdio)."""
    request = getattr(ctx.request_context, "request", None)
    headers = getattr(request, "headers", None)
    return headers.get("authorization") if headers is not None else None


if MODE in ("steps", "http"):

    @server.tool()
    async def step(ctx: Context, n: int) -> str:
        """Do step ``n``."""
        emit(
            "step",
            n=n,
            meta=_meta(ctx),
            authorization=_authorization(ctx),
            secret=os.environ.get("MCP_TEST_SECRET"),
        )
        return f"step {n} ok"


if __name__ == "__main__":
    emit("server_started")
    if MODE == "boot":
        time.sleep(3600)
    settings = getattr(server, "settings", None)
    if MODE == "http" and "host" in getattr(type(settings), "model_fields", {}):  # mcp 1.x: settings
        server.settings.host, server.settings.port = "127.0.0.1", int(sys.argv[4])
        server.run("streamable-http")
    elif MODE == "http":
        server.run("streamable-http", host="127.0.0.1", port=int(sys.argv[4]))
    else:
        server.run("stdio")
    emit("server_exit")
