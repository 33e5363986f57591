"""What the local server accepts before any route runs: the Host names it serves and the web pages (Origins)
the user allowed. A browser on this computer can reach the server from any web page, so:

- Host: the name the client used must be one the server serves, or a page whose name the attacker
  re-points at 127.0.0.1 (DNS rebinding) could read the answers. Accepted: `localhost` (and names under
  `.localhost`) and loopback addresses, the address the connection arrived on (a LAN address when other
  devices are allowed), each with the server's port; and the names the user adds (`allowed_hosts`, any
  port: a reverse proxy's name; `*` turns the check off). A request without a Host header (HTTP/1.0, not a
  browser) is let through.
- Origin: a browser names the page that sends a request. No Origin (curl, SDKs, editors) or the server's
  own origin is accepted; any other page or extension only when its origin is on the allow-list
  (`allowed_origins`: exact origins such as `chrome-extension://ID` or `http://localhost:3000`, `null`, or
  `*`), empty by default. So a cross-site form or `text/plain` POST never reaches the engine.
  Preflight (OPTIONS) and the CORS headers for allowed origins come from Starlette's CORSMiddleware.

Refusals use OpenAI's error body: 400 `host_not_allowed`, 403 `origin_not_allowed`, with the way to allow it.

    middleware = guard.middleware(allowed_origins=("chrome-extension://abc",), allowed_hosts=("gpu-box.lan",))
"""
from __future__ import annotations

import ipaddress
import logging
from typing import Iterable, Optional, Sequence
from urllib.parse import urlsplit

from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from app.serve.disconnect import CancelOnDisconnect

ANY = "*"
MAX_ENTRY_CHARS = 253               # a DNS name's longest; origins with a scheme and port a little more
log = logging.getLogger("moedesk.serve")


def error_response(status: int, message: str, code: str, type: str = "invalid_request_error") -> JSONResponse:
    """A refusal in OpenAI's error shape."""
    return JSONResponse({"error": {"message": message, "type": type, "param": None, "code": code}},
                        status_code=status)


# ----------------------------------------------------------------------------------------------
# The allow-lists (settings, the command line): checked once, when the server starts

def parse_origins(entries: Iterable[str]) -> tuple[str, ...]:
    """Allowed origins, normalised (scheme and host in lower case, no trailing slash); ValueError in words."""
    out = []
    for entry in entries:
        text = entry.strip().rstrip("/")
        if text in (ANY, "null"):
            out.append(text)
            continue
        parts = urlsplit(text)
        try:
            parts.port                   # noqa: B018 - raises on a port that is not a number
        except ValueError:
            parts = None
        if (len(text) > MAX_ENTRY_CHARS + 40 or parts is None or not parts.scheme or not parts.hostname
                or parts.path or parts.query or parts.fragment or parts.username or parts.password):
            raise ValueError(f"allowed origin {entry!r}: write it as scheme://host[:port] with nothing after, "
                             "e.g. http://localhost:3000 or chrome-extension://EXTENSION_ID (or * for any page)")
        out.append(f"{parts.scheme.lower()}://{parts.netloc.lower()}")
    return tuple(dict.fromkeys(out))


def parse_hosts(entries: Iterable[str]) -> tuple[str, ...]:
    """Extra host names, in lower case without a port or trailing dot; ValueError in words."""
    out = []
    for entry in entries:
        text = entry.strip().lower().rstrip(".")
        if text == ANY:
            out.append(text)
            continue
        name = text[1:-1] if text.startswith("[") and text.endswith("]") else text
        if not name or len(name) > MAX_ENTRY_CHARS or any(c in name for c in "/@ ?#") or (
                ":" in name and not _is_ip(name)):
            raise ValueError(f"allowed host {entry!r}: give a host name or address without scheme or port, "
                             "e.g. gpu-box.lan or 192.168.1.20 (or * for any)")
        out.append(name)
    return tuple(dict.fromkeys(out))


def _is_ip(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
        return True
    except ValueError:
        return False


def split_host(header: str) -> tuple[str, Optional[int]]:
    """'Name:8642' -> ('name', 8642); '[::1]:80' -> ('::1', 80); the port is None when absent, -1 when bad."""
    header = header.strip().lower()
    if header.startswith("["):
        name, _, rest = header[1:].partition("]")
        port = rest[1:] if rest.startswith(":") else (None if not rest else "x")
    elif header.count(":") == 1:
        name, port = header.split(":")
    else:
        name, port = header, None
    if port is None:
        return name.rstrip("."), None
    return name.rstrip("."), int(port) if port.isdigit() and len(port) <= 5 else -1


def is_loopback_name(name: str) -> bool:
    if name == "localhost" or name.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


# ----------------------------------------------------------------------------------------------
# The middleware

class HostOriginGuard:
    """Refuses requests for other Host names and from web pages that are not allowed (see the module)."""

    def __init__(self, app: ASGIApp, allowed_origins: Sequence[str] = (), allowed_hosts: Sequence[str] = ()):
        self.app = app
        self.origins = frozenset(allowed_origins)
        self.hosts = frozenset(allowed_hosts)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            refusal = self.refusal(scope)
            if refusal is not None:
                await refusal(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def refusal(self, scope: Scope) -> Optional[JSONResponse]:
        headers = {}
        for key, value in scope.get("headers", ()):
            name = key.decode("latin-1").lower()
            if name in ("host", "origin"):
                if name in headers:          # two Host or Origin headers: the server cannot tell which one counts
                    return error_response(400, f"the request has two {name.capitalize()} headers", f"{name}_not_allowed")
                headers[name] = value.decode("latin-1")
        host = headers.get("host")
        if host is not None and not self.host_allowed(host, scope.get("server")):
            log.warning("refused a request for the host name %r (not one this server serves)", host[:100])
            return error_response(400, f"this server does not answer to the host name {host[:100]!r}; it serves "
                                       "localhost and its own addresses on its port. To use another name (a reverse "
                                       "proxy, a LAN name), add it to the allowed hosts: Settings → Local server, or "
                                       "`moedesk serve --allow-host NAME`", "host_not_allowed")
        origin = headers.get("origin")
        if origin is not None and not self.origin_allowed(origin, host):
            log.warning("refused a request from the web page origin %r (not on the allowed origins)", origin[:100])
            return error_response(403, f"requests from the web page or extension at {origin[:100]!r} are not "
                                       "allowed. To allow it, add its origin to the allowed origins: Settings → "
                                       "Local server, or `moedesk serve --allow-origin ORIGIN`", "origin_not_allowed")
        return None

    def host_allowed(self, header: str, server: Optional[tuple]) -> bool:
        name, port = split_host(header)
        if ANY in self.hosts or name in self.hosts:
            return True
        own_port = server[1] if server else None
        if port is None:
            port = 80
        own = name == str(server[0]).lower() if server else False
        return port == own_port and (is_loopback_name(name) or own)

    def origin_allowed(self, origin: str, host: Optional[str]) -> bool:
        text = origin.strip().rstrip("/").lower()
        if ANY in self.origins or text in self.origins:
            return True
        return host is not None and text == f"http://{host.strip().lower()}"      # the server's own origin


def middleware(allowed_origins: Sequence[str] = (), allowed_hosts: Sequence[str] = ()) -> list[Middleware]:
    """The server's middleware, outermost first: the guard, CORS for the allowed origins, cancel on disconnect."""
    origins, hosts = parse_origins(allowed_origins), parse_hosts(allowed_hosts)
    return [Middleware(HostOriginGuard, allowed_origins=origins, allowed_hosts=hosts),
            Middleware(CORSMiddleware, allow_origins=origins, allow_methods=("GET", "POST"), allow_headers=("*",),
                       allow_private_network=True, max_age=600),
            Middleware(CancelOnDisconnect)]
