"""Which Host headers the API answers: a guard against DNS rebinding.

A web page the operator opens can point a name of its own at 127.0.0.1 and then read an API
bound to loopback as if it were its own origin (the browser sends the page's name as Host).
An API on loopback therefore answers only names that are loopback's: `localhost`, the name it is
bound to and the name in `public_base_url`, or those set in `[api] allowed_hosts`. IP addresses
always pass: a rebinding page needs a name its own DNS answers for, and a browser that reaches
an address it was given sends that address. An API bound beyond loopback answers any name
unless `allowed_hosts` is set (its reads are then open to the network anyway, which the
coordinator warns of at start)."""

from __future__ import annotations

import ipaddress
import socket
from urllib.parse import urlsplit

__all__ = ["AnyHost", "allowed_hosts", "check_host_pattern", "host_allowed", "host_name", "is_loopback"]


class AnyHost:
    """Every Host header passes (`["*"]`, or an API bound beyond loopback by default)."""

    def __contains__(self, name: object) -> bool:
        return True


def is_loopback(host: str) -> bool:
    """Whether the API bound to `host` listens on this machine's loopback only: every address
    the name resolves to (as check_port binds it) is a loopback one. Unresolvable: False."""
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (OSError, UnicodeError):
        return False
    addresses = {info[4][0].split("%")[0] for info in infos}
    return bool(addresses) and all(ipaddress.ip_address(a).is_loopback for a in addresses)


def check_host_pattern(pattern: str) -> str:
    """An `allowed_hosts` entry as it is matched: a name or address without port or scheme,
    `*` (any) or `*.domain` (its subdomains); lower case, IPv6 without brackets."""
    value = pattern.strip().lower()
    if value == "*":
        return value
    value = value.removesuffix(".")  # a fully qualified name's root
    if value.startswith("[") and value.endswith("]"):
        value = value[1:-1]
    name = value[2:] if value.startswith("*.") else value
    if not name or any(c in name for c in "/@*?# \t") or (":" in name and not _is_address(name)):
        raise ValueError(f"{pattern!r} is not a host name: give a name or address without a scheme or port, "
                         "`*` for any, or `*.example.org` for its subdomains")
    return value


def allowed_hosts(host: str, public_base_url: str | None, configured: list[str] | None) -> set[str] | AnyHost:
    """The names an API bound to `host` answers (patterns as check_host_pattern gives them)."""
    if configured is not None:
        patterns = {check_host_pattern(p) for p in configured}
        return AnyHost() if "*" in patterns else patterns
    if not is_loopback(host):
        return AnyHost()
    names = {"localhost", check_host_pattern(host)}
    public = urlsplit(public_base_url).hostname if public_base_url else None
    if public:
        names.add(check_host_pattern(public))
    return names


def host_name(header: bytes | None) -> str | None:
    """The name or address of a Host header without its port (IPv6 without brackets), lower
    case; None for one that is missing or malformed."""
    if not header:
        return None
    try:
        text = header.decode("ascii").strip().lower()
    except UnicodeDecodeError:
        return None
    if text.startswith("["):
        end = text.find("]")
        rest = text[end + 1:]
        if end < 0 or (rest and not (rest.startswith(":") and _is_port(rest[1:]))):
            return None
        inner = text[1:end]
        return inner if _is_address(inner) else None
    name, colon, port = text.partition(":")
    if colon and not _is_port(port):
        return None
    return name.removesuffix(".") or None


def host_allowed(name: str | None, allowed: set[str] | AnyHost) -> bool:
    if isinstance(allowed, AnyHost):
        return True
    if name is None:
        return False
    if _is_address(name) or name in allowed:
        return True
    return any(p.startswith("*.") and name.endswith(p[1:]) for p in allowed)


def _is_address(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True


def _is_port(text: str) -> bool:
    return text.isdigit() and len(text) <= 5
