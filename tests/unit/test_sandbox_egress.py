"""The egress allowlist without a sandbox: the policy's rules and the proxy, spoken to over its
unix socket as the in-sandbox forwarder would, with local servers on loopback under test names
(the proxy's resolver hook). Never an outside address. The proxy inside a real sandbox:
``tests/process/test_sandbox_egress.py``."""

from __future__ import annotations

import ipaddress
import logging
import socket
import threading
from collections.abc import Iterator

import pytest

from cancellable_agents.core.scope import TaskCancellation
from cancellable_agents.toolsets.sandbox import LocalSandbox, egress
from cancellable_agents.toolsets.sandbox.egress import LOG_BURST, EgressProxy, proxy_env
from cancellable_agents.toolsets.sandbox.egress_policy import DEFAULT_PORTS, EgressPolicy, HostRule

pytestmark = pytest.mark.timeout(60)

#: The proxy's refusals (other loggers may log at INFO here, as Airflow's config sets).
EGRESS_LOGGER = "cancellable_agents.toolsets.sandbox.egress"


# -- the policy -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("entry", "host", "ports"),
    [
        ("PyPI.org", "pypi.org", DEFAULT_PORTS),
        ("pypi.org:8443", "pypi.org", frozenset({8443})),
        ("*.githubusercontent.com:*", "*.githubusercontent.com", None),
        ("10.0.0.0/8", "10.0.0.0/8", DEFAULT_PORTS),
        ("[::1]:80", "::1/128", frozenset({80})),
        ("127.0.0.1", "127.0.0.1/32", DEFAULT_PORTS),
    ],
)
def test_rules_parse(entry: str, host: str, ports: frozenset[int] | None) -> None:
    rule = HostRule.parse(entry)
    assert (rule.host, rule.ports) == (host, ports)


@pytest.mark.parametrize("entry", ["pypi.org:0", "pypi.org:http", "a..b", "exa mple.com", "[::1", "*foo.com"])
def test_bad_rules_are_refused(entry: str) -> None:
    with pytest.raises(ValueError, match="egress rule"):
        HostRule.parse(entry)


def test_a_policy_is_a_list_of_hosts_not_a_string() -> None:
    with pytest.raises(TypeError):
        EgressPolicy("pypi.org")  # type: ignore[arg-type]
    assert EgressPolicy.coerce(["pypi.org"]) == EgressPolicy(("pypi.org",))
    assert EgressPolicy.coerce(True) is True


def test_wildcards_ports_and_literal_addresses() -> None:
    policy = EgressPolicy(["*.githubusercontent.com", "pypi.org:443"])
    assert policy.permits("raw.githubusercontent.com", None, 443)
    assert policy.permits("a.b.githubusercontent.com", None, 80)
    assert not policy.permits("githubusercontent.com", None, 443)  # the apex is not a subdomain
    assert not policy.permits("evilgithubusercontent.com", None, 443)
    assert policy.permits("pypi.org", None, 443) and not policy.permits("pypi.org", None, 80)
    # An address typed in directly needs an address rule, whatever the names resolve to.
    assert not policy.permits("151.101.0.223", ipaddress.ip_address("151.101.0.223"), 443)


@pytest.mark.parametrize(
    "address",
    [
        "127.0.0.1",
        "10.1.2.3",
        "172.16.0.1",
        "192.168.1.1",
        "169.254.169.254",  # the cloud metadata service
        "100.64.0.1",
        "0.0.0.0",
        "224.0.0.1",
        "::1",
        "fe80::1",
        "fd00::1",
        "::ffff:127.0.0.1",  # IPv4-mapped
        "2002:7f00:1::",  # 6to4 wrapping 127.0.0.1
        "64:ff9b::a00:1",  # NAT64 wrapping 10.0.0.1
    ],
)
def test_special_addresses_are_unreachable_unless_listed(address: str) -> None:
    ip = ipaddress.ip_address(address)
    assert not EgressPolicy(["*"]).reachable(ip)
    assert EgressPolicy(["*", address]).reachable(ip)


def test_public_addresses_are_reachable() -> None:
    assert EgressPolicy(["*"]).reachable(ipaddress.ip_address("151.101.0.223"))
    assert EgressPolicy(["*"]).reachable(ipaddress.ip_address("2a04:4e42::223"))


def test_proxy_env_points_every_client_at_the_forwarder() -> None:
    env = proxy_env()
    assert {env[k] for k in ("HTTP_PROXY", "https_proxy", "ALL_PROXY")} == {"http://127.0.0.1:3128"}


# -- the proxy ------------------------------------------------------------------------------


class Origin:
    """A TCP server on loopback answering each connection with a fixed HTTP response."""

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.requests: list[bytes] = []
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            with conn:
                conn.settimeout(10)
                self.requests.append(_read_head(conn))
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 6\r\nConnection: close\r\n\r\norigin")

    def close(self) -> None:
        self.listener.close()


def _read_head(conn: socket.socket) -> bytes:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = conn.recv(4096)
        if not chunk:
            break
        data += chunk
    return data


@pytest.fixture
def origin() -> Iterator[Origin]:
    server = Origin()
    yield server
    server.close()


NAMES = {"allowed.test": ["127.0.0.1"], "private.test": ["10.20.30.40"], "denied.test": ["127.0.0.1"]}


def _proxy(*allow: str, scope: TaskCancellation | None = None) -> EgressProxy:
    proxy = EgressProxy(EgressPolicy(allow, resolver=lambda host: NAMES[host]), name="t").start()
    proxy.scope = scope
    return proxy


def _ask(proxy: EgressProxy, request: str) -> bytes:
    """Send one request over the proxy's unix socket; everything it answers until it closes."""
    with socket.socket(socket.AF_UNIX) as conn:
        conn.settimeout(10)
        conn.connect(proxy.socket_path)
        conn.sendall(request.encode())
        if request.startswith("CONNECT"):
            reply = _read_head(conn)
            if b" 200 " not in reply.split(b"\r\n")[0]:
                return reply
            conn.sendall(b"GET /through HTTP/1.1\r\nHost: x\r\n\r\n")
        else:
            reply = b""
        while chunk := conn.recv(4096):
            reply += chunk
        return reply


def _connect(host: str, port: int) -> str:
    return f"CONNECT {host}:{port} HTTP/1.1\r\nHost: {host}:{port}\r\n\r\n"


def test_a_listed_name_reaches_its_server_only_with_its_loopback_address_listed(origin: Origin) -> None:
    listed = _proxy(f"allowed.test:{origin.port}", "127.0.0.1")
    unlisted = _proxy(f"allowed.test:{origin.port}")
    try:
        assert _ask(listed, _connect("allowed.test", origin.port)).endswith(b"origin")
        refused = _ask(unlisted, _connect("allowed.test", origin.port))
        assert refused.startswith(b"HTTP/1.1 403") and b"loopback/private" in refused
        assert len(origin.requests) == 1  # the refused request never reached the server
    finally:
        listed.close()
        unlisted.close()


def test_plain_http_goes_to_the_origin_without_proxy_headers(origin: Origin) -> None:
    proxy = _proxy(f"allowed.test:{origin.port}", "127.0.0.1")
    try:
        request = (
            f"GET http://allowed.test:{origin.port}/a?b=1 HTTP/1.1\r\nHost: allowed.test\r\n"
            "Proxy-Authorization: secret\r\nProxy-Connection: keep-alive\r\n\r\n"
        )
        assert _ask(proxy, request).endswith(b"origin")
        seen = origin.requests[0].decode()
        assert seen.startswith("GET /a?b=1 HTTP/1.1\r\n") and "Proxy-" not in seen
        assert "Connection: close" in seen
    finally:
        proxy.close()


@pytest.mark.parametrize(
    ("target", "why"),
    [
        ("denied.test", b"not on the sandbox's egress allowlist"),  # not listed
        ("127.0.0.1", b"not on the sandbox's egress allowlist"),  # loopback typed in
        ("private.test", b"loopback/private"),  # listed, resolves to a private address
    ],
)
def test_refusals_are_answered_logged_and_on_the_timeline(
    origin: Origin, target: str, why: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    scope = TaskCancellation("t", budget=5)
    proxy = _proxy(f"allowed.test:{origin.port}", f"private.test:{origin.port}", scope=scope)
    try:
        with caplog.at_level(logging.WARNING, logger=EGRESS_LOGGER):
            reply = _ask(proxy, _connect(target, origin.port))
        assert reply.startswith(b"HTTP/1.1 403") and why in reply
        assert origin.requests == []
        [logged] = [r.getMessage() for r in caplog.records if r.name == EGRESS_LOGGER]
        assert logged.startswith(f"sandbox t: egress to {target}:{origin.port} refused: ")
        assert why.decode() in logged
        [event] = [e.detail for e in scope.timeline if e.event == "egress_denied"]
        assert (event["sandbox"], event["host"], event["port"]) == ("t", target, origin.port)
        assert why.decode() in event["reason"]
    finally:
        proxy.close()


def test_a_flood_of_refusals_is_logged_at_a_bounded_rate(caplog: pytest.LogCaptureFixture) -> None:
    scope = TaskCancellation("t", budget=5)
    proxy = _proxy("allowed.test", scope=scope)
    try:
        with caplog.at_level(logging.WARNING, logger=EGRESS_LOGGER):
            for _ in range(LOG_BURST * 3):
                _ask(proxy, _connect("denied.test", 443))
        assert proxy.denied == LOG_BURST * 3
        assert len([r for r in caplog.records if r.name == EGRESS_LOGGER]) == LOG_BURST
        assert len([e for e in scope.timeline if e.event == "egress_denied"]) == LOG_BURST * 3
    finally:
        proxy.close()


@pytest.mark.parametrize("request_text", ["GET https://allowed.test/ HTTP/1.1\r\n\r\n", "hello\r\n\r\n"])
def test_requests_it_does_not_understand_are_refused(request_text: str) -> None:
    proxy = _proxy("allowed.test")
    try:
        assert _ask(proxy, request_text).startswith(b"HTTP/1.1 400")
    finally:
        proxy.close()


def test_close_ends_open_tunnels_and_removes_the_socket() -> None:
    """A tunnel to a server that never answers is cut, both sides, when the proxy closes."""
    silent = socket.create_server(("127.0.0.1", 0))
    port = silent.getsockname()[1]
    proxy = _proxy(f"allowed.test:{port}", "127.0.0.1")
    client = socket.socket(socket.AF_UNIX)
    try:
        client.settimeout(10)
        client.connect(proxy.socket_path)
        client.sendall(_connect("allowed.test", port).encode())
        assert _read_head(client).startswith(b"HTTP/1.1 200")
        silent.settimeout(10)
        upstream, _ = silent.accept()
        assert proxy.open_connections == 1
        proxy.close()
        assert proxy.open_connections == 0
        assert client.recv(1) == b""
        with upstream:
            upstream.settimeout(10)
            assert upstream.recv(1) == b""
        with pytest.raises(OSError):
            _ask(proxy, _connect("allowed.test", port))
    finally:
        client.close()
        silent.close()


# -- where an allowlist cannot be enforced --------------------------------------------------


def test_the_host_profile_refuses_an_allowlist() -> None:
    with pytest.raises(ValueError, match="egress allowlist needs profile='boundary'"):
        LocalSandbox(isolation="process-group", profile="host", network=["pypi.org"])


def test_process_group_mode_says_the_allowlist_is_not_enforced(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="cancellable_agents.toolsets.sandbox.local"):
        box = LocalSandbox(isolation="process-group", network=["pypi.org"])
    try:
        assert box.egress is None and box.network is False
        assert any("no egress allowlist" in r.getMessage() for r in caplog.records)
    finally:
        box.destroy()


def test_connections_past_the_cap_are_answered_503(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(egress, "MAX_CONNECTIONS", 1)
    silent = socket.create_server(("127.0.0.1", 0))
    port = silent.getsockname()[1]
    proxy = _proxy(f"allowed.test:{port}", "127.0.0.1")
    held = socket.socket(socket.AF_UNIX)
    try:
        held.settimeout(10)
        held.connect(proxy.socket_path)
        held.sendall(_connect("allowed.test", port).encode())
        assert _read_head(held).startswith(b"HTTP/1.1 200")
        assert _ask(proxy, _connect("allowed.test", port)).startswith(b"HTTP/1.1 503")
    finally:
        held.close()
        proxy.close()
        silent.close()
