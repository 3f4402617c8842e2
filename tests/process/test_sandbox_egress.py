"""The egress allowlist in a real boundary-profile sandbox (issue 21, item 5): a command reaches
listed hosts through the proxy and nothing else, with no network of its own, and a kill during
a proxied download unwinds within the budget. The servers are local, on loopback, under test
names (the policy's resolver); no outside address is ever contacted. Each check has a control
that shows it could fail (no allowlist, ``network=True``, the address listed)."""

from __future__ import annotations

import http.server
import json
import logging
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from cancellable_agents.core.causes import CancelCause
from cancellable_agents.core.scope import TaskCancellation
from cancellable_agents.toolsets.sandbox import EgressPolicy, LocalSandbox, bwrap_support

pytestmark = [
    pytest.mark.process,
    pytest.mark.timeout(120),
    pytest.mark.skipif(
        not bwrap_support().boundary, reason=f"no boundary profile here: {bwrap_support().boundary_reason}"
    ),
]
#: The proxy's refusals, one line each (other loggers may log at INFO here, as Airflow's config sets).
EGRESS_LOGGER = "cancellable_agents.toolsets.sandbox.local.boundary._egress_proxy"

#: Test names -> addresses, for the proxy's resolver: servers on loopback, a private address.
NAMES = {"allowed.test": ["127.0.0.1"], "denied.test": ["127.0.0.1"], "private.test": ["10.20.30.40"]}
CHUNK_INTERVAL = 0.05


class Origin(http.server.ThreadingHTTPServer):
    """``/hello`` answers ``hello``; ``/slow`` sends a chunk every ``CHUNK_INTERVAL`` until the
    client goes away (``download_started`` once the first is out, ``download_ended`` when the
    connection is gone)."""

    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.port = self.server_address[1]
        self.download_started = threading.Event()
        self.download_ended = threading.Event()


class _Handler(http.server.BaseHTTPRequestHandler):
    server: Origin

    def do_GET(self) -> None:
        if self.path == "/slow":
            self._slow()
            return
        self.send_response(200)
        self.send_header("Content-Length", "5")
        self.end_headers()
        self.wfile.write(b"hello")

    def _slow(self) -> None:
        self.send_response(200)
        self.end_headers()
        try:
            while True:
                self.wfile.write(b"x" * 1024)
                self.wfile.flush()
                self.server.download_started.set()
                time.sleep(CHUNK_INTERVAL)  # the pace of a slow download, not a synchronisation
        except OSError:
            self.server.download_ended.set()

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def origin() -> Iterator[Origin]:
    server = Origin()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def _policy(*allow: str) -> EgressPolicy:
    return EgressPolicy(allow, resolver=lambda host: NAMES[host])


#: A download with urllib, which takes its proxy from the environment: status and body, or why not.
FETCH = """
import json, sys, urllib.error, urllib.request
try:
    with urllib.request.urlopen(sys.argv[1], timeout=20) as response:
        print(json.dumps([response.status, response.read().decode()]))
except urllib.error.HTTPError as exc:
    print(json.dumps([exc.code, exc.read().decode()]))
except OSError as exc:
    print(json.dumps([None, str(exc)]))
"""

#: An HTTPS-style tunnel by hand: CONNECT through the forwarder, then a request through it.
TUNNEL = """
import socket, sys
conn = socket.create_connection(("127.0.0.1", 3128), timeout=20)
conn.sendall(f"CONNECT {sys.argv[1]} HTTP/1.1\\r\\n\\r\\n".encode())
reply = b""
while b"\\r\\n\\r\\n" not in reply:
    reply += conn.recv(4096)
print(reply.split(b"\\r\\n")[0].decode())
if b" 200 " in reply.split(b"\\r\\n")[0]:
    conn.sendall(b"GET /hello HTTP/1.1\\r\\nHost: x\\r\\nConnection: close\\r\\n\\r\\n")
    while chunk := conn.recv(4096):
        reply += chunk
    print(reply.rsplit(b"\\r\\n\\r\\n", 1)[-1].decode())
"""

#: What a command can reach without the proxy: the interfaces, a server on the host's loopback,
#: an address off this host (TEST-NET-1: routed nowhere, it only shows whether a route exists).
DIRECT = """
import json, socket, sys
interfaces = [line.split(":")[0].strip() for line in open("/proc/net/dev").readlines()[2:]]
seen = {"interfaces": interfaces}
for name, address in (("host_loopback", ("127.0.0.1", int(sys.argv[1]))), ("off_host", ("192.0.2.1", 80))):
    try:
        socket.create_connection(address, timeout=2).close()
        seen[name] = "connected"
    except OSError as exc:
        seen[name] = type(exc).__name__
print(json.dumps(seen))
"""


def _run(box: LocalSandbox, script: str, *args: str) -> Any:
    result = box.run([sys.executable, "-c", script, *args], timeout=60)
    assert result.exit_code == 0, result
    lines = result.stdout.strip().splitlines()
    return json.loads(lines[-1]) if script is not TUNNEL else lines


def test_a_listed_host_is_reachable_through_the_proxy_and_only_through_it(origin: Origin) -> None:
    url = f"http://allowed.test:{origin.port}/hello"
    box = LocalSandbox(
        isolation="namespace", network=_policy(f"allowed.test:{origin.port}", f"127.0.0.1:{origin.port}")
    )
    try:
        assert _run(box, FETCH, url) == [200, "hello"]
        assert _run(box, TUNNEL, f"allowed.test:{origin.port}") == [
            "HTTP/1.1 200 Connection established",
            "hello",
        ]
    finally:
        box.destroy()
    # Control: without an allowlist the same command has no way out.
    box = LocalSandbox(isolation="namespace")
    try:
        status, _ = _run(box, FETCH, url)
        assert status is None
    finally:
        box.destroy()


def test_there_is_no_direct_way_out(origin: Origin) -> None:
    box = LocalSandbox(
        isolation="namespace", network=_policy(f"allowed.test:{origin.port}", f"127.0.0.1:{origin.port}")
    )
    try:
        seen = _run(box, DIRECT, str(origin.port))
    finally:
        box.destroy()
    assert seen["interfaces"] == ["lo"]
    # The loopback inside is the sandbox's own (only the forwarder listens there).
    assert seen["host_loopback"] == "ConnectionRefusedError"
    assert seen["off_host"] != "connected"
    # Control: network=True ("no boundary for the network") reaches the host's loopback.
    box = LocalSandbox(isolation="namespace", network=True)
    try:
        assert _run(box, DIRECT, str(origin.port))["host_loopback"] == "connected"
    finally:
        box.destroy()


@pytest.mark.parametrize(
    ("url_host", "extra", "status", "why"),
    [
        ("denied.test", "127.0.0.1:{port}", 403, "not on the sandbox's egress allowlist"),
        ("127.0.0.1", "", 403, "not on the sandbox's egress allowlist"),  # loopback, unlisted
        ("allowed.test", "", 403, "resolves to a loopback/private/link-local address (127.0.0.1)"),
        # Loopback listed, but on its ports 80 and 443 only (an entry's ports bound its address).
        ("allowed.test", "127.0.0.1", 403, "resolves to a loopback/private/link-local address (127.0.0.1)"),
        ("private.test", "", 403, "resolves to a loopback/private/link-local address (10.20.30.40)"),
        ("allowed.test", "127.0.0.1:{port}", 200, None),  # control: loopback listed with the port
    ],
)
def test_refusals_reach_the_command_the_log_and_the_kill_records_timeline(
    origin: Origin, url_host: str, extra: str, status: int, why: str | None, caplog: pytest.LogCaptureFixture
) -> None:
    scope = TaskCancellation("t", budget=5)
    allow = [f"allowed.test:{origin.port}", f"private.test:{origin.port}"]
    allow += [extra.format(port=origin.port)] if extra else []
    # The proxy for every address (loopback inside is the sandbox's own, so NO_PROXY lists it).
    direct = {"NO_PROXY": "", "no_proxy": ""}
    box = LocalSandbox(isolation="namespace", network=_policy(*allow), scope=scope, env=direct)
    with caplog.at_level(logging.WARNING, logger=EGRESS_LOGGER):
        got, body = _run(box, FETCH, f"http://{url_host}:{origin.port}/hello")
    scope.cancel(CancelCause.USER)
    assert scope.wait_released(10)
    assert got == status
    denials = [e.detail for e in scope.timeline if e.event == "egress_denied"]
    logged = [r.getMessage() for r in caplog.records if r.name == EGRESS_LOGGER]
    if why is None:
        assert body == "hello" and denials == [] and logged == []
        return
    assert why in body
    assert denials == [{"sandbox": box.id, "host": url_host, "port": origin.port, "reason": why}]
    assert logged == [f"sandbox {box.id}: egress to {url_host}:{origin.port} refused: {why}"]


def test_loopback_in_any_spelling_reaches_only_its_listed_port(origin: Origin) -> None:
    """``["*:*", "127.0.0.1:LISTED"]`` from a real command: loopback's other ports stay shut
    however the address is written (``inet_aton``'s spellings are addresses, never names that
    ``*`` lets through); the listed port answers to all of them (the control)."""
    listed = Origin()
    threading.Thread(target=listed.serve_forever, daemon=True).start()
    direct = {"NO_PROXY": "", "no_proxy": ""}
    box = LocalSandbox(isolation="namespace", network=_policy("*:*", f"127.0.0.1:{listed.port}"), env=direct)
    try:
        for host in ("2130706433", "0x7f000001", "0177.0.0.1", "127.1"):
            status, body = _run(box, FETCH, f"http://{host}:{origin.port}/hello")
            assert status == 403 and f"egress to 127.0.0.1:{origin.port} refused" in body, (host, body)
            assert _run(box, FETCH, f"http://{host}:{listed.port}/hello") == [200, "hello"], host
    finally:
        box.destroy()
        listed.shutdown()
        listed.server_close()


def test_a_kill_during_a_proxied_download_unwinds_within_the_budget(origin: Origin) -> None:
    scope = TaskCancellation("t", budget=5)
    box = LocalSandbox(
        isolation="namespace",
        network=_policy(f"allowed.test:{origin.port}", f"127.0.0.1:{origin.port}"),
        scope=scope,
    )
    proxy = box._proxy
    assert proxy is not None
    command = box.start([sys.executable, "-c", FETCH, f"http://allowed.test:{origin.port}/slow"])
    assert origin.download_started.wait(30)
    assert proxy.open_connections == 1
    scope.cancel(CancelCause.USER)
    assert scope.wait_released(scope.budget + 5)
    events = {e.event: e.at for e in scope.timeline}
    assert events["resources_released"] - events["kill_received"] <= scope.budget
    assert scope.stragglers == []
    assert box.wait(command, timeout=1).stopped
    assert proxy.open_connections == 0
    assert origin.download_ended.wait(10)  # the proxy's upstream connection is closed too
