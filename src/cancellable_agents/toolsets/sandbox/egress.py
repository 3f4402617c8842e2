"""The egress allowlist: a sandbox without a network that reaches listed hosts through a proxy.

``LocalSandbox(network=["pypi.org", "*.githubusercontent.com"])`` (or an :class:`EgressPolicy`)
keeps the boundary profile's network namespace, where only ``lo`` exists, and gives commands an
HTTP proxy (``CONNECT`` for HTTPS and anything else over TCP, absolute-form requests for plain
HTTP):

- :class:`EgressProxy` runs in the task process, outside the sandbox, on a unix socket that is
  bind-mounted into the sandbox (a unix socket needs no network). It allows only hosts and ports
  the policy lists, resolves names itself and connects to the address it checked (so a name
  that resolves to a public address for the check and a private one for the connection — DNS
  rebinding — gets nowhere), and refuses loopback, link-local, private, multicast and reserved
  addresses unless the policy lists the address (or its network) itself. Each refusal is one
  log line (rate-limited) and an ``egress_denied`` event on the task's timeline (bounded).
- :data:`FORWARDER` runs inside the sandbox, before the command: it listens on
  ``127.0.0.1:PROXY_PORT`` in the sandbox's own namespace and carries each connection to the
  unix socket, then the command runs with ``HTTP(S)_PROXY``/``ALL_PROXY`` pointing there.

Why a proxy of ours and not a library: the allowlist must be decided on the address the proxy
itself resolved and then connect to exactly that address, with a resolver tests can replace;
the maintained Python proxies (``proxy.py``, ``mitmproxy``) are frameworks with their own
process and plugin model, TLS interception and their own resolution, much more than a CONNECT
tunnel needs. This is asyncio streams on one thread, about two hundred lines. No TLS is
intercepted: what a command sends to an allowed host is not inspected (see ``sandbox.md``).
This module imports no Airflow.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import os
import shutil
import socket
import tempfile
import threading
import time
from urllib.parse import urlsplit

from cancellable_agents.core.scope import TaskCancellation
from cancellable_agents.toolsets.sandbox.egress_policy import (
    EgressDenial,
    EgressPolicy,
    IPAddress,
    Resolver,
)

__all__ = [
    "EGRESS_SOCKET",
    "FORWARDER",
    "PROXY_PORT",
    "EgressProxy",
    "forwarder_argv",
    "proxy_env",
]

log = logging.getLogger(__name__)


#: Where the proxy's unix socket appears inside the sandbox.
EGRESS_SOCKET = "/run/cancellable-agents/egress.sock"
#: The port the forwarder listens on inside the sandbox's network namespace (only ``lo`` there).
PROXY_PORT = 3128
#: A request head larger than this, or slower than ``HEAD_TIMEOUT``, is refused.
HEAD_LIMIT = 64 * 1024
HEAD_TIMEOUT = 30.0
#: Bounds on resolving a name and on connecting to one address.
RESOLVE_TIMEOUT = 10.0
CONNECT_TIMEOUT = 10.0
#: Refusals logged per ``LOG_WINDOW`` seconds (the rest are counted in the next line).
LOG_BURST = 10
LOG_WINDOW = 10.0
#: Refusals recorded on the timeline per proxy (the rest are counted when it closes).
TIMELINE_LIMIT = 100
#: Connections served at once; more are answered 503 (each holds descriptors of the task process).
MAX_CONNECTIONS = 256
#: How long closing the proxy waits for its thread.
CLOSE_TIMEOUT = 2.0
CHUNK = 64 * 1024


# -- the proxy ------------------------------------------------------------------------------


class _Refused(Exception):
    def __init__(self, status: int, reason: str) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason


class EgressProxy:
    """The policy's proxy on a unix socket, on an event loop of its own thread. Thread-safe.

    :meth:`start` returns once it listens; :meth:`close` closes every connection and the socket
    (idempotent, bounded). Refusals go to the log and, when :attr:`scope` is set, the scope's
    timeline (``egress_denied``).
    """

    def __init__(self, policy: EgressPolicy, *, name: str = "egress") -> None:
        self.policy = policy
        self.name = name
        self.scope: TaskCancellation | None = None
        self._resolver: Resolver = policy.resolver or _system_resolver
        self._dir = tempfile.mkdtemp(prefix="cancellable-agents-egress-")
        self.socket_path = os.path.join(self._dir, "egress.sock")
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name=f"egress-proxy-{name}", daemon=True)
        self._ready = threading.Event()
        self._lock = threading.Lock()
        self._closed = False  # guarded by _lock
        self._tasks: set[asyncio.Task[None]] = set()  # touched on the loop only
        self._server: asyncio.AbstractServer | None = None
        self._open = 0  # guarded by _lock
        self._denied = 0  # guarded by _lock
        self._window_start = 0.0  # guarded by _lock
        self._window_count = 0  # guarded by _lock
        self._unlogged = 0  # guarded by _lock

    # -- lifecycle -----------------------------------------------------------------------

    def start(self, timeout: float = 10.0) -> EgressProxy:
        """Listen (on the proxy's thread); ``RuntimeError`` if it cannot within ``timeout``."""
        self._thread.start()
        if not self._ready.wait(timeout) or self._server is None:
            self.close()
            raise RuntimeError(f"egress proxy {self.name} did not start within {timeout}s")
        return self

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(self._listen())
        except OSError as exc:
            log.error("egress proxy %s: cannot listen on %s: %s", self.name, self.socket_path, exc)
        finally:
            self._ready.set()
        if self._server is not None:
            self._loop.run_forever()
        self._loop.close()

    async def _listen(self) -> None:
        self._server = await asyncio.start_unix_server(self._accept, path=self.socket_path, limit=HEAD_LIMIT)
        # A root worker's sandbox runs as a uid of its own, which must be able to connect.
        os.chmod(self.socket_path, 0o666)

    def close(self) -> None:
        """Stop listening, close every connection, remove the socket. Idempotent, bounded."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            unrecorded = self._denied - TIMELINE_LIMIT
        if self._thread.is_alive():
            with contextlib.suppress(RuntimeError):  # the loop already stopped
                future = asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop)
                with contextlib.suppress(Exception):
                    future.result(CLOSE_TIMEOUT)
                self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(CLOSE_TIMEOUT)
        shutil.rmtree(self._dir, ignore_errors=True)
        if unrecorded > 0 and self.scope is not None:
            self.scope.record("egress_denials_not_recorded", sandbox=self.name, count=unrecorded)

    async def _shutdown(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=CLOSE_TIMEOUT)

    @property
    def open_connections(self) -> int:
        """Client connections being served now (requests being decided and tunnels)."""
        with self._lock:
            return self._open

    @property
    def denied(self) -> int:
        with self._lock:
            return self._denied

    # -- one connection ------------------------------------------------------------------

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        with self._lock:
            self._open += 1
            crowded = self._open > MAX_CONNECTIONS
        upstream: asyncio.StreamWriter | None = None
        try:
            if crowded:
                writer.write(_refusal(_Refused(503, f"more than {MAX_CONNECTIONS} connections at once")))
                await writer.drain()
            else:
                upstream = await self._serve(reader, writer)
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError):
            pass
        except asyncio.CancelledError:
            # Closing: end quietly (asyncio logs a connection task that ends cancelled as an error).
            pass
        finally:
            for stream in (writer, upstream):
                if stream is not None:
                    stream.close()
            with self._lock:
                self._open -= 1
            self._tasks.discard(task)

    async def _serve(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> asyncio.StreamWriter | None:
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), HEAD_TIMEOUT)
        lines = head.decode("latin-1").split("\r\n")
        try:
            method, target, version = _request_line(lines[0])
            host, port = _destination(method, target)
            upstream_reader, upstream = await self._connect(host, port)
        except _Refused as refused:
            writer.write(_refusal(refused))
            await writer.drain()
            return None
        if method == "CONNECT":
            writer.write(b"HTTP/1.1 200 Connection established\r\n\r\n")
        else:
            upstream.write(_origin_request(method, target, version, lines[1:]))
        await asyncio.gather(_pipe(reader, upstream), _pipe(upstream_reader, writer))
        return upstream

    async def _connect(self, host: str, port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """Check ``host:port`` against the policy, resolve it, connect to a checked address."""
        literal = _address(host)
        if not self.policy.permits(host, literal, port):
            raise self._deny(host, port, 403, "not on the sandbox's egress allowlist")
        addresses = [literal] if literal is not None else await self._resolve(host, port)
        reachable = [a for a in addresses if self.policy.reachable(a)]
        if not reachable:
            shown = ", ".join(str(a) for a in addresses)
            raise self._deny(host, port, 403, f"resolves to a loopback/private/link-local address ({shown})")
        error: Exception | None = None
        for address in reachable:
            try:
                return await asyncio.wait_for(asyncio.open_connection(str(address), port), CONNECT_TIMEOUT)
            except (OSError, TimeoutError) as exc:
                error = exc
        raise _Refused(502, f"cannot connect to {host}:{port}: {error}")

    async def _resolve(self, host: str, port: int) -> list[IPAddress]:
        loop = asyncio.get_running_loop()
        try:
            found = await asyncio.wait_for(loop.run_in_executor(None, self._resolver, host), RESOLVE_TIMEOUT)
        except (OSError, TimeoutError) as exc:
            raise _Refused(502, f"cannot resolve {host}: {exc}") from exc
        addresses = [a for a in (_address(text) for text in found) if a is not None]
        if not addresses:
            raise _Refused(502, f"cannot resolve {host}")
        return addresses

    def _deny(self, host: str, port: int, status: int, reason: str) -> _Refused:
        """Count, log (rate-limited) and record one refusal; the error to answer with."""
        denial = EgressDenial(host, port, reason)
        now = time.monotonic()
        with self._lock:
            self._denied += 1
            record = self._denied <= TIMELINE_LIMIT
            if now - self._window_start >= LOG_WINDOW:
                self._window_start, self._window_count = now, 0
            self._window_count += 1
            logged = self._window_count <= LOG_BURST
            unlogged, self._unlogged = (self._unlogged, 0) if logged else (0, self._unlogged + 1)
        if logged:
            more = f" ({unlogged} more refusals not logged)" if unlogged else ""
            log.warning("sandbox %s: egress to %s:%d refused: %s%s", self.name, host, port, reason, more)
        scope = self.scope
        if record and scope is not None:
            scope.record("egress_denied", sandbox=self.name, host=denial.host, port=port, reason=reason)
        return _Refused(status, f"egress to {host}:{port} refused: {reason}")


def _request_line(line: str) -> tuple[str, str, str]:
    parts = line.split(" ")
    if len(parts) != 3 or not parts[2].startswith("HTTP/"):
        raise _Refused(400, "not an HTTP proxy request")
    return parts[0].upper(), parts[1], parts[2]


def _destination(method: str, target: str) -> tuple[str, int]:
    """``host, port`` of a CONNECT authority or an absolute-form ``http://`` request."""
    if method == "CONNECT":
        parsed = urlsplit(f"//{target}")
        default = None
    else:
        parsed = urlsplit(target)
        if parsed.scheme != "http":
            raise _Refused(400, "only CONNECT and absolute http:// requests go through this proxy")
        default = 80
    try:
        port = parsed.port or default
    except ValueError:
        port = None
    host = (parsed.hostname or "").rstrip(".")
    if not host or port is None:
        raise _Refused(400, f"bad proxy target {target!r}")
    return host, port


def _address(host: str) -> IPAddress | None:
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        return None


def _system_resolver(host: str) -> list[str]:
    infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    return list(dict.fromkeys(str(info[4][0]) for info in infos))


def _origin_request(method: str, target: str, version: str, headers: list[str]) -> bytes:
    """The absolute-form request as the origin server expects it: origin-form target, no
    ``Proxy-*`` headers, and ``Connection: close`` (the next request on a kept-alive client
    connection may be for another host, which must be decided again)."""
    parsed = urlsplit(target)
    path = parsed.path or "/"
    if parsed.query:
        path += f"?{parsed.query}"
    kept = [h for h in headers if h and not h.lower().startswith(("proxy-", "connection:", "keep-alive:"))]
    return "\r\n".join([f"{method} {path} {version}", *kept, "Connection: close", "", ""]).encode("latin-1")


def _refusal(refused: _Refused) -> bytes:
    body = f"cancellable-agents sandbox: {refused.reason}\n".encode()
    phrase = {400: "Bad Request", 403: "Forbidden", 502: "Bad Gateway", 503: "Service Unavailable"}[
        refused.status
    ]
    head = f"HTTP/1.1 {refused.status} {phrase}\r\nContent-Type: text/plain\r\n"
    head += f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    return head.encode() + body


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Copy until EOF, then pass the EOF on (half-close: the other direction may go on)."""
    try:
        while data := await reader.read(CHUNK):
            writer.write(data)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()
    except OSError:
        writer.close()


# -- inside the sandbox ---------------------------------------------------------------------

#: Run by the sandbox's interpreter before the command: listen on 127.0.0.1:PORT, fork a
#: forwarder to the unix socket, exec the command (which keeps the pid, exit status and
#: signals the sandbox watches). The forwarder dies with the PID namespace when the command ends.
FORWARDER = r"""
import os, socket, sys
path, port, argv = sys.argv[1], int(sys.argv[2]), sys.argv[4:]
listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
listener.bind(("127.0.0.1", port))
listener.listen(128)
if os.fork() == 0:
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    import asyncio

    async def pipe(reader, writer):
        try:
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
            writer.write_eof()
        except OSError:
            writer.close()

    async def handle(reader, writer):
        try:
            up_reader, up_writer = await asyncio.open_unix_connection(path)
        except OSError:
            writer.close()
            return
        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))
        writer.close()
        up_writer.close()

    async def main():
        server = await asyncio.start_server(handle, sock=listener)
        await server.serve_forever()

    asyncio.run(main())
    os._exit(0)
listener.close()
try:
    os.execvp(argv[0], argv)
except OSError as exc:
    sys.stderr.write(f"{argv[0]}: {exc.strerror}\n")
    os._exit(127)
"""


def forwarder_argv(python: str) -> list[str]:
    """What goes before the command's argv inside the sandbox (``python`` is visible there)."""
    return [python, "-I", "-S", "-c", FORWARDER, EGRESS_SOCKET, str(PROXY_PORT), "--"]


def proxy_env() -> dict[str, str]:
    """The variables that point HTTP clients (curl, pip, git, urllib, requests) at the proxy.
    ``NO_PROXY``: loopback inside the sandbox is the sandbox's own."""
    url = f"http://127.0.0.1:{PROXY_PORT}"
    env = {name: url for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY")}
    env |= {name.lower(): url for name in env}
    no_proxy = "localhost,127.0.0.1,::1"
    return env | {"NO_PROXY": no_proxy, "no_proxy": no_proxy}
