"""Which Host headers the toolkit's HTTP APIs answer (the coordinator's, the emulated broker's
control API): a guard against DNS rebinding.

A web page the operator opens can point a name of its own at an API's address (127.0.0.1, or the
coordinator's address on the lab network) and then use the API as if it were that page's own
site: the browser sends the page's name as Host. So an API answers only the names it knows for
itself: the loopback names, the name it is bound to, the name it announces to agents
(`public_base_url`'s, or this machine's), and where it listens beyond loopback this machine's
host name, its fully qualified name and its `.local` (mDNS) name, plus those set in
`[api] allowed_hosts` (`*`: any). IP addresses always pass: a rebinding page needs a name its
own DNS answers for, and a browser that reaches an address it was given sends that address. A
request without a Host header passes too (an HTTP/1.0 health check; a browser always sends one)."""

from __future__ import annotations

import functools
import ipaddress
import re
import socket
from urllib.parse import urlsplit

__all__ = ["AnyHost", "BadHost", "allowed_hosts", "check_host_pattern", "host_allowed", "host_name", "host_refusal",
           "is_loopback", "is_wildcard", "machine_fqdn", "machine_names", "url_host"]

# names that mean this machine's loopback on Debian, Raspberry Pi OS and others; `*.localhost`
# (RFC 6761) browsers resolve to loopback themselves, without asking any DNS server
LOOPBACK_NAMES = frozenset({"localhost", "*.localhost", "localhost.localdomain", "localhost6",
                            "localhost6.localdomain6", "ip6-localhost", "ip6-loopback"})


class AnyHost:
    """Every Host header passes (`allowed_hosts = ["*"]`)."""

    def __contains__(self, name: object) -> bool:
        return True


class BadHost(ValueError):
    """A Host header that is not one name or address with an optional port."""


def is_loopback(host: str) -> bool:
    """Whether the API bound to `host` listens on this machine's loopback only: every address
    the name resolves to (as check_port binds it) is a loopback one. Unresolvable: False."""
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (OSError, UnicodeError):
        return False
    addresses = {str(info[4][0]).split("%")[0] for info in infos}
    return bool(addresses) and all(ipaddress.ip_address(a).is_loopback for a in addresses)


def is_wildcard(host: str) -> bool:
    """Whether binding `host` listens on every interface (`0.0.0.0`, `::`, `::0`, empty)."""
    if not host:
        return True
    try:
        return ipaddress.ip_address(host).is_unspecified
    except ValueError:
        return False


def url_host(host: str) -> str:
    """`host` as a URL writes it: an IPv6 address in brackets (its colons would read as a port)."""
    return f"[{host}]" if ":" in host else host


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
    if not name or any(c in name for c in "/@*?#[] \t") or (":" in name and not _is_address(name)):
        raise ValueError(f"{pattern!r} is not a host name: give a name or address without a scheme or port, "
                         "`*` for any, or `*.example.org` for its subdomains")
    return value


@functools.cache
def machine_fqdn() -> str:
    """This machine's fully qualified name, asked once per process: the coordinator announces the
    public set under it (a wildcard bind) and its API answers it, so both must see one answer
    (and a resolver without DNS can take seconds)."""
    return socket.getfqdn()


def machine_names() -> frozenset[str]:
    """This machine's host name, fully qualified name and mDNS name (as a Pi or a lab server is
    often reached: `coordinator.local`)."""
    names = set()
    short = socket.gethostname()
    for name in (short, machine_fqdn(), f"{short.split('.')[0]}.local"):
        try:
            names.add(check_host_pattern(name))
        except ValueError:  # a host name no browser could send
            continue
    return frozenset(names)


def allowed_hosts(host: str, public_base_url: str | None, configured: list[str] | None) -> set[str] | AnyHost:
    """The names an API bound to `host`, announcing `public_base_url`, answers (patterns as
    check_host_pattern gives them; addresses pass besides these). The machine's own names only
    where it listens beyond loopback: on loopback they reach no socket of the API (Debian maps
    the host name to 127.0.1.1), and a `.local` name can be answered by anyone on the network."""
    extra = {check_host_pattern(p) for p in configured or ()}
    if "*" in extra:
        return AnyHost()
    names = set(LOOPBACK_NAMES) | extra
    if is_wildcard(host) or not is_loopback(host):
        names |= machine_names()
    if not is_wildcard(host):
        names.add(check_host_pattern(host))
    public = urlsplit(public_base_url).hostname if public_base_url else None
    if public:
        names.add(check_host_pattern(public))
    return names


def host_name(header: bytes) -> str:
    """The name or address of a Host header without its port (IPv6 without brackets), lower
    case; BadHost for one that is not a name or address with an optional port."""
    try:
        text = header.decode("ascii").strip().lower()
    except UnicodeDecodeError:
        raise BadHost("not ASCII") from None
    if text.startswith("["):
        end = text.find("]")
        rest = text[end + 1:]
        if end < 0 or (rest and not (rest.startswith(":") and _is_port(rest[1:]))) or not _is_address(text[1:end]):
            raise BadHost(text)
        return text[1:end]
    name, colon, port = text.partition(":")
    name = name.removesuffix(".")
    if not _HOST_CHARACTERS.fullmatch(name) or (colon and not _is_port(port)):
        raise BadHost(text)  # a configured pattern (`*.lab.example`) sent as a Host matches nothing
    return name


_HOST_CHARACTERS = re.compile(r"[a-z0-9_.-]+")  # a DNS name's (lower case), an IPv4 address's


def host_refusal(headers: list[tuple[bytes, bytes]], allowed: set[str] | AnyHost) -> str | None:
    """Why a request with these (ASGI) headers is refused, or None. No Host header passes (an
    HTTP/1.0 health check; a browser always sends one); two are refused, as servers and
    frameworks differ on which one counts."""
    hosts = [value for key, value in headers if key.lower() == b"host"]
    if len(hosts) > 1:
        return "a request may carry one Host header"
    if not hosts:
        return None
    try:
        name = host_name(hosts[0])
    except BadHost:
        return "the Host header is not a host name or address with an optional port"
    if host_allowed(name, allowed):
        return None
    return f"Host {name!r} is not a name this API answers to"


def host_allowed(name: str, allowed: set[str] | AnyHost) -> bool:
    if isinstance(allowed, AnyHost) or _is_address(name) or name in allowed:
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
