# The project's two HTTP pages started for an attack (the dashboard with its labelling desk, the device's label page)
# and a raw-socket client that plays the attacker.
from __future__ import annotations

import contextlib
import logging
import re
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from test_folder_pool import camera_oracle
from test_labelling_api import png

from coordinator.dashboard.server import Dashboard, ListenAddress
from coordinator.labelling.desk import LabellingDesk
from coordinator.labelling.queue import LabelQueue
from edge_agent.field.label_ui import LabelServer
from protocol.http_edge import EdgeLimits, EdgeServer
from protocol.label_messages import LabelQuery

FLEET = "edge"
CLASSES = ("cat", "dog", "bird")
STATUS_LINE = re.compile(rb"HTTP/1\.[01] (\d{3}) ")
JSON_POST = {"Content-Type": "application/json", "X-Requested-With": "edge-fal"}
FORM_POST = {"Content-Type": "application/x-www-form-urlencoded"}


@dataclass(frozen=True)
class Page:
    """A served page: its edge server, the path a post goes to, the headers the page's own posts carry and the
    names of the queries it holds."""

    name: str
    server: EdgeServer
    post_path: str
    post_headers: dict[str, str]
    queries: tuple[str, ...]

    @property
    def port(self) -> int:
        """The bound port."""
        return int(self.server.server_address[1])

    @property
    def host(self) -> str:
        """A Host header the page serves."""
        return f"127.0.0.1:{self.port}"

    def threads(self) -> int:
        """The server's connection threads now."""
        return sum(thread.name == f"{self.server.name}-http" for thread in threading.enumerate())


@contextlib.contextmanager
def dashboard_page(run_dir: Path, desk: LabellingDesk | None, limits: EdgeLimits) -> Iterator[Page]:
    """An open loopback dashboard (no token) with the desk's labelling API."""
    with Dashboard(ListenAddress("127.0.0.1", 0), run_dir, None, None, desk, limits=limits) as dashboard:
        yield Page("dashboard", dashboard.server, "/api/label/answer", JSON_POST, ("q1", "q2"))


def labelling_desk(run_dir: Path, session) -> LabellingDesk:
    """A desk over a queue holding two queries of device cam-1, on a real broker session."""
    queue = LabelQueue(run_dir, CLASSES)
    for query_id in ("q1", "q2"):
        queue.add(LabelQuery("cam-1", query_id, png(), "image/png", 1.0, 1, 0.7, 0.3, 0.5), "cam-1")
    return LabellingDesk(FLEET, session, queue).start()


@contextlib.contextmanager
def device_page(root: Path, limits: EdgeLimits) -> Iterator[Page]:
    """The device's label page over three real PNG queries."""
    oracle = camera_oracle(root, 3)
    oracle.start_round(1)
    oracle.ask(np.arange(3))
    server = LabelServer(oracle.book, limits=limits).start()
    try:
        names = tuple(query.name for query in oracle.book.queries())
        yield Page("device page", server.server, "/label", FORM_POST, names)
    finally:
        server.stop()


@contextlib.contextmanager
def served_page(kind: str, request, root: Path, limits: EdgeLimits) -> Iterator[Page]:
    """A page of the kind a test is parametrised with: the dashboard (its desk on the module's broker) or the
    device's label page."""
    if kind == "device page":
        with device_page(root, limits) as served:
            yield served
        return
    broker = request.getfixturevalue("module_broker")
    session = request.getfixturevalue("sessions")(broker.address, f"desk-{time.monotonic_ns()}", manual_ack=True)
    desk = labelling_desk(root / "run", session)
    try:
        with dashboard_page(root / "run", desk, limits) as served:
            yield served
    finally:
        desk.stop()


def connect(port: int, source: str = "127.0.0.1", timeout: float = 5.0) -> socket.socket:
    """A raw TCP connection to the page from a loopback source address (127.0.0.0/8 is all loopback)."""
    sock = socket.socket()
    sock.settimeout(timeout)
    sock.bind((source, 0))
    sock.connect(("127.0.0.1", port))
    return sock


def exchange(port: int, data: bytes, source: str = "127.0.0.1", timeout: float = 5.0) -> tuple[int, bytes]:
    """(status, whole response) of raw bytes sent on one connection; status 0 when the server closed without one."""
    with connect(port, source, timeout) as sock:
        try:
            sock.sendall(data)
            sock.shutdown(socket.SHUT_WR)
        # the server may answer and close before it has read all we send (a refusal): read what it said
        except OSError:
            pass
        chunks = []
        with contextlib.suppress(OSError):
            while chunk := sock.recv(65536):
                chunks.append(chunk)
    response = b"".join(chunks)
    match = STATUS_LINE.match(response)
    return (int(match[1]) if match else 0), response


def request(
    method: str, path: str, host: str | None, headers: dict[str, str] | None = None, body: bytes = b""
) -> bytes:
    """A raw HTTP/1.1 request: a Host header unless host is None, the headers as given, the body as given."""
    lines = [f"{method} {path} HTTP/1.1"] + ([f"Host: {host}"] if host is not None else [])
    lines += [f"{name}: {value}" for name, value in (headers or {}).items()]
    return on_the_wire("\r\n".join(lines) + "\r\n\r\n") + body


def on_the_wire(text: str) -> bytes:
    """A request's head as bytes: characters up to U+00FF as their one Latin-1 byte (as http.server reads them, so
    "²" arrives as "²"), others in UTF-8."""
    return b"".join(char.encode("latin-1") if ord(char) < 256 else char.encode("utf-8") for char in text)


def body_of(response: bytes) -> bytes:
    """A response's body."""
    return response.partition(b"\r\n\r\n")[2]


class Tracebacks(logging.Handler):
    """Collects every log record that carries a traceback, from any logger."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        """Keeps a record with exception info."""
        if record.exc_info:
            self.records.append(record)


@contextlib.contextmanager
def tracebacks() -> Iterator[list[logging.LogRecord]]:
    """The records with a traceback logged during a with-block."""
    handler = Tracebacks()
    root = logging.getLogger()
    root.addHandler(handler)
    try:
        yield handler.records
    finally:
        root.removeHandler(handler)
