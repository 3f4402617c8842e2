"""The egress allowlist: a sandbox without a network that reaches listed hosts through a proxy.

``LocalSandbox(network=["pypi.org", "*.githubusercontent.com"])`` (or an [`EgressPolicy`][])
keeps the boundary profile's network namespace, where only ``lo`` exists, and gives commands an
HTTP proxy (``CONNECT`` for HTTPS and anything else over TCP, absolute-form requests for plain
HTTP):

- [`EgressProxy`][] runs in the task process, outside the sandbox, on a unix socket that is
  bind-mounted into the sandbox (a unix socket needs no network). It allows only hosts and ports the
  policy lists, resolves names itself and connects to the address it checked (so a name that
  resolves to a public address for the check and a private one for the connection — DNS rebinding —
  gets nowhere), and refuses loopback, link-local, private, multicast and reserved addresses unless
  the policy lists the address (or its network) itself, on that entry's ports. A request it cannot
  read for certain
  ([`egress_request`][cancellable_agents.toolsets.sandbox.local.boundary._egress_request]) is
  answered 400 before anything is resolved or connected. Each refusal is one log line (rate-limited)
  and an ``egress_denied`` event on the task's timeline (bounded); no request, however malformed,
  ends in a traceback or leaves a connection open.
- ``FORWARDER`` runs inside the sandbox, before the command: it listens on
  ``127.0.0.1:PROXY_PORT`` in the sandbox's own namespace and carries each connection to the
  unix socket, then the command runs with ``HTTP(S)_PROXY``/``ALL_PROXY`` pointing there.

Why a proxy of ours and not a library: the allowlist must be decided on the address the proxy
itself resolved and then connect to exactly that address, with a resolver tests can replace;
the maintained Python proxies (``proxy.py``, ``mitmproxy``) are frameworks with their own
process and plugin model, TLS interception and their own resolution, much more than a CONNECT
tunnel needs. This is asyncio streams on one thread, a few hundred lines. No TLS is
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
import weakref
from collections.abc import Callable
from typing import Protocol

from cancellable_agents.core.scope import TaskCancellation
from cancellable_agents.toolsets.sandbox.egress_policy import (
    EgressDenial,
    EgressPolicy,
    IPAddress,
    Resolver,
)
from cancellable_agents.toolsets.sandbox.local.boundary._egress_request import (
    BadRequest,
    ProxyRequest,
    parse_head,
)

__all__ = [
    "EGRESS_SOCKET",
    "FORWARDER",
    "PROXY_PORT",
    "EgressProxy",
    "SandboxEgress",
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
#: How long a connection past ``MAX_CONNECTIONS`` may take to send its request head before its 503.
CROWDED_HEAD_WAIT = 1.0
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

    [`start`][] returns once it listens; [`close`][] closes every connection and the socket
    (idempotent, bounded). Refusals go to the log and, where ``scope_of()`` names a scope (its
    sandbox's, read at each refusal: the sandbox may attach after its proxy started), to that
    scope's timeline (``egress_denied``).
    """

    def __init__(
        self,
        policy: EgressPolicy,
        *,
        name: str = "egress",
        scope_of: Callable[[], TaskCancellation | None] = lambda: None,
    ) -> None:
        self.policy = policy
        self.name = name
        self._scope_of = scope_of
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
        scope = self._scope_of()
        if unrecorded > 0 and scope is not None:
            scope.record("egress_denials_not_recorded", sandbox=self.name, count=unrecorded)

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
        try:
            if crowded:
                await _read_head_briefly(reader)
                writer.write(_refusal(_Refused(503, f"more than {MAX_CONNECTIONS} connections at once")))
                await writer.drain()
            else:
                await self._serve(reader, writer)
        except (OSError, TimeoutError):
            pass  # the client or the origin went away mid-answer: nothing left to tell anyone
        except asyncio.CancelledError:
            # Closing: end quietly (asyncio logs a connection task that ends cancelled as an error).
            pass
        except Exception as exc:
            # Never reached by a request the proxy reads (those end in a refusal); a last guard
            # because every byte here is a command's, and asyncio would log each one with a
            # traceback at ERROR: a one-line warning, rate-limited like the refusals.
            self._log_limited("sandbox %s: egress proxy dropped a connection: %r", self.name, exc)
        finally:
            # Counted out before the client's side closes: once a client reads EOF, the proxy
            # holds nothing for it (the upstream, if any, was closed in _serve).
            with self._lock:
                self._open -= 1
            writer.close()
            self._tasks.discard(task)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Read one request, decide it, answer or tunnel; the upstream connection, once open,
        is closed here whatever happens."""
        try:
            request = await self._request(reader)
            if request is None:
                return  # connected and closed without a byte: nothing was asked
            upstream_reader, upstream = await self._connect(request)
        except _Refused as refused:
            writer.write(_refusal(refused))
            await writer.drain()
            return
        try:
            if request.forward is None:
                writer.write(b"HTTP/1.1 200 Connection established\r\n\r\n")
            else:
                upstream.write(request.forward)
            await asyncio.gather(_pipe(reader, upstream), _pipe(upstream_reader, writer))
        finally:
            upstream.close()

    async def _request(self, reader: asyncio.StreamReader) -> ProxyRequest | None:
        """The request head, read and parsed; ``None`` if the client sent nothing at all.
        Raises [`_Refused`][] (counted as a denial) for a head it will not read."""
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), HEAD_TIMEOUT)
        except asyncio.LimitOverrunError:
            raise self._deny(400, f"request head longer than {HEAD_LIMIT} bytes") from None
        except TimeoutError:
            raise self._deny(400, f"no complete request head within {HEAD_TIMEOUT:g} s") from None
        except asyncio.IncompleteReadError as exc:
            if not exc.partial:
                return None
            raise self._deny(400, "the connection ended inside the request head") from None
        try:
            return parse_head(head)
        except BadRequest as exc:
            raise self._deny(400, str(exc)) from None

    async def _connect(self, request: ProxyRequest) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """Check the request against the policy, resolve its host, connect to a checked address."""
        host, port = request.host, request.port
        if not self.policy.permits(host, request.address, port):
            raise self._deny(403, "not on the sandbox's egress allowlist", host, port)
        addresses = [request.address] if request.address is not None else await self._resolve(host)
        reachable = [a for a in addresses if self.policy.reachable(a, port)]
        if not reachable:
            shown = ", ".join(str(a) for a in addresses)
            raise self._deny(403, f"resolves to a loopback/private/link-local address ({shown})", host, port)
        error: Exception | None = None
        for address in reachable:
            try:
                return await asyncio.wait_for(asyncio.open_connection(str(address), port), CONNECT_TIMEOUT)
            except (OSError, TimeoutError) as exc:
                error = exc
        raise _Refused(502, f"cannot connect to {host}:{port}: {error}")

    async def _resolve(self, host: str) -> list[IPAddress]:
        loop = asyncio.get_running_loop()
        try:
            found = await asyncio.wait_for(loop.run_in_executor(None, self._resolver, host), RESOLVE_TIMEOUT)
        except Exception as exc:
            # Any failure of the resolver (OSError, the idna codec's UnicodeError, a test
            # resolver's KeyError) is the same answer: the name has no address for us.
            raise _Refused(502, f"cannot resolve {host}: {type(exc).__name__}: {exc}") from None
        addresses = [a for a in (_address(text) for text in found) if a is not None]
        if not addresses:
            raise _Refused(502, f"cannot resolve {host}")
        return addresses

    def _deny(self, status: int, reason: str, host: str | None = None, port: int | None = None) -> _Refused:
        """Count, log (rate-limited) and record one refusal; the error to answer with. ``host``
        and ``port`` ``None``: the request was refused before it named them (malformed)."""
        denial = EgressDenial(host, port, reason)
        with self._lock:
            self._denied += 1
            record = self._denied <= TIMELINE_LIMIT
        what = "request" if host is None else f"to [{host}]:{port}" if ":" in host else f"to {host}:{port}"
        self._log_limited("sandbox %s: egress %s refused: %s", self.name, what, reason)
        scope = self._scope_of() if record else None
        if scope is not None:
            scope.record("egress_denied", sandbox=self.name, host=denial.host, port=port, reason=reason)
        return _Refused(status, f"egress {what} refused: {reason}")

    def _log_limited(self, message: str, *args: object) -> None:
        """One warning, unless ``LOG_BURST`` were logged in this ``LOG_WINDOW``; the next one
        logged says how many were not (a command can send thousands of bad requests)."""
        now = time.monotonic()
        with self._lock:
            if now - self._window_start >= LOG_WINDOW:
                self._window_start, self._window_count = now, 0
            self._window_count += 1
            logged = self._window_count <= LOG_BURST
            unlogged, self._unlogged = (self._unlogged, 0) if logged else (0, self._unlogged + 1)
        if logged:
            more = f" ({unlogged} more refusals not logged)" if unlogged else ""
            log.warning(message + "%s", *args, more)


def _address(host: str) -> IPAddress | None:
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        return None


def _system_resolver(host: str) -> list[str]:
    infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    return list(dict.fromkeys(str(info[4][0]) for info in infos))


async def _read_head_briefly(reader: asyncio.StreamReader) -> None:
    """Take the request before answering it, as HTTP has it: answered and closed while it still
    wrote its request, a client gets EPIPE instead of the answer (seen under load)."""
    with contextlib.suppress(asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError):
        await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), CROWDED_HEAD_WAIT)


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


# -- the sandbox's side -------------------------------------------------------------------------


class _Proxied(Protocol):
    """What a sandbox's proxy reads of it: its id, its allowlist, and the scope the proxy
    records its refusals on; the proxy it started is kept in ``_proxy``."""

    id: str
    egress: EgressPolicy | None
    _proxy: EgressProxy | None

    @property
    def scope(self) -> TaskCancellation | None: ...


class SandboxEgress:
    """A sandbox's side of its egress proxy (mixed into
    [`LocalSandbox`][cancellable_agents.toolsets.sandbox.local._sandbox.LocalSandbox]): the proxy is
    started when the sandbox has an allowlist, its socket is shown inside the sandbox, its
    refusals are recorded on the sandbox's scope."""

    _proxy: EgressProxy | None

    def _egress_sockets(self: _Proxied) -> tuple[tuple[str, str], ...]:
        """Start the egress proxy of a sandbox with an allowlist; its socket, shown inside."""
        if self.egress is None:
            return ()
        proxy = EgressProxy(self.egress, name=self.id, scope_of=_scope_of(self)).start()
        self._proxy = proxy
        # A sandbox nobody destroyed does not leave its proxy listening.
        weakref.finalize(self, proxy.close)
        return ((proxy.socket_path, EGRESS_SOCKET),)


def _scope_of(sandbox: _Proxied) -> Callable[[], TaskCancellation | None]:
    """``sandbox.scope`` read at each call, weakly: the egress proxy records its refusals there,
    and must not keep its sandbox alive (the sandbox's finalizer closes the proxy)."""
    ref = weakref.ref(sandbox)

    def scope() -> TaskCancellation | None:
        alive = ref()
        return None if alive is None else alive.scope

    return scope
