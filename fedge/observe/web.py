"""The coordinator's read-only web server: the dashboard page, its live parts, ``/api/state`` and ``/metrics``.

Off unless asked for (``fedge coordinator run --http HOST:PORT``, ``fedge dashboard RUN_DIR``). Rules, each
because the page shows what devices say about themselves to whoever reaches the port:

* **Loopback by default**; binding anything else (``0.0.0.0``, a LAN address, a host name) needs a token,
  and :func:`check_bind` refuses it without one. With a token every request must carry it — as
  ``Authorization: Bearer TOKEN`` (Prometheus' ``authorization`` setting) or as the password of HTTP
  basic auth (a browser asks for it; any user name) — compared in constant time.
* **Read-only**: GET and HEAD; anything else is 405. Nothing the server returns is built from a request's
  input but the path.
* **No secret leaves**: the token is never echoed, logged or put on a page; the request log (DEBUG)
  names method, path and status only; everything a device sent is HTML-escaped where the page shows it.
* Standard library only (``http.server`` on a thread per request); ``/metrics`` needs
  ``prometheus_client`` (``fedge[observe]``) and says so when it is missing.
"""

from __future__ import annotations

import base64
import contextlib
import hmac
import ipaddress
import json
import logging
import os
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from fedge.errors import ConfigError

log = logging.getLogger(__name__)

TOKEN_ENV = "FEDGE_HTTP_TOKEN"
MIN_TOKEN_CHARS = 16
DEFAULT_PORT = 8321
REQUEST_TIMEOUT_S = 30.0  # a connection idle this long is closed
DRAIN_S = 5.0  # how long stop() lets responses already being written finish
SECURITY_HEADERS = {
    # the page loads its one script from this server and draws SVG inline; nothing else is allowed
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self' 'unsafe-inline'; "
                               "img-src 'self' data:; connect-src 'self'; base-uri 'none'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}


@dataclass(frozen=True)
class Endpoint:
    """Where to serve: host and port (``--http HOST:PORT``)."""

    host: str
    port: int

    @property
    def loopback(self) -> bool:
        return is_loopback(self.host)


def is_loopback(host: str) -> bool:
    """Whether ``host`` is a loopback address (127.0.0.0/8, ::1) or ``localhost``. A host name other than
    localhost is not: it may resolve anywhere."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def parse_endpoint(text: str) -> Endpoint:
    """``HOST:PORT``, ``:PORT`` or ``PORT`` (loopback), ``[::1]:PORT``; :class:`ConfigError` otherwise."""
    text = text.strip()
    host, sep, port_text = text.rpartition(":")
    if not sep:
        host, port_text = "", text
    host = host.strip("[]") or "127.0.0.1"
    try:
        port = int(port_text)
    except ValueError:
        raise ConfigError(f"--http {text!r} is not HOST:PORT", hint="e.g. --http 127.0.0.1:8321") from None
    if not 0 <= port < 65536:
        raise ConfigError(f"--http port {port} is out of range")
    return Endpoint(host, port)


def load_token(token_file: str | None) -> str | None:
    """The access token: from ``token_file`` (first line), else ``$FEDGE_HTTP_TOKEN``, else None.

    At least :data:`MIN_TOKEN_CHARS` printable ASCII characters without spaces (what an ``Authorization``
    header and a browser's password field carry unchanged); a token file other users may read is taken
    with a warning (the token is no secret then).
    """
    token: str | None
    if token_file:
        path = Path(token_file)
        try:
            text = path.read_text().strip()
            mode = path.stat().st_mode
        except (OSError, UnicodeDecodeError) as exc:
            why = exc.strerror if isinstance(exc, OSError) else "it is not UTF-8 text"
            raise ConfigError(f"cannot read the HTTP token file {token_file}: {why}") from exc
        token = text.splitlines()[0].strip() if text else ""
        if mode & 0o077:
            log.warning("the HTTP token file %s may be read by other users (mode %03o): chmod 600 %s",
                        token_file, mode & 0o777, token_file)
    else:
        token = os.environ.get(TOKEN_ENV) or None
    hint = "e.g. python -c 'import secrets; print(secrets.token_urlsafe(32))' > token"
    if token is not None and len(token) < MIN_TOKEN_CHARS:
        raise ConfigError(f"the HTTP token is {len(token)} characters; at least {MIN_TOKEN_CHARS} are needed",
                          hint=hint)
    if token is not None and not (token.isascii() and token.isprintable() and " " not in token):
        raise ConfigError("the HTTP token must be printable ASCII without spaces (a header carries it)", hint=hint)
    return token


def check_bind(endpoint: Endpoint, token: str | None) -> None:
    """Refuse to serve a non-loopback address without a token (:class:`ConfigError` in words)."""
    if not endpoint.loopback and not token:
        raise ConfigError(
            f"refusing to serve the dashboard and /metrics on {endpoint.host}:{endpoint.port} without a token: "
            "anyone who reaches that address would see the fleet",
            hint=f"give --http-token-file FILE (or set {TOKEN_ENV}), or bind a loopback address "
                 f"(--http 127.0.0.1:{endpoint.port})")


@dataclass
class Routes:
    """What the server serves; each function is called per request (on the request's thread)."""

    page: Callable[[bool], str]  # the whole page (HTML); True: every device row (?all=1)
    fragment: Callable[[bool], str]  # its live part, fetched by the page's script every few seconds
    state: Callable[[], dict[str, Any]]  # /api/state
    metrics: Callable[[], bytes] | None = None  # /metrics (None: prometheus_client is missing)
    script: str = ""  # /dashboard.js


class DashboardServer:
    """A :class:`ThreadingHTTPServer` on its own daemon thread; see the module docstring.

    A connection that sends nothing for ``request_timeout_s`` is closed: an idle or stalled client (or one
    that only opens sockets) must not hold one of the server's threads for ever.
    """

    def __init__(self, routes: Routes, endpoint: Endpoint, token: str | None = None, *,
                 request_timeout_s: float = REQUEST_TIMEOUT_S) -> None:
        check_bind(endpoint, token)
        self.routes = routes
        self.endpoint = endpoint
        self._token = token
        self.requests = 0
        handler = _handler(self, request_timeout_s)
        try:
            self.httpd = ThreadingHTTPServer((endpoint.host, endpoint.port), handler)
        except OSError as exc:
            raise ConfigError(f"cannot serve on {endpoint.host}:{endpoint.port}: {exc.strerror}",
                              hint="pick another port (--http HOST:PORT; port 0 takes any free one)") from exc
        self.httpd.daemon_threads = True
        self._thread: threading.Thread | None = None
        # Responses being computed or written. Request threads are daemons (a stalled client must not keep the
        # coordinator alive), so stop() waits for these itself: a process that exits mid-response would cut a
        # client's read short (the run's last /metrics scrape, a page being loaded).
        self._busy = 0
        self._idle = threading.Condition()

    @property
    def url(self) -> str:
        host, port = self.httpd.server_address[:2]
        host = str(host)
        return f"http://{'[' + host + ']' if ':' in host else host}:{port}"

    def start(self) -> DashboardServer:
        self._thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.5},
                                        name="fedge-http", daemon=True)
        self._thread.start()
        log.info("dashboard on %s/ (metrics on %s/metrics)%s", self.url, self.url,
                 ", token required" if self._token else "")
        return self

    def stop(self, drain_s: float = DRAIN_S) -> None:
        """Stop accepting, let responses already under way finish (up to ``drain_s``), close the socket."""
        self.httpd.shutdown()
        self.httpd.server_close()
        if self._thread is not None:
            self._thread.join(5.0)
        with self._idle:
            if not self._idle.wait_for(lambda: self._busy == 0, timeout=drain_s):
                log.warning("stopped with %d response(s) still being written", self._busy)

    @contextlib.contextmanager
    def responding(self) -> Iterator[None]:
        """Count a response as under way (see :meth:`stop`)."""
        with self._idle:
            self._busy += 1
        try:
            yield
        finally:
            with self._idle:
                self._busy -= 1
                self._idle.notify_all()

    def authorized(self, header: str | None) -> bool:
        """Whether an ``Authorization`` header carries the token (always true without a token)."""
        if not self._token:
            return True
        if not header:
            return False
        scheme, _, value = header.partition(" ")
        given = ""
        if scheme.lower() == "bearer":
            given = value.strip()
        elif scheme.lower() == "basic":
            try:
                given = base64.b64decode(value.strip(), validate=True).decode("utf-8").partition(":")[2]
            except (ValueError, UnicodeDecodeError):
                return False
        return hmac.compare_digest(given.encode(), self._token.encode())


def _handler(server: DashboardServer, request_timeout_s: float) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        server_version = "fedge"
        sys_version = ""
        timeout = request_timeout_s  # socket timeout of each connection (StreamRequestHandler)

        def log_message(self, format: str, *args: Any) -> None:
            # method, path and status only (never headers: the token travels in one)
            log.debug("%s %s", self.address_string(), format % args)

        def _send(self, status: int, body: bytes, content_type: str, extra: dict[str, str] | None = None) -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            for k, v in {**SECURITY_HEADERS, **(extra or {})}.items():
                self.send_header(k, v)
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        def do_HEAD(self) -> None:
            self.do_GET()

        def do_GET(self) -> None:
            with server.responding():
                self._get()

        def _get(self) -> None:
            server.requests += 1
            if not server.authorized(self.headers.get("Authorization")):
                self._send(HTTPStatus.UNAUTHORIZED, b"a token is required\n", "text/plain; charset=utf-8",
                           {"WWW-Authenticate": 'Basic realm="fedge", charset="UTF-8"'})
                return
            path, _, query = self.path.partition("?")
            every_row = "all=1" in query.split("&")
            routes = server.routes
            try:
                if path in ("/", "/index.html"):
                    self._send(200, routes.page(every_row).encode(), "text/html; charset=utf-8")
                elif path == "/fragment":
                    self._send(200, routes.fragment(every_row).encode(), "text/html; charset=utf-8")
                elif path == "/dashboard.js":
                    self._send(200, routes.script.encode(), "text/javascript; charset=utf-8")
                elif path == "/api/state":
                    body = json.dumps(routes.state(), separators=(",", ":"), allow_nan=False).encode()
                    self._send(200, body, "application/json")
                elif path == "/metrics":
                    if routes.metrics is None:
                        self._send(HTTPStatus.NOT_IMPLEMENTED, b"/metrics needs prometheus_client: "
                                   b"pip install 'fedge[observe]'\n", "text/plain; charset=utf-8")
                    else:
                        from fedge.observe.metrics import CONTENT_TYPE

                        self._send(200, routes.metrics(), CONTENT_TYPE)
                elif path == "/healthz":
                    self._send(200, b"ok\n", "text/plain; charset=utf-8")
                else:
                    self._send(HTTPStatus.NOT_FOUND, b"not found\n", "text/plain; charset=utf-8")
            except (BrokenPipeError, ConnectionResetError):
                pass  # the client went away
            except Exception:  # a bug in a view must not take the server (or the coordinator) down
                log.exception("serving %s failed", path)
                with contextlib.suppress(OSError):  # the client may be gone as well
                    self._send(HTTPStatus.INTERNAL_SERVER_ERROR, b"internal error (see the coordinator's log)\n",
                               "text/plain; charset=utf-8")

        def _refuse(self) -> None:
            self._send(HTTPStatus.METHOD_NOT_ALLOWED, b"read-only: GET and HEAD only\n", "text/plain; charset=utf-8",
                       {"Allow": "GET, HEAD"})

        do_POST = do_PUT = do_DELETE = do_PATCH = do_OPTIONS = _refuse

    return Handler
