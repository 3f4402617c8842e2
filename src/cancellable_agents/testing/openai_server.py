"""A scripted, stdlib-only, OpenAI-compatible chat-completions server for tests, benchmarks and demos.

The server speaks real HTTP/1.1 on ``127.0.0.1`` (an ephemeral port unless one is given) and answers
``POST /v1/chat/completions`` in both plain-JSON and SSE streaming form, in the shape the ``openai`` client
and pydantic-ai's ``OpenAIChatModel`` accept (also under the paths Azure OpenAI, Groq and Mistral's SDKs
use for the same API). What it answers is chosen by the request's ``model`` string.

What it answers (the model-string grammar) is in [`cancellable_agents.testing.scripts`][].

Disconnect detection is the point of this server: whenever it waits (``delay_first``, between tokens, or
the non-streaming ``N*S`` wait) it polls the client socket every ``POLL_INTERVAL`` seconds, and a peeked
EOF, a reset, or a failed write ends the request with outcome ``"disconnected"`` and the monotonic time of
detection. Each chat-completions request is recorded as a `RequestRecord`; ``GET /_records`` returns the
records as JSON and ``POST /_reset`` clears them, so a parent process can assert on a server it spawned.
Timestamps come from ``time.monotonic()``, which on Linux is comparable across processes.

Other endpoints: ``GET /health`` (``ok``), ``GET /v1/models``, and ``POST /token``: an OAuth 2.0 token
endpoint as Google's service-account exchange answers it, whose access token is the server's API key,
so a Vertex AI client built from a service-account key (``token_uri`` pointed here) authenticates.

Run it as a process with ``python -m cancellable_agents.testing.openai_server [--host H] [--port P]``: it
prints ``READY <base_url>`` on stdout (flushed) and serves until SIGTERM or SIGINT.

One module of ~500 lines on purpose: it runs as a script in processes that import nothing else
of the package, and the handler, its streaming and its disconnect polling share one request's
state; the answers' grammar, which does not, lives in ``scripts``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import select
import signal
import socket
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Sequence
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import FrameType, TracebackType
from typing import Any, Literal, TypeVar, cast
from urllib.parse import urlsplit

from cancellable_agents.testing import wire_protocols
from cancellable_agents.testing.records import RecordLog, RequestRecord, first_record
from cancellable_agents.testing.scripts import (
    BEHAVIOURS,
    Completion,
    Reply,
    Script,
    ScriptError,
    error_json,
    parse_model,
    plan_reply,
    supported,
)

__all__ = [
    "BEHAVIOURS",
    "POLL_INTERVAL",
    "RequestRecord",
    "Script",
    "ScriptError",
    "ScriptedModelServer",
    "fetch_records",
    "main",
    "parse_model",
]

POLL_INTERVAL = 0.02
"""Seconds between client-socket polls while the server waits; bounds disconnect-detection latency."""


_T = TypeVar("_T")


# --------------------------------------------------------------------------------------------------------
# HTTP
# --------------------------------------------------------------------------------------------------------


class _ClientGone(Exception):
    """The client closed or reset the connection; ``at`` is the monotonic time it was noticed."""

    def __init__(self, at: float) -> None:
        super().__init__(f"client disconnected at {at:.3f}")
        self.at = at


def _peek_client(sock: socket.socket, timeout: float) -> Literal["idle", "data", "closed"]:
    """Wait up to ``timeout`` for the socket to become readable and classify what the peer did."""
    try:
        readable, _, _ = select.select([sock], [], [], timeout)
        if not readable:
            return "idle"
        return "closed" if sock.recv(1, socket.MSG_PEEK) == b"" else "data"
    except (OSError, ValueError):  # reset, or the socket was closed under us (server stopping)
        return "closed"


class _Server(ThreadingHTTPServer):
    """ThreadingHTTPServer that owns the record log and can cut every open connection on stop."""

    daemon_threads = True
    request_queue_size = 128

    def __init__(
        self, address: tuple[str, int], log: RecordLog, verbose: bool, api_key: str | None = None
    ) -> None:
        self.log = log
        self.verbose = verbose
        self.api_key = api_key
        self._connections: set[socket.socket] = set()
        self._connections_changed = threading.Condition()
        super().__init__(address, _Handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        with self._connections_changed:
            self._connections.add(cast(socket.socket, request))
        super().process_request(request, client_address)

    def shutdown_request(self, request: Any) -> None:
        super().shutdown_request(request)
        with self._connections_changed:
            self._connections.discard(cast(socket.socket, request))
            self._connections_changed.notify_all()

    def close_connections(self, timeout: float) -> bool:
        """Shut down every open client connection (keep-alive or in flight) and wait for their handlers.

        In-flight requests notice within `POLL_INTERVAL` and end as ``"disconnected"``. Return whether all
        handlers finished within ``timeout``.
        """
        with self._connections_changed:
            connections = list(self._connections)
        for connection in connections:
            with contextlib.suppress(OSError):
                connection.shutdown(socket.SHUT_RDWR)
        with self._connections_changed:
            return self._connections_changed.wait_for(lambda: not self._connections, timeout)

    def handle_error(self, request: Any, client_address: Any) -> None:
        """Print tracebacks of real failures only; clients going away is business as usual here."""
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)


class _Handler(BaseHTTPRequestHandler):
    """Routes requests; chat completions are played from the model-string script."""

    protocol_version = "HTTP/1.1"
    server_version = "ScriptedModelServer/1.0"

    @property
    def _log(self) -> RecordLog:
        return cast(_Server, self.server).log

    def log_message(self, format: str, *args: Any) -> None:
        if cast(_Server, self.server).verbose:
            super().log_message(format, *args)

    def do_GET(self) -> None:
        """Serve ``/health``, ``/v1/models`` and ``/_records``; anything else is a JSON 404."""
        path = urlsplit(self.path).path.rstrip("/")
        if path == "/health":
            self._send_body(HTTPStatus.OK, b"ok", "text/plain; charset=utf-8")
        elif path == "/v1/models":
            models = [
                {"id": name, "object": "model", "created": 0, "owned_by": "scripted"} for name in BEHAVIOURS
            ]
            self._send_json(HTTPStatus.OK, {"object": "list", "data": models})
        elif path == "/_records":
            self._send_json(HTTPStatus.OK, [record.to_json() for record in self._log.snapshot()])
        else:
            self._send_json(HTTPStatus.NOT_FOUND, error_json(f"no route GET {path}", "not_found"))

    def do_POST(self) -> None:
        """Serve every model endpoint of [`wire_protocols`][cancellable_agents.testing.wire_protocols]
        and ``/_reset``; anything else is a JSON 404. A server given an API key refuses a model
        request without it (401), as the providers do."""
        path = urlsplit(self.path).path.rstrip("/")
        body = self._read_body()
        endpoint = wire_protocols.route(path)
        if endpoint is not None and not self._key_accepted():
            message = "Incorrect API key provided"
            self._send_json(HTTPStatus.UNAUTHORIZED, error_json(message, "invalid_api_key"))
        elif endpoint is not None:
            self._play(endpoint, body)
        elif path == "/_reset":
            self._send_json(HTTPStatus.OK, {"cleared": self._log.clear()})
        elif path == "/token":
            token = cast(_Server, self.server).api_key or "local-access-token"
            self._send_json(
                HTTPStatus.OK, {"access_token": token, "expires_in": 3600, "token_type": "Bearer"}
            )
        else:
            self._send_json(HTTPStatus.NOT_FOUND, error_json(f"no route POST {path}", "not_found"))

    def _key_accepted(self) -> bool:
        """Any key, unless the server was given one: then the request must carry it the way its
        SDK sends a key (a bearer token, Azure's ``api-key``, Anthropic's ``x-api-key``, Gemini's
        ``x-goog-api-key``, or a SigV4 credential's access key id)."""
        expected = cast(_Server, self.server).api_key
        if expected is None:
            return True
        authorization = self.headers.get("Authorization", "")
        sent = {authorization.removeprefix("Bearer ")}
        sent |= {self.headers.get(name, "") for name in ("api-key", "x-api-key", "x-goog-api-key")}
        return expected in sent or f"Credential={expected}/" in authorization

    # -- model requests ---------------------------------------------------------------------------------

    def _play(self, endpoint: wire_protocols.Route, raw: bytes) -> None:
        """Record the request, play its script in the endpoint's protocol, and close the record."""
        protocol = endpoint.protocol
        try:
            request = _parse_request(protocol, endpoint, raw)
        except ValueError as exc:
            record = self._log.open("", False, [])
            self._reject(record, f"{exc}; {supported()}", "invalid_request", None)
            return
        record = self._log.open(
            request.model, request.stream, request.messages, tools=request.tools, protocol=protocol.name
        )
        try:
            script = parse_model(request.model)
        except ScriptError as exc:
            self._reject(record, str(exc), "unknown_behaviour", "model")
            return
        completion = Completion(request.model, wire_protocols.text_of(request.messages), script.cost)
        try:
            self._pause(script.delay_first)
            repeated = script.stall_at is not None and self._log.repeats(record)
            reply = plan_reply(script, request.messages, repeated=repeated, offered=tuple(request.tools))
            if request.stream:
                self._stream(protocol, request, record, completion, reply)
            else:
                self._respond(protocol, record, completion, reply)
        except _ClientGone as gone:
            self.close_connection = True
            self._log.close(record, "disconnected", at=gone.at)
        except Exception as exc:
            self.close_connection = True
            self._log.close(record, "error", error=repr(exc))
            raise
        else:
            self._log.close(record, "completed")

    def _reject(self, record: RequestRecord, message: str, code: str, param: str | None) -> None:
        """Close ``record`` as an error and answer with an OpenAI-style 400."""
        self._log.close(record, "error", error=message)
        try:
            self._send_json(HTTPStatus.BAD_REQUEST, error_json(message, code, param))
        except _ClientGone:
            self.close_connection = True

    def _respond(
        self,
        protocol: wire_protocols.WireProtocol,
        record: RequestRecord,
        completion: Completion,
        reply: Reply,
    ) -> None:
        """Non-streaming: wait for the whole 'generation' while watching the client, then answer."""
        self._pause(reply.wait_first + reply.piece_delay * len(reply.pieces))
        self._send_json(HTTPStatus.OK, protocol.body(completion, reply))
        self._log.add_tokens(record, reply.completion_tokens)

    def _stream(
        self,
        protocol: wire_protocols.WireProtocol,
        request: wire_protocols.WireRequest,
        record: RequestRecord,
        completion: Completion,
        reply: Reply,
    ) -> None:
        """Streaming: the protocol's frames over chunked transfer encoding, a token per text frame."""
        self.send_response(HTTPStatus.OK)
        self.send_header("Content-Type", protocol.stream_content_type)
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Transfer-Encoding", "chunked")
        self._end_headers()
        if reply.wait_first:
            self._pause(reply.wait_first)
        self._write_frames(protocol.opening(completion, reply))
        for piece in reply.pieces:
            self._pause(reply.piece_delay)
            self._write_frames(protocol.text(completion, reply, piece))
            self._log.add_tokens(record, 1)
        for index, call in enumerate(reply.tool_calls):
            self._pause(0.0)
            self._write_frames(protocol.tool_call(completion, reply, index, call))
            self._log.add_tokens(record, 1)
        self._write_frames(protocol.closing(completion, reply, request))
        self._write(b"0\r\n\r\n")

    # -- waiting and writing ----------------------------------------------------------------------------

    def _pause(self, seconds: float) -> None:
        """Wait ``seconds`` (at least one poll) while watching the client; raise `_ClientGone` if it left."""
        deadline = time.monotonic() + seconds
        while True:
            remaining = deadline - time.monotonic()
            step = min(POLL_INTERVAL, max(remaining, 0.0))
            state = _peek_client(self.connection, step)
            if state == "closed":
                raise _ClientGone(time.monotonic())
            if state == "data":  # pipelined bytes keep the socket readable; don't spin on them
                time.sleep(step)
            if remaining <= 0:
                return

    def _write(self, data: bytes) -> None:
        try:
            self.wfile.write(data)
            self.wfile.flush()
        except OSError as exc:  # BrokenPipe, ConnectionReset, ... all mean the client is gone
            raise _ClientGone(time.monotonic()) from exc

    def _end_headers(self) -> None:
        try:
            self.end_headers()
        except OSError as exc:
            raise _ClientGone(time.monotonic()) from exc

    def _write_chunk(self, data: bytes) -> None:
        self._write(b"%X\r\n%s\r\n" % (len(data), data))

    def _write_frames(self, frames: list[bytes]) -> None:
        for frame in frames:
            self._write_chunk(frame)

    def _send_body(self, status: HTTPStatus, body: bytes, content_type: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self._end_headers()
        self._write(body)

    def _send_json(self, status: HTTPStatus, payload: Any) -> None:
        self._send_body(status, json.dumps(payload).encode(), "application/json")

    def _read_body(self) -> bytes:
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length > 0 else b""


def _parse_request(
    protocol: wire_protocols.WireProtocol, endpoint: wire_protocols.Route, raw: bytes
) -> wire_protocols.WireRequest:
    """The request body as JSON, read by ``protocol``; a `ValueError` says what is wrong with it."""
    try:
        body = json.loads(raw or b"{}")
    except json.JSONDecodeError as exc:
        raise ValueError(f"request body is not valid JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise ValueError("request body must be a JSON object")
    return protocol.parse(body, endpoint.model, endpoint.stream)


# --------------------------------------------------------------------------------------------------------
# Public server object
# --------------------------------------------------------------------------------------------------------


class ScriptedModelServer:
    """An in-process scripted OpenAI-compatible server on a background thread.

    Use as ``with ScriptedModelServer() as server:`` or call `start` / `stop`. ``base_url`` (e.g.
    ``http://127.0.0.1:PORT/v1``) is what an OpenAI client or ``OpenAIProvider(base_url=...)`` needs; any
    API key is accepted unless ``api_key`` is given (then any other is answered 401, as OpenAI does).
    All waits take a timeout and block on a condition variable, never spin.
    """

    def __init__(
        self, host: str = "127.0.0.1", port: int = 0, *, verbose: bool = False, api_key: str | None = None
    ) -> None:
        self._address = (host, port)
        self._verbose = verbose
        self._api_key = api_key
        self._log = RecordLog()
        self._httpd: _Server | None = None
        self._thread: threading.Thread | None = None

    # -- lifecycle ---------------------------------------------------------------------------------------

    def start(self) -> ScriptedModelServer:
        """Bind the socket and serve on a daemon thread; return ``self``. Raise if already started."""
        if self._httpd is not None:
            raise RuntimeError("ScriptedModelServer is already started")
        self._httpd = _Server(self._address, self._log, self._verbose, self._api_key)
        self._thread = threading.Thread(
            target=self._httpd.serve_forever,
            kwargs={"poll_interval": 0.1},
            name="scripted-model-server",
            daemon=True,
        )
        self._thread.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        """Stop serving and close the socket; idempotent.

        Open connections are cut, so in-flight requests end as ``"disconnected"``; waits up to ``timeout``
        for their handler threads to record that.
        """
        httpd, thread = self._httpd, self._thread
        if httpd is None:
            return
        httpd.shutdown()
        httpd.close_connections(timeout)
        httpd.server_close()
        if thread is not None:
            thread.join(timeout)
        self._httpd, self._thread = None, None

    def __enter__(self) -> ScriptedModelServer:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    # -- addresses ---------------------------------------------------------------------------------------

    @property
    def port(self) -> int:
        """The bound TCP port (the ephemeral one when constructed with ``port=0``)."""
        if self._httpd is None:
            raise RuntimeError("ScriptedModelServer is not started")
        return int(self._httpd.server_address[1])

    @property
    def url(self) -> str:
        """Root URL, e.g. ``http://127.0.0.1:PORT`` (``/health``, ``/_records`` live here)."""
        return f"http://{self._address[0]}:{self.port}"

    @property
    def base_url(self) -> str:
        """OpenAI base URL, e.g. ``http://127.0.0.1:PORT/v1``."""
        return f"{self.url}/v1"

    # -- records -----------------------------------------------------------------------------------------

    @property
    def requests(self) -> list[RequestRecord]:
        """Copies of all chat-completions requests recorded so far, in arrival order."""
        return self._log.snapshot()

    @property
    def request_count(self) -> int:
        """How many chat-completions requests have started."""
        return self._log.count()

    def reset(self) -> None:
        """Forget all records (requests still in flight are no longer tracked)."""
        self._log.clear()

    def wait_for_request(self, n: int = 1, timeout: float = 5.0) -> bool:
        """Wait until at least ``n`` requests have started; return whether that happened in time."""
        return bool(self._log.wait_for(lambda records: len(records) >= n, timeout))

    def wait_until(
        self, predicate: Callable[[list[RequestRecord]], _T | None], timeout: float = 5.0
    ) -> _T | None:
        """Wait until ``predicate(records)`` is truthy; return its value, or ``None`` on timeout."""
        return self._log.wait_for(predicate, timeout)

    def wait_for_disconnect(self, timeout: float = 5.0) -> RequestRecord | None:
        """Wait for the first request whose outcome is ``"disconnected"``; ``None`` on timeout."""
        return self._log.wait_for(
            lambda records: first_record(records, lambda r: r.outcome == "disconnected"), timeout
        )

    def wait_for_tokens(self, k: int, timeout: float = 5.0) -> RequestRecord | None:
        """Wait until some request has sent at least ``k`` tokens; return it, or ``None`` on timeout."""
        return self._log.wait_for(
            lambda records: first_record(records, lambda r: r.tokens_sent >= k), timeout
        )

    def wait_for_finished(self, n: int = 1, timeout: float = 5.0) -> list[RequestRecord] | None:
        """Wait until the first ``n`` requests have all finished; return them, or ``None`` on timeout."""

        def finished(records: list[RequestRecord]) -> list[RequestRecord] | None:
            done = records[:n]
            return (
                [dataclasses.replace(r) for r in done]
                if len(done) == n and all(r.outcome for r in done)
                else None
            )

        return self._log.wait_for(finished, timeout)


def fetch_records(url: str, timeout: float = 5.0) -> list[RequestRecord]:
    """Read ``GET /_records`` of a server (root or ``/v1`` base URL), e.g. one started with ``-m``."""
    root = url.rstrip("/").removesuffix("/v1")
    with urllib.request.urlopen(f"{root}/_records", timeout=timeout) as response:
        return [RequestRecord.from_json(item) for item in json.load(response)]


# --------------------------------------------------------------------------------------------------------
# Process entry point
# --------------------------------------------------------------------------------------------------------


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--host", default="127.0.0.1", help="interface to bind (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=0, help="TCP port; 0 picks a free one (default)")
    parser.add_argument("--verbose", action="store_true", help="log requests to stderr")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Serve until SIGTERM/SIGINT after printing ``READY <base_url>``; return the exit code."""
    args = _parse_args(argv)
    stopping = threading.Event()

    def _on_signal(signum: int, frame: FrameType | None) -> None:
        stopping.set()

    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    with ScriptedModelServer(args.host, args.port, verbose=args.verbose) as server:
        print(f"READY {server.base_url}", flush=True)
        while not stopping.wait(0.5):
            pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
