"""``MCPConnectionToolset``: an MCP server's tools from an Airflow connection, not from the DAG file.

The connection is common.ai 1.0.0's ``mcp`` type, read as it is (common.ai is not imported):

- *host*: the server's URL, for the ``http`` (streamable HTTP, the default) and ``sse``
  transports;
- *password*: a token, sent as ``Authorization: Bearer <token>``;
- extra ``transport``: ``http``, ``sse`` or ``stdio``; extra ``headers``: more request headers
  (an object of strings, e.g. an API-key header a server wants instead of a bearer token);
- for ``stdio``: extra ``command``, ``args`` (a list, or one string), ``env`` (an object of
  strings: the server's environment, where its own credentials go), ``cwd``, and ``timeout`` (the
  seconds the server may take to answer the MCP handshake; 10).

The connection is read when the task runs: a DAG file names only its id, so the dag-processor
never reaches the secrets backend, and a token or a key rotated in Airflow is the next try's.
A stdio server built here is a child of the task like any other and is stopped on a kill the
protocol's way ([`cancellable_agents.run._mcp_servers`][]).
"""

from __future__ import annotations

from typing import Any

from cancellable_agents.core.exceptions import ConfigurationError
from cancellable_agents.toolsets._toolset_description import ToolsetDescription

__all__ = ["MCPConnectionToolset", "mcp_toolset"]

#: common.ai's connection type for MCP servers, and its default connection id.
MCP_CONN_TYPE = "mcp"
DEFAULT_MCP_CONN_ID = "mcp_default"
#: Seconds a stdio server may take to answer the handshake when the connection does not say.
DEFAULT_INIT_TIMEOUT_S = 10.0


class MCPConnectionToolset(ToolsetDescription):
    """The tools of the MCP server that connection ``mcp_conn_id`` describes.

    Light at parse time (a
    [`ToolsetDescription`][cancellable_agents.toolsets._toolset_description.ToolsetDescription]): the
    connection is read and the pydantic-ai ``MCPToolset`` built when the task runs.

    :param mcp_conn_id: a connection of type ``mcp`` (common.ai's, as it is).
    :param id: the toolset's id (a durable run's fingerprint names it); the connection id when
        not given, so the server's URL or command can change in the connection without starting
        a resumed run fresh.
    :param tool_prefix: prepended to the server's tool names (``weather`` ->
        ``weather_get_forecast``), to keep two servers' tools apart.
    """

    toolset_class = "pydantic_ai.mcp:MCPToolset"

    def __init__(
        self, mcp_conn_id: str = DEFAULT_MCP_CONN_ID, *, id: str | None = None, tool_prefix: str | None = None
    ):
        super().__init__(mcp_conn_id, id=id, tool_prefix=tool_prefix)

    def build(self) -> Any:
        """The ``MCPToolset`` (made on the first call from the connection; the same after)."""
        with self._lock:
            if self._toolset is None:
                from airflow.sdk.bases.hook import BaseHook

                (conn_id,) = self._args
                try:
                    conn = BaseHook.get_connection(conn_id)
                except Exception as exc:
                    raise ConfigurationError(
                        f"MCP connection {conn_id!r} not found ({exc}). Create it, e.g. `airflow "
                        f"connections add {conn_id} --conn-type mcp --conn-host https://mcp.example.com/mcp "
                        f"--conn-password $TOKEN`."
                    ) from exc
                self._toolset = mcp_toolset(
                    conn, id=self._kwargs["id"], tool_prefix=self._kwargs["tool_prefix"]
                )
            return self._toolset


def mcp_toolset(conn: Any, *, id: str | None = None, tool_prefix: str | None = None) -> Any:
    """pydantic-ai's ``MCPToolset`` for Airflow connection ``conn`` (of type ``mcp``).

    Raises [`ConfigurationError`][] naming the fix for a connection that cannot work.
    """
    if conn.conn_type and conn.conn_type != MCP_CONN_TYPE:
        raise ConfigurationError(
            f"Connection {conn.conn_id!r} has type {conn.conn_type!r}: an MCP server's connection has type "
            f"{MCP_CONN_TYPE!r} (common.ai's), with the URL in host or the command in extra 'command'."
        )
    try:
        from fastmcp.client.transports import SSETransport, StdioTransport, StreamableHttpTransport
        from pydantic_ai.mcp import MCPToolset
    except ImportError as exc:
        raise ConfigurationError(
            "MCP toolsets need the mcp extra: "
            f'pip install "airflow-provider-cancellable-agents[mcp]" ({exc}).'
        ) from exc
    extra = conn.extra_dejson or {}
    transport = extra.get("transport") or "http"
    toolset_id = id or conn.conn_id
    if transport in ("http", "sse"):
        if not conn.host:
            raise ConfigurationError(
                f"MCP connection {conn.conn_id!r} ({transport}) has no URL: set its host, "
                f"e.g. https://mcp.example.com/mcp."
            )
        kind = StreamableHttpTransport if transport == "http" else SSETransport
        toolset = MCPToolset(kind(conn.host, headers=_headers(conn, extra)), id=toolset_id)
    elif transport == "stdio":
        command = extra.get("command")
        if not command:
            raise ConfigurationError(
                f"MCP connection {conn.conn_id!r} (stdio) has no command: set extra 'command' (and 'args')."
            )
        args = extra.get("args") or []
        stdio = StdioTransport(
            command=str(command),
            args=[args] if isinstance(args, str) else [str(a) for a in args],
            env=_strings(conn.conn_id, "env", extra.get("env")),
            cwd=extra.get("cwd") or None,
        )
        toolset = MCPToolset(
            stdio, id=toolset_id, init_timeout=float(extra.get("timeout") or DEFAULT_INIT_TIMEOUT_S)
        )
    else:
        raise ConfigurationError(
            f"MCP connection {conn.conn_id!r}: unknown transport {transport!r}; use 'http', 'sse' or 'stdio'."
        )
    return toolset.prefixed(tool_prefix) if tool_prefix else toolset


def _headers(conn: Any, extra: dict[str, Any]) -> dict[str, str] | None:
    headers = dict(_strings(conn.conn_id, "headers", extra.get("headers")) or {})
    if conn.password:
        headers["Authorization"] = f"Bearer {conn.password}"
    return headers or None


def _strings(conn_id: str, key: str, value: Any) -> dict[str, str] | None:
    """Extra ``key`` as an object of non-empty strings (the environment, the headers)."""
    if value is None:
        return None
    if not isinstance(value, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in value.items()
    ):
        raise ConfigurationError(
            f"MCP connection {conn_id!r}: extra {key!r} must be an object of strings, e.g. "
            f'{{"{key}": {{"NAME": "value"}}}}; got {type(value).__name__}.'
        )
    return dict(value) or None
