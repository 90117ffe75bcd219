"""Which URLs the server may fetch: http(s) only, and never loopback, private, link-local or other non-global
addresses, checked on every hop of a redirect chain.

The one exception is the set of *configured* upstream origins (Serper, Jina, the summariser's API_BASE) when the
operator passes ``--allow-private-upstreams`` (local fakes, an in-cluster LLM). Model-chosen URLs never get it.
Residual risk: the address is checked before httpx connects, so a DNS answer that changes in between (rebinding)
is not caught; put the server behind an egress firewall if that matters.
"""
from __future__ import annotations

import asyncio
import ipaddress
import re
import socket
import time
from urllib.parse import SplitResult, urlsplit

from .errors import ToolError

_LOCAL_NAMES = {"localhost", "localhost.localdomain", "ip6-localhost", "ip6-loopback"}
_LOCAL_SUFFIXES = (".localhost", ".local", ".internal", ".lan", ".home.arpa")
_DNS_TTL_S = 60.0
_NUMERIC_HOST = re.compile(r"[0-9a-fx.]+", re.IGNORECASE)

Origin = tuple[str, str, int]


def origin_of(parts: SplitResult) -> Origin:
    port = parts.port or (443 if parts.scheme == "https" else 80)
    return (parts.scheme, (parts.hostname or "").lower(), port)


def is_public_ip(text: str) -> bool:
    """True only for globally routable unicast addresses (IPv4-mapped IPv6 is judged by its IPv4 part)."""
    ip = ipaddress.ip_address(text.split("%", 1)[0])
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_global and not ip.is_multicast


def literal_ip(host: str) -> str | None:
    """The address a host string denotes literally, or None for a name. Covers the short/hex/octal IPv4 forms
    the C resolver accepts (``127.1``, ``0x7f.1``), which ``ipaddress`` alone would treat as names."""
    try:
        return str(ipaddress.ip_address(host.split("%", 1)[0]))
    except ValueError:
        pass
    if _NUMERIC_HOST.fullmatch(host):
        try:
            return socket.inet_ntoa(socket.inet_aton(host))
        except OSError:
            return None
    return None


def check_url_syntax(url: str, *, max_chars: int) -> SplitResult:
    """Reject, without any network access, URLs we would never fetch; returns the parsed URL."""
    if len(url) > max_chars:
        raise ToolError("bad_request", f"URL is {len(url)} characters long; the limit is {max_chars}")
    parts = urlsplit(url.strip())
    if parts.scheme not in ("http", "https"):
        raise ToolError("bad_request", f"refusing URL {url[:200]!r}: only http and https URLs can be visited")
    host = (parts.hostname or "").lower()
    if not host:
        raise ToolError("bad_request", f"refusing URL {url[:200]!r}: it has no host name")
    if parts.username or parts.password:
        raise ToolError("bad_request", f"refusing URL with embedded credentials (host {host!r})")
    if host in _LOCAL_NAMES or host.endswith(_LOCAL_SUFFIXES):
        raise ToolError("bad_request", f"refusing URL to local host name {host!r}")
    literal = literal_ip(host)  # None for a name: TargetGuard resolves it before a direct fetch
    if literal is not None and not is_public_ip(literal):
        raise ToolError("bad_request", f"refusing URL to non-public address {host!r} (loopback/private/link-local)")
    return parts


class TargetGuard:
    """``await guard.check(url)`` before every outgoing request and every redirect hop."""

    def __init__(self, allowed_origins: set[Origin] = frozenset(), *, max_url_chars: int = 2048) -> None:
        self.allowed_origins = set(allowed_origins)
        self.max_url_chars = max_url_chars
        self._resolved: dict[tuple[str, int], float] = {}  # (host, port) -> time it was found public

    async def check(self, url: str) -> None:
        parts = urlsplit(url)
        if parts.scheme in ("http", "https") and origin_of(parts) in self.allowed_origins:
            return
        parts = check_url_syntax(url, max_chars=self.max_url_chars)
        host, port = parts.hostname.lower(), origin_of(parts)[2]
        if literal_ip(host) is not None:
            return  # a public literal address; check_url_syntax already refused the others
        seen = self._resolved.get((host, port))
        if seen is not None and time.monotonic() - seen < _DNS_TTL_S:
            return
        try:
            infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except OSError as exc:
            raise ToolError("infra", f"could not resolve host {host!r}: {exc.strerror or exc}", retryable=True)
        addresses = {info[4][0] for info in infos}
        private = sorted(a for a in addresses if not is_public_ip(a))
        if private:
            raise ToolError("bad_request", f"refusing to fetch {host!r}: it resolves to non-public address "
                                           f"{private[0]} (loopback/private/link-local)")
        self._resolved[(host, port)] = time.monotonic()
