"""The egress allowlist's policy: which hosts, ports and addresses a sandbox may reach.

A rule is a host name (ports 80 and 443), ``host:port``, ``host:*``, a wildcard (``*.x.com``:
subdomains, not ``x.com``; ``*``: any name), or an address or network. Loopback, private,
link-local, multicast and reserved addresses are refused even for a listed name unless that
address or network is listed itself (also behind IPv4-mapped, 6to4 and NAT64 forms). The proxy
that enforces it is :mod:`cancellable_agents.toolsets.sandbox.egress`. Imports no Airflow.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network
#: Resolves a host name to IP address strings (blocking; called on a worker thread).
Resolver = Callable[[str], Sequence[str]]
#: Ports a host rule without ``:port`` allows.
DEFAULT_PORTS: frozenset[int] = frozenset({80, 443})


@dataclass(frozen=True)
class HostRule:
    """One allowlist entry: a host name (``"pypi.org"``), a wildcard (``"*.example.com"``: any
    subdomain, not the apex; ``"*"``: any name), or an address or network (``"10.0.0.0/8"``);
    ``ports`` ``None`` for any port."""

    host: str
    ports: frozenset[int] | None
    network: IPNetwork | None = None

    @classmethod
    def parse(cls, entry: str) -> HostRule:
        """``host``, ``host:port``, ``host:*``, ``[v6]:port``, an address or a CIDR network.
        Without a port: 80 and 443."""
        text = entry.strip().lower()
        host: str = text
        ports: frozenset[int] | None = DEFAULT_PORTS
        if text.startswith("["):
            end = text.find("]")
            if end < 0:
                raise ValueError(f"egress rule {entry!r}: unclosed '['")
            host, rest = text[1:end], text[end + 1 :]
            if rest:
                ports = _parse_ports(entry, rest.removeprefix(":"))
        elif text.count(":") == 1:
            host, port = text.split(":")
            ports = _parse_ports(entry, port)
        network = _parse_network(host)
        if network is None and not _valid_pattern(host):
            raise ValueError(f"egress rule {entry!r}: not a host name, wildcard, address or network")
        return cls(host if network is None else str(network), ports, network)

    def matches(self, host: str, address: IPAddress | None, port: int) -> bool:
        """Whether a request for ``host`` (``address`` when it is an IP literal) may go to ``port``."""
        if self.ports is not None and port not in self.ports:
            return False
        if self.network is not None:
            return address is not None and address in self.network
        if address is not None:
            return False  # a name rule never allows an address typed in directly
        if self.host == "*":
            return True
        if self.host.startswith("*."):
            return host.endswith(self.host[1:])
        return host == self.host

    def lists(self, address: IPAddress) -> bool:
        """Whether this rule names ``address`` itself (what lets a private address through)."""
        return self.network is not None and address in self.network


def _parse_ports(entry: str, text: str) -> frozenset[int] | None:
    if text == "*":
        return None
    if not text.isdigit() or not 0 < int(text) < 65536:
        raise ValueError(f"egress rule {entry!r}: port must be 1-65535 or '*'")
    return frozenset({int(text)})


def _parse_network(host: str) -> IPNetwork | None:
    try:
        return ipaddress.ip_network(host, strict=False)
    except ValueError:
        return None


def _valid_pattern(host: str) -> bool:
    name = host[2:] if host.startswith("*.") else host
    if host == "*":
        return True
    labels = name.split(".")
    return all(label and all(c.isalnum() or c in "-_" for c in label) for label in labels)


@dataclass(frozen=True)
class EgressPolicy:
    """Which hosts and ports a sandbox's commands may reach through the proxy.

    ``allow``: entries as :meth:`HostRule.parse` reads them. Loopback, link-local, private,
    multicast and reserved addresses are refused even for a listed name, unless an entry lists
    the address or its network itself (``"127.0.0.1"``, ``"10.0.0.0/8"``). ``resolver``: how the
    proxy resolves names (default: the system's ``getaddrinfo``); tests map names to loopback.
    """

    allow: Sequence[str]
    resolver: Resolver | None = field(default=None, compare=False, repr=False)
    rules: tuple[HostRule, ...] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.allow, str):
            raise TypeError("EgressPolicy(allow=...) takes a list of hosts, not one string")
        object.__setattr__(self, "allow", tuple(self.allow))
        object.__setattr__(self, "rules", tuple(HostRule.parse(entry) for entry in self.allow))

    @classmethod
    def coerce(cls, network: bool | Iterable[str] | EgressPolicy) -> bool | EgressPolicy:
        """``network=`` as a sandbox takes it: ``True``/``False`` as they are, a policy, or a
        list of hosts made into one."""
        if isinstance(network, bool | EgressPolicy):
            return network
        return cls(tuple(network))

    def permits(self, host: str, address: IPAddress | None, port: int) -> bool:
        return any(rule.matches(host, address, port) for rule in self.rules)

    def reachable(self, address: IPAddress) -> bool:
        """A public address, or a special one the policy lists itself."""
        return not _special(address) or any(rule.lists(address) for rule in self.rules)


def _special(address: IPAddress) -> bool:
    """Loopback, private, link-local, multicast, reserved, ... also behind IPv6 wrappings
    (``::ffff:127.0.0.1``, 6to4, NAT64) that reach an IPv4 address."""
    if isinstance(address, ipaddress.IPv6Address):
        embedded = address.ipv4_mapped or address.sixtofour
        if embedded is None and address in _NAT64:
            embedded = ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
        if embedded is not None and _special(embedded):
            return True
    return not address.is_global or address.is_multicast


_NAT64 = ipaddress.IPv6Network("64:ff9b::/96")


@dataclass(frozen=True)
class EgressDenial:
    """One refused request: what was asked for and why it was refused."""

    host: str
    port: int
    reason: str
