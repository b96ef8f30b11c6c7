"""The dashboard's security rules, as plain functions (no web framework): where it may listen,
how a request proves the token, which run names may be opened, and the request limits.

The model (docs/operations.md, "Dashboard"): read-only (GET and HEAD only); loopback by
default; any other address needs a token *and* TLS (``insecure`` waives TLS, never the token).
With a token, every request must carry it; on loopback without one, the Host header must name
this machine (a web page elsewhere cannot read the dashboard through DNS rebinding).
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import re
from dataclasses import dataclass
from pathlib import Path

from murmura.protocols.tls import is_loopback_host as is_loopback

__all__ = ["COOKIE", "MAX_QUERY_BYTES", "MAX_SSE", "MIN_TOKEN_CHARS", "BindPlan",
           "DashboardError", "cookie_value", "host_allowed", "is_loopback", "plan_bind",
           "resolve_run", "split_address", "token_matches"]

#: Query strings longer than this are refused (414): the API takes one small number.
MAX_QUERY_BYTES = 1024
#: Server-sent event streams open at once; more are refused (503, Retry-After).
MAX_SSE = 200
#: A token shorter than this is refused at start (it would be guessed).
MIN_TOKEN_CHARS = 16
COOKIE = "murmura_dashboard"
_RUN_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,127}")
_LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1", "[::1]")


class DashboardError(ValueError):
    """A dashboard option that cannot be served as given (the command exits 2 with it)."""


@dataclass(frozen=True)
class BindPlan:
    """Where and how the dashboard listens, once the rules are checked."""

    host: str
    port: int
    token: str = ""
    tls_cert: str = ""
    tls_key: str = ""

    @property
    def loopback(self) -> bool:
        return is_loopback(self.host)

    @property
    def scheme(self) -> str:
        return "https" if self.tls_cert else "http"


def split_address(address: str, what: str = "--dashboard") -> tuple[str, int]:
    """``HOST:PORT`` (``[v6]:PORT``) into (host, port); port 0 picks a free one."""
    shown = repr(address[:60])
    host, sep, port_text = address.strip().rpartition(":")
    if not sep or not host or not port_text.isdigit() or int(port_text) > 65535:
        raise DashboardError(f"{what} must be HOST:PORT (e.g. 127.0.0.1:8080), got {shown}")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not host or any(c.isspace() or c in "[]/" for c in host):
        raise DashboardError(f"{what} must be HOST:PORT (IPv6 as [ADDR]:PORT), got {shown}")
    return host, int(port_text)


def plan_bind(address: str, *, token: str = "", tls_cert: str = "", tls_key: str = "",
              insecure: bool = False, what: str = "--dashboard",
              token_flag: str = "--dashboard-token",
              insecure_flag: str = "--dashboard-insecure") -> BindPlan:
    """Check the rules for listening on ``address``; raise :class:`DashboardError` naming the
    flag to add. Loopback needs nothing; anything else needs a token and TLS (or
    ``insecure``, which waives TLS only)."""
    host, port = split_address(address, what)
    if token and len(token) < MIN_TOKEN_CHARS:
        raise DashboardError(f"{token_flag}: a token needs at least {MIN_TOKEN_CHARS} "
                             f"characters (e.g. `python -c 'import secrets; "
                             f"print(secrets.token_urlsafe(24))'`)")
    if token and not token.isprintable():
        raise DashboardError(f"{token_flag}: the token must be printable characters")
    if bool(tls_cert) != bool(tls_key):
        raise DashboardError("TLS for the dashboard needs both a certificate and its key")
    if not is_loopback(host):
        if not token:
            raise DashboardError(f"{what} {address[:60]} is not a loopback address: anyone "
                                 f"who can reach it could read the run; give {token_flag} "
                                 f"(or listen on 127.0.0.1)")
        if not tls_cert and not insecure:
            raise DashboardError(f"{what} {address[:60]} is not a loopback address: the token "
                                 f"would cross the network in plain text; give --tls-cert and "
                                 f"--tls-key, or {insecure_flag} on a network you trust")
    return BindPlan(host=host, port=port, token=token, tls_cert=tls_cert, tls_key=tls_key)


def cookie_value(token: str) -> str:
    """What the cookie holds after a ``?token=`` visit: a digest of the token, not the token
    (a cookie store that leaks gives no token for the Authorization header or the CLI)."""
    return hmac.new(token.encode(), b"murmura-dashboard-cookie", hashlib.sha256).hexdigest()


def token_matches(expected: str, *, bearer: str | None = None, query: str | None = None,
                  cookie: str | None = None) -> bool:
    """Whether a request proves ``expected`` (compared in constant time): an
    ``Authorization: Bearer`` header, a ``?token=`` parameter, or the cookie set after one."""
    if not expected:
        return True
    key = expected.encode()
    ok = False  # every form is compared, so the time does not say which one was given
    for given in (bearer, query):
        ok |= given is not None and hmac.compare_digest(given.encode()[:1024], key)
    if cookie is not None:
        ok |= hmac.compare_digest(cookie.encode()[:128], cookie_value(expected).encode())
    return ok


def host_allowed(host_header: str, bound_host: str) -> bool:
    """On a loopback dashboard without a token: the Host header names this machine (a page
    on another site that rebinds its DNS name to 127.0.0.1 sends its own name and is refused)."""
    name = host_header.strip().lower()
    if name.startswith("["):
        name = name[: name.find("]") + 1] if "]" in name else name
    elif name.count(":") == 1:
        name = name.rsplit(":", 1)[0]
    if name in _LOOPBACK_NAMES or name.strip("[]") == bound_host.lower():
        return True
    try:
        return ipaddress.ip_address(name.strip("[]")).is_loopback
    except ValueError:
        return False


def resolve_run(root: Path, name: str) -> Path:
    """The run directory ``root/name``: a direct child of ``root`` holding a run's files.

    Raises :class:`DashboardError` for a name that is not a plain directory name (separators,
    ``..``, control characters: HTTP 400) and :class:`FileNotFoundError` when there is no such
    run (HTTP 404). A symbolic link leading out of ``root`` is no run of ``root``.
    """
    if not _RUN_NAME.fullmatch(name) or name in (".", "..") or ".." in name:
        raise DashboardError("a run name is one directory name: letters, digits, '.', '_', '-' "
                             "(no '/', no '..'), at most 128 characters")
    base = root.resolve()
    path = (base / name).resolve()
    if path.parent != base or not path.is_dir():
        raise FileNotFoundError(f"no run {name!r} in the dashboard's run directory")
    if not ((path / "metrics.jsonl").is_file() or (path / "summary.json").is_file()):
        raise FileNotFoundError(f"{name!r} holds no metrics.jsonl or summary.json")
    return path
