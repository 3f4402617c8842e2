"""The egress allowlist's policy: which hosts, ports and addresses a sandbox may reach.

A rule is a host name (ports 80 and 443), ``host:port``, ``host:*``, a wildcard (``*.x.com``:
subdomains, not ``x.com``; ``*``: any name), or an address or network. Loopback, private,
link-local, multicast and reserved ("special") addresses are refused even for a listed name unless
an entry lists that address or network itself, and then only on that entry's ports (also behind
IPv4-mapped, 6to4 and NAT64 forms). Every host, in a rule or a request, is read by
[`canonical_host`][]: a spelling ``inet_aton`` takes as an IPv4 address (``127.1``, ``2130706433``,
``0x7f000001``, ``0177.0.0.1``) *is* that address, never a name. The proxy that enforces the policy
is the local backend's
[`egress_proxy`][cancellable_agents.toolsets.sandbox.local.boundary._egress_proxy]; the policy itself
is any backend's (a pod backend may turn it into a NetworkPolicy). Imports no Airflow.
"""

from __future__ import annotations

import ipaddress
import re
import socket
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from cancellable_agents.core.exceptions import ConfigurationError

__all__ = [
    "DEFAULT_PORTS",
    "EgressDenial",
    "EgressPolicy",
    "HostRule",
    "IPAddress",
    "IPNetwork",
    "Resolver",
    "canonical_host",
    "special",
]

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
        Without a port: 80 and 443. A host ``inet_aton`` reads as an address (``127.1``) is that
        address, as it is in a request."""
        text = entry.strip().lower()
        host: str = text
        ports: frozenset[int] | None = DEFAULT_PORTS
        if text.startswith("["):
            end = text.find("]")
            if end < 0:
                raise ConfigurationError(f"egress rule {entry!r}: unclosed '['")
            host, rest = text[1:end], text[end + 1 :]
            if rest:
                ports = _parse_ports(entry, rest.removeprefix(":"))
        elif text.count(":") == 1:
            host, port = text.split(":")
            ports = _parse_ports(entry, port)
        network = _parse_network(host)
        if network is None and host != "*":
            try:
                name, address = canonical_host(host.removeprefix("*."))
            except ValueError:
                raise ConfigurationError(
                    f"egress rule {entry!r}: not a host name, wildcard, address or network"
                ) from None
            if address is not None and host.startswith("*."):
                raise ConfigurationError(f"egress rule {entry!r}: a wildcard over an address")
            if address is not None:
                network = ipaddress.ip_network(address)
            elif not host.startswith("*."):
                host = name
        return cls(host if network is None else str(network), ports, network)

    def matches(self, host: str, address: IPAddress | None, port: int) -> bool:
        """Whether a request for ``host`` (``address`` when it is an IP literal) may go to ``port``."""
        if not self.allows_port(port):
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

    def allows_port(self, port: int) -> bool:
        return self.ports is None or port in self.ports

    def lists(self, address: IPAddress, port: int) -> bool:
        """Whether this rule names ``address`` itself on ``port`` (what lets a special address
        through: ``127.0.0.1:3141`` opens port 3141 of loopback, not its port 80)."""
        return self.network is not None and address in self.network and self.allows_port(port)


def _parse_ports(entry: str, text: str) -> frozenset[int] | None:
    if text == "*":
        return None
    if not text.isdigit() or not 0 < int(text) < 65536:
        raise ConfigurationError(f"egress rule {entry!r}: port must be 1-65535 or '*'")
    return frozenset({int(text)})


def _parse_network(host: str) -> IPNetwork | None:
    try:
        return ipaddress.ip_network(host, strict=False)
    except ValueError:
        return None


# -- host names and addresses ---------------------------------------------------------------

_LABEL = re.compile(r"[a-z0-9_](?:[a-z0-9_-]{0,61}[a-z0-9_])?")
#: A last label that is a number (decimal, or ``0x`` hex): the host is meant as an IPv4 address
#: (the WHATWG URL standard's "ends in a number"; glibc's resolver reads it so too).
_NUMERIC_LABEL = re.compile(r"[0-9]+|0x[0-9a-f]*")
_MAX_NAME = 253


def canonical_host(text: str) -> tuple[str, IPAddress | None]:
    """A host as the policy compares it: ``(name, None)`` for a DNS name (lower case, no
    trailing dot) or ``(str(address), address)`` for an address literal.

    ``text`` is an IPv6 address (no brackets, no zone), an IPv4 address in *any* spelling
    ``inet_aton`` accepts (``127.1``, ``2130706433``, ``0x7f000001``, ``0177.0.0.1``: what the
    system resolver, and so a client, would connect to), or a DNS name of letters, digits, ``-``
    and ``_`` (labels of 1-63, at most 253 in all). A name whose last label is a number but no
    address (``1.2.3.08``, ``4294967296``) is neither: resolvers read such hosts differently, so
    it is refused rather than sent to DNS. Raises ``ValueError`` for anything else.
    """
    host = text.lower()
    host = host[:-1] if host.endswith(".") and not host.endswith("..") else host
    if ":" in host:
        if "%" in host:
            raise ValueError(f"{text!r}: an IPv6 zone is not allowed")
        address = ipaddress.IPv6Address(host)  # ValueError when it is not one
        return str(address), address
    labels = host.split(".")
    if _NUMERIC_LABEL.fullmatch(labels[-1]):
        ipv4 = _ipv4(host)
        if ipv4 is None:
            raise ValueError(f"{text!r} ends in a number but is not an IPv4 address")
        return str(ipv4), ipv4
    if len(host) > _MAX_NAME or not all(_LABEL.fullmatch(label) for label in labels):
        raise ValueError(f"{text!r} is not a host name")
    return host, None


def _ipv4(host: str) -> ipaddress.IPv4Address | None:
    """``host`` in any spelling ``inet_aton`` accepts, normalised. Only digits, ``x``, ``a-f``
    and dots reach ``inet_aton``: glibc's stops at whitespace and ignores what follows."""
    if not re.fullmatch(r"[0-9a-fx.]+", host):
        return None
    try:
        return ipaddress.IPv4Address(socket.inet_aton(host))
    except OSError:
        return None


@dataclass(frozen=True)
class EgressPolicy:
    """Which hosts and ports a sandbox's commands may reach through the proxy.

    ``allow``: entries as [`HostRule.parse`][] reads them. Loopback, link-local, private,
    multicast and reserved addresses are refused even for a listed name, unless an entry lists
    the address or its network itself (``"127.0.0.1:3141"``, ``"10.0.0.0/8"``), and then only on
    that entry's ports. ``resolver``: how the proxy resolves names (default: the system's
    ``getaddrinfo``); tests map names to loopback.
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
        """Whether a request may go on: ``host`` and ``address`` as [`canonical_host`][]
        returns them (``address`` set for an address typed in)."""
        return any(rule.matches(host, address, port) for rule in self.rules)

    def reachable(self, address: IPAddress, port: int) -> bool:
        """Whether the proxy may connect to ``address:port``: a public address, or a special one
        that an entry lists itself with this port."""
        return not special(address) or any(rule.lists(address, port) for rule in self.rules)


def special(address: IPAddress) -> bool:
    """Loopback, private, link-local, multicast, reserved, ... also behind IPv6 forms that
    reach an IPv4 address: IPv4-mapped (``::ffff:127.0.0.1``) and NAT64 (``64:ff9b::/96``, and
    the local-use ``64:ff9b:1::/48`` of RFC 8215) are exactly as special as the IPv4 address
    they carry; 6to4 is special when its IPv4 is. A local-use NAT64 address in a layout other
    than ``/96`` is special: where its IPv4 sits depends on the translator's prefix length."""
    if isinstance(address, ipaddress.IPv6Address):
        carried = address.ipv4_mapped or _nat64_ipv4(address)
        if carried is not None:
            return special(carried)
        if address in _NAT64_LOCAL_USE:
            return True
        if address.sixtofour is not None and special(address.sixtofour):
            return True
    # is_reserved: Python counts IPv6 ::/8 (IPv4-compatible ::127.0.0.1) and other unallocated
    # ranges as global.
    return not address.is_global or address.is_multicast or address.is_reserved


def _nat64_ipv4(address: ipaddress.IPv6Address) -> ipaddress.IPv4Address | None:
    """The IPv4 address a ``/96`` NAT64 prefix carries in its last 32 bits (RFC 6052)."""
    if any(address in prefix for prefix in _NAT64_96):
        return ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
    return None


_NAT64_96 = (ipaddress.IPv6Network("64:ff9b::/96"), ipaddress.IPv6Network("64:ff9b:1::/96"))
_NAT64_LOCAL_USE = ipaddress.IPv6Network("64:ff9b:1::/48")


@dataclass(frozen=True)
class EgressDenial:
    """One refused request: what was asked for and why it was refused (``host`` and ``port``
    ``None`` when the request was too malformed to name them)."""

    host: str | None
    port: int | None
    reason: str
