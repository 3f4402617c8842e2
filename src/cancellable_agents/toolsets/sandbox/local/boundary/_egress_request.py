"""The egress proxy's reading of one request head: strict, so that a request it cannot read for
certain is refused (``400``), never guessed at.

Whatever a sandboxed command sends is untrusted input (the model chose the command), so this
reads only RFC 9112's grammar, narrowed to what a forward proxy needs: a request line of a
``token`` method, a target of visible ASCII and ``HTTP/1.0`` or ``HTTP/1.1``; header lines of a
``token`` name and a value without control characters (no line folding, no bare CR or LF); a
target that is either ``CONNECT``'s ``host:port`` or an absolute ``http://`` URL, without user
info or fragment. The host is read by [`canonical_host`][], so every
spelling of an address is that address before the policy sees it.

Why not ``h11`` (installed with httpx): it would check the same two lines, but it refuses an
HTTP/1.1 request without ``Host``, which some CONNECT clients omit (the authority is in the
target), and it leaves the target unparsed, which is where the holes were (``[::1:443``,
``127.1``). What the proxy forwards after the head is bytes, not events, so its state machine
would go unused.
This module imports no Airflow.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from cancellable_agents.toolsets.sandbox.egress_policy import IPAddress, canonical_host

__all__ = ["REQUEST_LINE_LIMIT", "BadRequest", "ProxyRequest", "parse_head"]

#: A request line longer than this is refused (the head as a whole is bounded by the proxy).
REQUEST_LINE_LIMIT = 8192
#: What is shown of a malformed line in a refusal (the model reads it, the log keeps it).
SHOWN_LIMIT = 80

_TOKEN = r"[!#$%&'*+.^_`|~0-9A-Za-z-]+"
_REQUEST_LINE = re.compile(rf"(?P<method>{_TOKEN}) (?P<target>[\x21-\x7e]+) HTTP/(?P<version>1\.[01])")
_FIELD_LINE = re.compile(rf"(?P<name>{_TOKEN}):[ \t]*(?P<value>[\t\x20-\x7e\x80-\xff]*)")
_ABSOLUTE = re.compile(r"(?i:http)://(?P<authority>[^/?#]*)(?P<rest>[/?][^#]*)?")
_AUTHORITY = re.compile(r"(?:\[(?P<ipv6>[0-9A-Fa-f:.]*)\]|(?P<host>[^:@\[\]]+))(?::(?P<port>[0-9]{0,5}))?")
#: Headers that concern the connection to the proxy, not the origin's request (RFC 9110 7.6.1),
#: and ``Host``, which a proxy replaces by the target's authority (RFC 9112 3.2.2).
_NOT_FORWARDED = frozenset({"host", "connection", "keep-alive", "proxy-connection", "te", "upgrade"})


class BadRequest(ValueError):
    """A head the proxy will not read; the message says why (the command's client shows it)."""


@dataclass(frozen=True)
class ProxyRequest:
    """One request, read: where it goes (``host`` and ``address`` as
    [`canonical_host`][] returns them) and, for plain HTTP, the head to send
    the origin (``forward``; ``None`` for a ``CONNECT`` tunnel)."""

    method: str
    host: str
    address: IPAddress | None
    port: int
    forward: bytes | None


def parse_head(head: bytes) -> ProxyRequest:
    """Read a request head (through its blank line). Raises [`BadRequest`][]."""
    lines = head.decode("latin-1").split("\r\n")
    if len(lines) < 3 or lines[-2:] != ["", ""]:
        raise BadRequest("the request head does not end with an empty line")
    request_line, fields = lines[0], lines[1:-2]
    if len(request_line) > REQUEST_LINE_LIMIT:
        raise BadRequest(f"request line longer than {REQUEST_LINE_LIMIT} bytes")
    parsed = _REQUEST_LINE.fullmatch(request_line)
    if parsed is None:
        raise BadRequest(f"not an HTTP/1.x request line: {shown(request_line)}")
    headers = [_field(line) for line in fields]
    method, target, version = parsed["method"].upper(), parsed["target"], parsed["version"]
    if method == "CONNECT":
        host, address, port = _authority(target, default_port=None)
        return ProxyRequest(method, host, address, port, None)
    absolute = _ABSOLUTE.fullmatch(target)
    if absolute is None:
        raise BadRequest("only CONNECT and absolute http:// requests go through this proxy")
    host, address, port = _authority(absolute["authority"], default_port=80)
    path = absolute["rest"] or "/"
    if path.startswith("?"):
        path = "/" + path
    forward = _origin_head(method, path, version, absolute["authority"], headers)
    return ProxyRequest(method, host, address, port, forward)


def _field(line: str) -> tuple[str, str]:
    parsed = _FIELD_LINE.fullmatch(line)
    if parsed is None:
        raise BadRequest(f"malformed header line: {shown(line)}")
    return parsed["name"], parsed["value"].rstrip(" \t")


def _authority(text: str, *, default_port: int | None) -> tuple[str, IPAddress | None, int]:
    """``host, address, port`` of ``host[:port]`` or ``[v6][:port]``; the port is required
    where ``default_port`` is ``None`` (CONNECT)."""
    parsed = _AUTHORITY.fullmatch(text)
    if parsed is None:
        raise BadRequest(f"bad proxy target {shown(text)}: not host:port or [IPv6]:port")
    if parsed["ipv6"] is not None and ":" not in parsed["ipv6"]:
        raise BadRequest(f"bad proxy target {shown(text)}: brackets hold an IPv6 address only")
    try:
        host, address = canonical_host(parsed["ipv6"] or parsed["host"])
    except ValueError as exc:
        raise BadRequest(f"bad proxy target {shown(text)}: {exc}") from None
    port_text = parsed["port"]
    if not port_text:
        if default_port is None:
            raise BadRequest(f"bad proxy target {shown(text)}: no port")
        return host, address, default_port
    port = int(port_text)
    if not 0 < port < 65536:
        raise BadRequest(f"bad proxy target {shown(text)}: port must be 1-65535")
    return host, address, port


def _origin_head(
    method: str, path: str, version: str, authority: str, headers: list[tuple[str, str]]
) -> bytes:
    """The absolute-form request as the origin server expects it: origin-form target, ``Host``
    from the target, no ``Proxy-*`` or hop-by-hop headers, and ``Connection: close`` (the next
    request on a kept-alive client connection may be for another host, which must be decided
    again)."""
    named = {
        n.strip().lower() for name, value in headers if name.lower() == "connection" for n in value.split(",")
    }
    kept = [
        f"{name}: {value}"
        for name, value in headers
        if not name.lower().startswith("proxy-") and name.lower() not in _NOT_FORWARDED | named
    ]
    lines = [f"{method} {path} HTTP/{version}", f"Host: {authority}", *kept, "Connection: close", "", ""]
    return "\r\n".join(lines).encode("latin-1")


def shown(text: str) -> str:
    """``text`` as a refusal quotes it: ASCII only (``ascii()`` escapes control characters, so
    nothing a client sent can move a terminal's cursor or split a log line), at most
    ``SHOWN_LIMIT`` characters."""
    if len(text) > SHOWN_LIMIT:
        return ascii(text[:SHOWN_LIMIT]) + f" (+{len(text) - SHOWN_LIMIT} characters)"
    return ascii(text)
