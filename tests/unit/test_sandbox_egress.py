"""The egress allowlist without a sandbox: the policy's rules and the proxy, spoken to over its
unix socket as the in-sandbox forwarder would, with local servers on loopback under test names
(the proxy's resolver hook). Never an outside address. The proxy inside a real sandbox:
``tests/process/test_sandbox_egress.py``."""

from __future__ import annotations

import ipaddress
import itertools
import logging
import socket
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

from cancellable_agents.core.scope import TaskCancellation
from cancellable_agents.toolsets.sandbox import LocalSandbox
from cancellable_agents.toolsets.sandbox.egress_policy import (
    DEFAULT_PORTS,
    EgressPolicy,
    HostRule,
    canonical_host,
)
from cancellable_agents.toolsets.sandbox.local.boundary import _egress_proxy as egress_proxy
from cancellable_agents.toolsets.sandbox.local.boundary._egress_proxy import (
    LOG_BURST,
    TIMELINE_LIMIT,
    EgressProxy,
    proxy_env,
)
from cancellable_agents.toolsets.sandbox.local.boundary._egress_request import BadRequest, parse_head

pytestmark = pytest.mark.timeout(60)

#: The proxy's refusals (other loggers may log at INFO here, as Airflow's config sets).
EGRESS_LOGGER = "cancellable_agents.toolsets.sandbox.local.boundary._egress_proxy"


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
        ("127.1:3141", "127.0.0.1/32", frozenset({3141})),  # an address in any spelling is one
        ("2130706433", "127.0.0.1/32", DEFAULT_PORTS),
        ("Example.test.", "example.test", DEFAULT_PORTS),
    ],
)
def test_rules_parse(entry: str, host: str, ports: frozenset[int] | None) -> None:
    rule = HostRule.parse(entry)
    assert (rule.host, rule.ports) == (host, ports)


@pytest.mark.parametrize(
    "entry",
    [
        "pypi.org:0",
        "pypi.org:http",
        "a..b",
        "exa mple.com",
        "[::1",
        "*foo.com",
        "1.2.3.08",
        "*.127.1",
        "*.a..b",
    ],
)
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
        "64:ff9b:1::7f00:1",  # local-use NAT64 (RFC 8215) wrapping 127.0.0.1
        "64:ff9b:1::a9fe:a9fe",  # ... and the metadata service
        "64:ff9b:1:7f00:0:1::",  # local-use NAT64 in its /48 layout: where the IPv4 sits is unknown
        "::7f00:1",  # IPv4-compatible (reserved ::/8), which Python counts as global
    ],
)
def test_special_addresses_are_unreachable_unless_listed(address: str) -> None:
    ip = ipaddress.ip_address(address)
    assert not EgressPolicy(["*:*"]).reachable(ip, 443)
    assert EgressPolicy(["*", address]).reachable(ip, 443)


@pytest.mark.parametrize(
    "address", ["151.101.0.223", "2a04:4e42::223", "64:ff9b::9765:df", "64:ff9b:1::9765:df", "::ffff:9765:df"]
)
def test_public_addresses_are_reachable(address: str) -> None:
    """Also behind NAT64 (well-known and local-use) and IPv4-mapped: the IPv4 address decides."""
    assert EgressPolicy(["*"]).reachable(ipaddress.ip_address(address), 443)


def test_a_listed_special_address_is_reachable_only_on_the_ports_of_its_entry() -> None:
    policy = EgressPolicy(["*:*", "127.0.0.1:3141", "10.0.0.0/8"])
    loopback, private = ipaddress.ip_address("127.0.0.1"), ipaddress.ip_address("10.1.2.3")
    assert policy.reachable(loopback, 3141)
    assert not policy.reachable(loopback, 80)  # what a name resolving to it would reach
    assert policy.reachable(private, 443) and not policy.reachable(private, 22)
    assert not policy.permits("127.0.0.1", loopback, 80)
    # The address in another form is not listed (the entry names an IPv4 network).
    assert not policy.reachable(ipaddress.ip_address("::ffff:127.0.0.1"), 3141)


@pytest.mark.parametrize(
    "spelling",
    ["2130706433", "0x7f000001", "0X7F000001", "0177.0.0.1", "127.1", "127.0.1", "0x7f.1", "127.0.0.1."],
)
def test_every_spelling_inet_aton_takes_is_the_address(spelling: str) -> None:
    assert canonical_host(spelling) == ("127.0.0.1", ipaddress.ip_address("127.0.0.1"))
    # Never a name: `*` (any name) does not let it through, only an entry for the address.
    address = canonical_host(spelling)[1]
    assert not EgressPolicy(["*:*"]).permits(spelling, address, 80)


@pytest.mark.parametrize(
    "host",
    [
        *("1.2.3.08", "4294967296", "256.1.1.1", "1.2.3.4.5", "0x100000000"),  # end in a number
        *("a..example.test", "", ".", "a b", "é.test", "x" * 64 + ".test", "a." * 127 + "test"),
        *("fe80::1%eth0", "[::1]", "::1::2"),
    ],
)
def test_hosts_that_are_neither_a_name_nor_an_address_are_refused(host: str) -> None:
    with pytest.raises(ValueError):
        canonical_host(host)


def test_names_and_ipv6_are_canonical() -> None:
    assert canonical_host("PyPI.org.") == ("pypi.org", None)
    assert canonical_host("1e100.net") == ("1e100.net", None)  # a number only in the first label
    assert canonical_host("::FFFF:127.0.0.1") == ("::ffff:7f00:1", ipaddress.ip_address("::ffff:7f00:1"))


def test_proxy_env_points_every_client_at_the_forwarder() -> None:
    env = proxy_env()
    assert {env[k] for k in ("HTTP_PROXY", "https_proxy", "ALL_PROXY")} == {"http://127.0.0.1:3128"}


# -- reading a request head -----------------------------------------------------------------


def test_a_request_head_is_read_strictly() -> None:
    tunnel = parse_head(b"CONNECT [::1]:8443 HTTP/1.1\r\nHost: [::1]:8443\r\n\r\n")
    assert (tunnel.host, str(tunnel.address), tunnel.port, tunnel.forward) == ("::1", "::1", 8443, None)
    plain = parse_head(
        b"get http://Allowed.test?q=1 HTTP/1.0\r\nHost: elsewhere.test\r\nConnection: keep-alive, X-Hop\r\n"
        b"X-Hop: 1\r\nProxy-Authorization: secret\r\nAccept:  */*  \r\n\r\n"
    )
    assert (plain.method, plain.host, plain.address, plain.port) == ("GET", "allowed.test", None, 80)
    # Host from the target (RFC 9112 3.2.2), no hop-by-hop or Proxy-* headers, Connection: close.
    assert plain.forward == (
        b"GET /?q=1 HTTP/1.0\r\nHost: Allowed.test\r\nAccept: */*\r\nConnection: close\r\n\r\n"
    )
    with pytest.raises(BadRequest, match="malformed header line"):
        parse_head(b"GET http://a.test/ HTTP/1.1\r\nX: a\rInjected: 1\r\n\r\n")


# -- the proxy ------------------------------------------------------------------------------


class Origin:
    """A TCP server on loopback answering each connection with a fixed HTTP response."""

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.requests: list[bytes] = []
        self.accepted = 0
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            self.accepted += 1
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


NAMES = {
    "allowed.test": ["127.0.0.1"],
    "private.test": ["10.20.30.40"],
    "denied.test": ["127.0.0.1"],
    "loop.test": ["127.0.0.1"],
    "a..example.test": ["127.0.0.1"],
}


def _proxy(*allow: str, scope: TaskCancellation | None = None) -> EgressProxy:
    policy = EgressPolicy(allow, resolver=lambda host: NAMES[host])
    return EgressProxy(policy, name="t", scope_of=lambda: scope).start()


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
    listed = _proxy(f"allowed.test:{origin.port}", f"127.0.0.1:{origin.port}")
    unlisted = _proxy(f"allowed.test:{origin.port}")
    other_ports = _proxy(f"allowed.test:{origin.port}", "127.0.0.1")  # loopback's 80 and 443 only
    try:
        assert _ask(listed, _connect("allowed.test", origin.port)).endswith(b"origin")
        for proxy in (unlisted, other_ports):
            refused = _ask(proxy, _connect("allowed.test", origin.port))
            assert refused.startswith(b"HTTP/1.1 403") and b"loopback/private" in refused
        assert len(origin.requests) == 1  # the refused requests never reached the server
    finally:
        for proxy in (listed, unlisted, other_ports):
            proxy.close()


def test_plain_http_goes_to_the_origin_without_proxy_headers(origin: Origin) -> None:
    proxy = _proxy(f"allowed.test:{origin.port}", f"127.0.0.1:{origin.port}")
    try:
        request = (
            f"GET http://allowed.test:{origin.port}/a?b=1 HTTP/1.1\r\nHost: other.example\r\n"
            "Proxy-Authorization: secret\r\nProxy-Connection: keep-alive\r\n\r\n"
        )
        assert _ask(proxy, request).endswith(b"origin")
        seen = origin.requests[0].decode()
        assert seen.startswith("GET /a?b=1 HTTP/1.1\r\n") and "Proxy-" not in seen
        assert "Connection: close" in seen
        # The origin is asked for the host that was decided, not the one the client wrote.
        assert f"Host: allowed.test:{origin.port}\r\n" in seen and "other.example" not in seen
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


#: The spellings of 127.0.0.1 a client may send; none is a name, so `*` never lets one through.
LOOPBACK_SPELLINGS = ["2130706433", "0x7f000001", "0177.0.0.1", "127.1", "127.0.1", "127.0.0.1"]


def _absolute(host: str, port: int) -> str:
    return f"GET http://{host}:{port}/ HTTP/1.1\r\nHost: {host}\r\n\r\n"


def test_a_listed_loopback_port_opens_no_other_port_in_any_spelling(origin: Origin) -> None:
    """``["*:*", "127.0.0.1:LISTED"]``: loopback's other ports stay shut whether the address is
    typed in any inet_aton spelling, in CONNECT or an absolute URL, or reached by a name; the
    listed port is reached by all of them (the control)."""
    listed = Origin()
    proxy = _proxy("*:*", f"127.0.0.1:{listed.port}")
    try:
        for host in [*LOOPBACK_SPELLINGS, "loop.test"]:
            for request in (_connect(host, origin.port), _absolute(host, origin.port)):
                reply = _ask(proxy, request)
                assert reply.startswith(b"HTTP/1.1 403"), (request, reply)
            for request in (_connect(host, listed.port), _absolute(host, listed.port)):
                assert _ask(proxy, request).endswith(b"origin"), request
        assert origin.accepted == 0
        assert listed.accepted == 2 * (len(LOOPBACK_SPELLINGS) + 1)
    finally:
        proxy.close()
        listed.close()


#: Requests a hostile command may send, each one that crashed the proxy's handler or went
#: unanswered before (``CONNECT [::1:443``, a name with an empty label, a non-ASCII method, an
#: empty or garbage line, no port, an over-long line), and more of their kind; {port} is a real
#: listener that none of them may reach.
MALFORMED = [
    "CONNECT [::1:443 HTTP/1.1\r\n\r\n",
    "CONNECT a..example.test:{port} HTTP/1.1\r\n\r\n",
    "G\u00caT http://allowed.test:{port}/ HTTP/1.1\r\nHost: x\r\n\r\n",
    "\u00ff http://allowed.test:{port}/ HTTP/1.1\r\n\r\n",  # upper() of it is not latin-1
    "\r\n\r\n",
    "\x00\x01\x1b[2J\x7f garbage \x1b]0;title\x07\r\n\r\n",
    "CONNECT allowed.test HTTP/1.1\r\n\r\n",
    "CONNECT allowed.test: HTTP/1.1\r\n\r\n",
    "CONNECT allowed.test:0 HTTP/1.1\r\n\r\n",
    "CONNECT allowed.test:99999 HTTP/1.1\r\n\r\n",
    "CONNECT allowed.test:-1 HTTP/1.1\r\n\r\n",
    "CONNECT [fe80::1%25lo]:{port} HTTP/1.1\r\n\r\n",
    "CONNECT [127.0.0.1]:{port} HTTP/1.1\r\n\r\n",
    "CONNECT 1.2.3.08:{port} HTTP/1.1\r\n\r\n",
    "CONNECT allowed.test:{port} HTTP/9.9\r\n\r\n",
    "CONNECT allowed.test:{port}\r\n\r\n",
    "CONNECT  allowed.test:{port} HTTP/1.1\r\n\r\n",
    "GET http://user@allowed.test:{port}/ HTTP/1.1\r\n\r\n",
    "GET http://allowed.test:{port}/#frag HTTP/1.1\r\n\r\n",
    "GET / HTTP/1.1\r\nHost: allowed.test\r\n\r\n",
    "GET http://allowed.test:{port}/ HTTP/1.1\r\nX: a\rInjected: 1\r\n\r\n",
    "GET http://allowed.test:{port}/ HTTP/1.1\r\nX: a\r\n folded\r\n\r\n",
    "GET http://allowed.test:{port}/ HTTP/1.1\r\nno colon\r\n\r\n",
    "GET http://allowed.test:{port}/" + "a" * 9000 + " HTTP/1.1\r\n\r\n",  # request line > 8 KiB
    "GET http://allowed.test:{port}/" + "a" * 70000 + " HTTP/1.1\r\n\r\n",  # head > 64 KiB
    "CONNECT 2130706433:{port} HTTP/1.1\r\n\r\n",  # a 403 among them: an address, not listed
    "CONNECT 127.1:{port} HTTP/1.1\r\n\r\n",
]


def _ask_raw(proxy: EgressProxy, request: bytes, *, half_close: bool = False) -> bytes:
    """Send bytes, read the answer until the proxy closes (a reset after it counts as closed:
    the proxy may close with part of an over-long request unread)."""
    with socket.socket(socket.AF_UNIX) as conn:
        conn.settimeout(20)
        conn.connect(proxy.socket_path)
        conn.sendall(request)
        if half_close:
            conn.shutdown(socket.SHUT_WR)
        reply = b""
        try:
            while chunk := conn.recv(65536):
                reply += chunk
        except ConnectionResetError:
            pass
        return reply


def test_malformed_requests_are_refused_counted_logged_once_and_leave_nothing_open(
    origin: Origin, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """250 hostile requests at once: each gets a 400 or 403 with a reason in plain ASCII, each is
    a counted denial, the log gets its rate-limited warnings and not one error or traceback, and
    no connection stays open, to the client or to the listener behind the allowed name."""
    monkeypatch.setattr(egress_proxy, "LOG_WINDOW", 3600.0)  # one window, however slow this machine is
    scope = TaskCancellation("t", budget=5)
    proxy = _proxy(f"allowed.test:{origin.port}", f"*.example.test:{origin.port}", scope=scope)
    batch = [
        text.replace("{port}", str(origin.port)) for text in itertools.islice(itertools.cycle(MALFORMED), 249)
    ]
    try:
        with caplog.at_level(logging.WARNING), ThreadPoolExecutor(16) as pool:
            replies = list(pool.map(lambda text: _ask_raw(proxy, text.encode("latin-1")), batch))
            # One more: the client stops sending mid-head.
            replies.append(_ask_raw(proxy, b"CONNECT allowed.test:1", half_close=True))
        for request, reply in zip([*batch, "(half-closed)"], replies, strict=True):
            status = reply.split(b"\r\n", 1)[0]
            assert status in (b"HTTP/1.1 400 Bad Request", b"HTTP/1.1 403 Forbidden"), (
                request[:80],
                reply[:200],
            )
            assert all(32 <= byte < 127 or byte in b"\r\n" for byte in reply), reply[:200]
        assert proxy.denied == 250
        assert proxy.open_connections == 0
        assert origin.accepted == 0
        broken = [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]
        assert broken == [], [r.getMessage() for r in broken]
        refusals = [r.getMessage() for r in caplog.records if r.name == EGRESS_LOGGER]
        assert len(refusals) == LOG_BURST
        assert all(m.startswith("sandbox t: egress ") and " refused: " in m for m in refusals), refusals
        assert all(m.isprintable() for m in refusals), refusals  # nothing a client sent, raw
        denials = [e.detail for e in scope.timeline if e.event == "egress_denied"]
        assert len(denials) == TIMELINE_LIMIT
        assert any(d["host"] is None and d["port"] is None for d in denials)
    finally:
        proxy.close()


def test_close_ends_open_tunnels_and_removes_the_socket() -> None:
    """A tunnel to a server that never answers is cut, both sides, when the proxy closes."""
    silent = socket.create_server(("127.0.0.1", 0))
    port = silent.getsockname()[1]
    proxy = _proxy(f"allowed.test:{port}", f"127.0.0.1:{port}")
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
    with caplog.at_level(logging.WARNING, logger="cancellable_agents.toolsets.sandbox.local._sandbox"):
        box = LocalSandbox(isolation="process-group", network=["pypi.org"])
    try:
        assert box.egress is None and box.network is False
        assert any("no egress allowlist" in r.getMessage() for r in caplog.records)
    finally:
        box.destroy()


def test_connections_past_the_cap_are_answered_503(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(egress_proxy, "MAX_CONNECTIONS", 1)
    silent = socket.create_server(("127.0.0.1", 0))
    port = silent.getsockname()[1]
    proxy = _proxy(f"allowed.test:{port}", f"127.0.0.1:{port}")
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
