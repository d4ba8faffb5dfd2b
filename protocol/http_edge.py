# The HTTP edge every page the project serves stands on: bounded connections, request deadlines, the Host rule;
# protocol.http_requests parses what a request holds.
from __future__ import annotations

import io
import ipaddress
import logging
import re
import socket
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from email.message import Message
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import urlsplit

from protocol.http_requests import HttpRefusal, read_body
from protocol.wire import shown

log = logging.getLogger(__name__)

LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})
WILDCARD_HOSTS = frozenset({"", "0.0.0.0", "::"})
HOST_HEADER = re.compile(r"(?:\[(?P<v6>[0-9A-Fa-f:.]{2,45})\]|(?P<name>[A-Za-z0-9.-]{1,253}))(?::[0-9]{1,5})?")
BUSY_BODY = b"too many connections; try again in a few seconds\n"
BUSY_REPLY = (
    b"HTTP/1.0 503 Service Unavailable\r\nContent-Type: text/plain\r\nRetry-After: 10\r\nConnection: close\r\n"
    + f"Content-Length: {len(BUSY_BODY)}\r\n\r\n".encode()
    + BUSY_BODY
)
REFUSAL_LOG_SECONDS = 60.0
LINGER_SECONDS = 1.0
LINGER_BYTES = 256 * 1024
HOST_HELP = (
    "a name the page answers to (repeatable), beside loopback and the bound address: the DNS name people type, "
    "e.g. a reverse proxy's; any other Host is refused (421), against DNS rebinding"
)


@dataclass(frozen=True)
class EdgeLimits:
    """How long a client may take and how much it may hold: its request (line, headers and body) must arrive within
    `request_seconds` of the accept, no read waits more than `read_seconds`, each response write has `write_seconds`,
    and beyond `connections` open connections (or `per_client` from one address) a new one is answered 503 at once,
    without a thread."""

    read_seconds: float = 5.0
    request_seconds: float = 10.0
    write_seconds: float = 30.0
    connections: int = 64
    per_client: int = 16


DEFAULT_LIMITS = EdgeLimits()


@dataclass(frozen=True)
class HostRule:
    """The names a server answers to, the defence against DNS rebinding: a rebinding page reaches the server under
    the attacker's own DNS name, which is never one of these. Loopback names always; beyond loopback also the bound
    address, the machine's name (and `NAME.local`), the names the operator serves, and any address typed as an
    address (no DNS, so no rebinding). The port is not checked: an SSH tunnel forwards from another port."""

    names: frozenset[str]
    any_address: bool

    @classmethod
    def serving(cls, bound: str, extra: Iterable[str] = ()) -> HostRule:
        """The rule of a server bound to `bound` that also answers to the `extra` names."""
        names = set(LOOPBACK_NAMES) | {name.lower() for name in extra}
        beyond = not is_loopback(bound)
        if beyond:
            machine = socket.gethostname().lower()
            names |= {machine, f"{machine}.local"} | ({bound.lower()} - WILDCARD_HOSTS)
        return cls(frozenset(names), beyond)

    def allows(self, host: str) -> bool:
        """Whether a Host header names this server."""
        match = HOST_HEADER.fullmatch(host.strip())
        if match is None:
            return False
        name = (match["v6"] or match["name"]).lower()
        if name in self.names:
            return True
        try:
            address = ipaddress.ip_address(name)
        # ipaddress raises ValueError for a DNS name: only the listed names are served
        except ValueError:
            return False
        return self.any_address or address.is_loopback


def is_loopback(host: str) -> bool:
    """True for localhost and loopback addresses (127.0.0.0/8, ::1)."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    # ipaddress raises ValueError for a host name that is no address: not a loopback literal
    except ValueError:
        return False


def same_origin(headers: Message) -> bool:
    """Whether a request's `Origin`, when sent, names the Host it was sent to (which the server has allowed)."""
    origin = headers.get("Origin")
    if origin is None:
        return True
    parts = urlsplit(origin)
    return parts.scheme in ("http", "https") and parts.netloc == headers.get("Host", "")


class DeadlineReader(io.RawIOBase):
    """A socket read under a request's deadline: each recv waits at most `read_seconds` and never past the deadline,
    so a client sending a byte every few seconds is cut off as surely as a silent one."""

    def __init__(self, sock: socket.socket, deadline: float, read_seconds: float, timed_out: Callable[[], None]):
        super().__init__()
        self.sock = sock
        self.deadline = deadline
        self.read_seconds = read_seconds
        self.timed_out = timed_out

    def readable(self) -> bool:
        """A reader."""
        return True

    def readinto(self, buffer: Any) -> int:
        """Reads what has arrived, waiting no later than the deadline (TimeoutError past it)."""
        remaining = self.deadline - time.monotonic()
        try:
            if remaining <= 0:
                raise TimeoutError("the request's deadline passed")
            self.sock.settimeout(min(self.read_seconds, remaining))
            return self.sock.recv_into(buffer)
        except TimeoutError:
            self.timed_out()
            raise


@dataclass(frozen=True)
class EdgeHealth:
    """What a server says of itself for a health view: whether it serves, its open connections, the connections it
    refused at its bounds and the requests cut off by their deadlines."""

    serving: bool
    open_connections: int
    refused_connections: int
    timed_out_requests: int


class EdgeServer(ThreadingHTTPServer):
    """A threading HTTP server with bounded connections (beyond the bound a new one gets 503 without a thread),
    request deadlines, the Host rule, and handler failures logged as one structured line with their traceback."""

    daemon_threads = True
    block_on_close = False
    # the listen backlog: a burst of connections waits for the accept loop, not for SYN retries
    request_queue_size = 128

    def __init__(
        self,
        address: tuple[str, int],
        handler: type[EdgeHandler],
        name: str,
        hosts: HostRule,
        limits: EdgeLimits = DEFAULT_LIMITS,
    ) -> None:
        self.address_family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        self.name = name
        self.hosts = hosts
        self.limits = limits
        self._lock = threading.Lock()
        self._open: Counter[str] = Counter()
        self._refusals_logged: dict[str, float] = {}
        self._serving = False
        self.refused = 0
        self.timed_out = 0
        super().__init__(address, handler)

    @property
    def serving(self) -> bool:
        """Whether the accept loop runs."""
        return self._serving

    def health(self) -> EdgeHealth:
        """The server's health now."""
        with self._lock:
            return EdgeHealth(self._serving, sum(self._open.values()), self.refused, self.timed_out)

    def serve_forever(self, poll_interval: float = 0.5) -> None:
        """Accepts until shutdown, saying meanwhile that it serves."""
        self._serving = True
        try:
            super().serve_forever(poll_interval)
        finally:
            self._serving = False

    def process_request(self, request: Any, client_address: Any) -> None:
        """Starts a thread for the connection if the bounds allow it; else answers 503 and closes it at once."""
        client = str(client_address[0])
        with self._lock:
            admitted = (
                sum(self._open.values()) < self.limits.connections and self._open[client] < self.limits.per_client
            )
            if admitted:
                self._open[client] += 1
            else:
                self.refused += 1
        if not admitted:
            self.refuse_connection(request, client)
            return
        thread = threading.Thread(
            target=self.process_request_thread, args=(request, client_address), name=f"{self.name}-http", daemon=True
        )
        try:
            thread.start()
        # the process has no thread left to give (RuntimeError): refuse the connection, keep its place free
        except RuntimeError:
            self.release(client)
            self.refuse_connection(request, client)

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        """Handles the connection, then frees its place."""
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.release(str(client_address[0]))

    def release(self, client: str) -> None:
        """Frees a connection's place."""
        with self._lock:
            self._open[client] -= 1
            self._open += Counter()

    def refuse_connection(self, request: socket.socket, client: str) -> None:
        """503 without reading or waiting, then close; one log line per client a minute names it."""
        try:
            request.setblocking(False)
            request.send(BUSY_REPLY)
        # the client's buffer full or the connection gone: it is closed either way
        except OSError:
            pass
        request.close()
        now = time.monotonic()
        with self._lock:
            if now - self._refusals_logged.get(client, -REFUSAL_LOG_SECONDS) < REFUSAL_LOG_SECONDS:
                return
            if len(self._refusals_logged) > 1024:
                self._refusals_logged.clear()
            self._refusals_logged[client] = now
            held = self._open[client]
        log.warning(
            "http connection refused server=%s client=%s holds=%d bound=%d per_client=%d",
            self.name,
            client,
            held,
            self.limits.connections,
            self.limits.per_client,
        )

    def count_timeout(self) -> None:
        """Counts a request cut off by its deadline."""
        with self._lock:
            self.timed_out += 1

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A connection's failure: a client gone is one line, anything else a bug logged with its traceback (the
        server keeps serving either way)."""
        client = client_address[0] if client_address else "?"
        error = sys.exc_info()[1]
        if isinstance(error, OSError):
            log.info("http connection lost server=%s client=%s (%s)", self.name, client, shown(str(error)))
        else:
            log.exception("http handler failed server=%s client=%s", self.name, client)


def linger(connection: socket.socket) -> None:
    """Half-closes a connection and reads what is still coming, up to LINGER_BYTES and LINGER_SECONDS."""
    try:
        connection.shutdown(socket.SHUT_WR)
        deadline = time.monotonic() + LINGER_SECONDS
        drained = 0
        while drained < LINGER_BYTES and (remaining := deadline - time.monotonic()) > 0:
            connection.settimeout(remaining)
            chunk = connection.recv(65536)
            if not chunk:
                break
            drained += len(chunk)
    # the client gone, or still sending past the linger: the server closes it now
    except OSError:
        pass


class EdgeHandler(BaseHTTPRequestHandler):
    """A request handler on an EdgeServer: reads under the deadline, refuses a Host the server does not serve and a
    method it has no `do_` for, turns an HttpRefusal into its bounded status, and a bug into a logged 500."""

    server: EdgeServer
    responded = False

    def setup(self) -> None:
        """The connection's reader under the request's deadline (the plain one is closed so the socket closes)."""
        super().setup()
        self.rfile.close()
        limits = self.server.limits
        reader = DeadlineReader(
            self.connection,
            time.monotonic() + limits.request_seconds,
            limits.read_seconds,
            self.server.count_timeout,
        )
        self.rfile = io.BufferedReader(reader)

    def finish(self) -> None:
        """Flushes the answer; after one, drains what the client sent and the handler did not read (a refused body)
        for up to a second, so closing sends no reset that would destroy the answer in flight."""
        super().finish()
        if self.responded:
            linger(self.connection)

    def handle_one_request(self) -> None:
        """One request; a refusal gets its status, a bug its traceback in the log and a 500 if nothing was sent."""
        try:
            super().handle_one_request()
        except HttpRefusal as refusal:
            self.close_connection = True
            self.refuse(refusal)
        # the client gone mid-request is no bug: the server's handle_error logs it as one line
        except OSError:
            raise
        except Exception:
            self.close_connection = True
            log.exception(
                "http handler failed server=%s request=%s",
                self.server.name,
                shown(getattr(self, "requestline", ""), 120),
            )
            if not self.responded:
                self.refuse(HttpRefusal(HTTPStatus.INTERNAL_SERVER_ERROR, "the server failed (logged)"))

    def parse_request(self) -> bool:
        """The stdlib's parse, then one Host the server serves and a method it has."""
        if not super().parse_request():
            return False
        hosts = self.headers.get_all("Host") or []
        if len(hosts) != 1:
            self.refuse(HttpRefusal(HTTPStatus.BAD_REQUEST, "exactly one Host header is required"))
        elif not self.server.hosts.allows(hosts[0]):
            reason = f"this server does not answer to host {shown(hosts[0])}"
            self.refuse(HttpRefusal(HTTPStatus.MISDIRECTED_REQUEST, reason))
        elif not hasattr(self, f"do_{self.command}"):
            self.refuse(HttpRefusal(HTTPStatus.METHOD_NOT_ALLOWED, f"method {shown(self.command, 40)} is not served"))
        else:
            return True
        return False

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        """The stdlib's refusals (a malformed request line or headers) as a bounded refusal, with a status line
        (a line the stdlib took for HTTP/0.9 would get none)."""
        self.close_connection = True
        self.request_version = self.protocol_version
        self.refuse(HttpRefusal(HTTPStatus(code), message or HTTPStatus(code).phrase))

    def refuse(self, refusal: HttpRefusal) -> None:
        """Logs a refusal as one line naming the client, and sends it."""
        log.info(
            "http request refused server=%s client=%s status=%d reason=%s",
            self.server.name,
            self.client_address[0],
            refusal.status,
            shown(refusal.reason, 120),
        )
        self.send_refusal(refusal)

    def send_refusal(self, refusal: HttpRefusal) -> None:
        """Sends a refusal as one line of plain text (a page that speaks JSON overrides this)."""
        self.send_body(refusal.status, f"{refusal.reason}\n".encode(), "text/plain; charset=utf-8")

    def send_response(self, code: int, message: str | None = None) -> None:
        """Starts a response under the write deadline."""
        self.responded = True
        self.connection.settimeout(self.server.limits.write_seconds)
        super().send_response(code, message)

    def send_body(
        self, status: HTTPStatus, data: bytes, content_type: str, headers: dict[str, str] | None = None
    ) -> None:
        """Sends a complete response, never cached."""
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.send_header("Cache-Control", "no-store")
        if status == HTTPStatus.METHOD_NOT_ALLOWED:
            self.send_header("Allow", ", ".join(name[3:] for name in dir(self) if name.startswith("do_")))
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    def read_body(self, limit: int) -> bytes:
        """The request's body, at most `limit` bytes (HttpRefusal otherwise)."""
        return read_body(self.headers, self.rfile, limit)

    def log_message(self, format: str, *args: object) -> None:
        """Request lines go to the debug log, not to stderr."""
        log.debug("http server=%s client=%s %s", self.server.name, self.client_address[0], shown(format % args, 200))

    def log_error(self, format: str, *args: object) -> None:
        """The stdlib's own complaints (a request cut off by its deadline) as one bounded info line."""
        log.info("http server=%s client=%s %s", self.server.name, self.client_address[0], shown(format % args, 200))
