# The dashboard's HTTP server on a background thread: static pages, JSON API, /metrics and the labelling API, bearer
# token off loopback.
from __future__ import annotations

import hmac
import json
import logging
import os
import re
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from http import HTTPStatus
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

from coordinator.dashboard import labelling_api
from coordinator.dashboard.labelling_api import Reply
from coordinator.dashboard.live import LiveState
from coordinator.dashboard.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from coordinator.dashboard.metrics import render_metrics
from coordinator.dashboard.views import (
    SnapshotCache,
    class_accuracy_view,
    devices_view,
    divergence_view,
    health_view,
    json_safe,
    labelling_view,
    rounds_view,
    run_view,
)
from coordinator.labelling.desk import LabellingDesk
from coordinator.labelling.queue_records import QueueStatus
from coordinator.storage.serving_history import serving_stack
from protocol import wire
from protocol.errors import UsageError
from protocol.files import atomic_write_bytes
from protocol.http_edge import DEFAULT_LIMITS, EdgeHandler, EdgeLimits, EdgeServer, HostRule, is_loopback, same_origin
from protocol.http_requests import HttpRefusal
from protocol.supervision import Health, SupervisedThread

log = logging.getLogger(__name__)

STATIC_DIR = Path(__file__).parent / "static"
STATIC_FILES = {
    "/": ("index.html", "text/html; charset=utf-8"),
    "/dashboard.js": ("dashboard.js", "text/javascript; charset=utf-8"),
    "/dashboard.css": ("dashboard.css", "text/css; charset=utf-8"),
    "/label": ("label.html", "text/html; charset=utf-8"),
    "/label.js": ("label.js", "text/javascript; charset=utf-8"),
}
LABEL_API = "/api/label/"
# Without a bearer token (loopback) a POST must carry this header: a cross-site page cannot send it without a CORS
# preflight, which this server never grants, so no other site can post answers through a person's browser.
SAME_ORIGIN_HEADER = ("X-Requested-With", "edge-fal")
ROUND_PATH = re.compile(r"/api/rounds/([0-9]{1,9})/(divergence|class-accuracy)")
TOKEN_FILE = "dashboard-token"
SERVED_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9.-]{0,252}|\[[0-9A-Fa-f:.]{2,45}\]")


@dataclass(frozen=True)
class ListenAddress:
    """Where the dashboard listens; a host beyond loopback needs a bearer token."""

    host: str
    port: int

    @property
    def loopback(self) -> bool:
        """True for localhost, 127.0.0.0/8 and ::1."""
        return is_loopback(self.host)


def parse_listen_address(text: str, flag: str = "--dashboard") -> ListenAddress:
    """[HOST:]PORT -> ListenAddress (loopback 127.0.0.1 without a host; [::1]:PORT for IPv6); else a UsageError
    naming `flag`."""
    match = re.fullmatch(r"(?:\[(?P<v6>[0-9A-Fa-f:.]+)\]:|(?P<host>[A-Za-z0-9.-]+):)?(?P<port>\d{1,5})", text)
    if match is None or int(match["port"]) > 65535:
        raise UsageError(f"{flag} must look like [HOST:]PORT (e.g. 8080 or 0.0.0.0:8080), got {text!r}")
    return ListenAddress(match["v6"] or match["host"] or "127.0.0.1", int(match["port"]))


def served_names(names: list[str] | None) -> tuple[str, ...]:
    """The --dashboard-host names checked (DNS names or addresses, no port): the names the dashboard answers to
    beside its bound address and loopback; UsageError for anything else."""
    for name in names or []:
        if not SERVED_NAME.fullmatch(name):
            raise UsageError(f"--dashboard-host must be a host name or address without a port, got {wire.shown(name)}")
    return tuple(name.lower().strip("[]") for name in names or [])


def dashboard_token(address: ListenAddress, given: str | None, run_dir: Path) -> str | None:
    """The bearer token the API requires: the given one; else, off loopback, a fresh one written to
    RUN_DIR/dashboard-token (mode 0600); else none (loopback without --dashboard-token is open)."""
    if given is not None:
        if len(given) < 16:
            raise UsageError("--dashboard-token must be at least 16 characters")
        return given
    if address.loopback:
        return None
    token = secrets.token_hex(24)  # (hex: a token never starts with '-', which a command line would take for a flag)
    path = run_dir / TOKEN_FILE
    atomic_write_bytes(path, token.encode())
    os.chmod(path, 0o600)
    return token


class DashboardHTTPServer(EdgeServer):
    """The dashboard's edge server, knowing the run directory, the live state and the token its handlers check."""

    def __init__(
        self,
        address: ListenAddress,
        run_dir: Path,
        live: LiveState | None,
        token: str | None,
        labelling: LabellingDesk | None = None,
        hosts: tuple[str, ...] = (),
        limits: EdgeLimits = DEFAULT_LIMITS,
        health: Health | None = None,
    ) -> None:
        try:
            super().__init__(
                (address.host, address.port),
                DashboardHandler,
                "dashboard",
                HostRule.serving(address.host, hosts),
                limits,
            )
        except OSError as error:
            raise UsageError(
                f"--dashboard {address.host}:{address.port}: cannot listen ({error.strerror or error})"
            ) from None
        self.snapshots = SnapshotCache(run_dir)
        self.live = live
        self.token = token
        self.labelling = labelling
        self.parts_health = health or (live.health if live is not None else Health())


class DashboardHandler(EdgeHandler):
    """Serves the page and its assets to anyone who can reach it, and the data only with the token."""

    server: DashboardHTTPServer

    def do_GET(self) -> None:
        """Routes one GET request; every failure becomes a JSON error with a specific status."""
        path = self.path.split("?", 1)[0]
        if path in STATIC_FILES:
            name, content_type = STATIC_FILES[path]
            self.send_body(HTTPStatus.OK, (STATIC_DIR / name).read_bytes(), content_type)
        elif not self.authorised():
            self.send_json(
                HTTPStatus.UNAUTHORIZED,
                {"error": "a bearer token is required (Authorization: Bearer ...)"},
                {"WWW-Authenticate": "Bearer"},
            )
        elif path == "/metrics":
            self.send_body(HTTPStatus.OK, self.metrics().encode(), METRICS_CONTENT_TYPE)
        elif path.startswith(LABEL_API):
            self.send_reply(
                self.label_reply(lambda desk: labelling_api.get(desk, path, parse_qs(urlsplit(self.path).query)))
            )
        else:
            status, body = self.api(path)
            self.send_json(status, body)

    def do_POST(self) -> None:
        """The labelling API's answers, corrections, undos and skips: JSON, with the token (or, on an open loopback
        dashboard, the same-origin header), from this page's origin only."""
        path = self.path.split("?", 1)[0]
        if not path.startswith(LABEL_API):
            self.send_reply(labelling_api.error(HTTPStatus.NOT_FOUND, f"no such path {wire.shown(path)}"))
        elif self.server.token is not None and not self.authorised():
            self.send_json(
                HTTPStatus.UNAUTHORIZED, {"error": "a bearer token is required"}, {"WWW-Authenticate": "Bearer"}
            )
        elif not self.same_origin():
            self.send_reply(labelling_api.error(HTTPStatus.FORBIDDEN, "posts come from the labelling page only"))
        elif self.headers.get("Content-Type", "").split(";")[0].strip() != "application/json":
            self.send_reply(labelling_api.error(HTTPStatus.UNSUPPORTED_MEDIA_TYPE, "the body must be application/json"))
        else:
            body = self.read_body(labelling_api.body_limit(path))
            self.send_reply(self.label_reply(lambda desk: labelling_api.post(desk, path, body)))

    def same_origin(self) -> bool:
        """Whether a POST comes from this server's own page: an Origin header, when sent, naming the (allowed) Host,
        and (with no token to prove it) the same-origin header."""
        name, value = SAME_ORIGIN_HEADER
        return same_origin(self.headers) and (self.server.token is not None or self.headers.get(name) == value)

    def send_refusal(self, refusal: HttpRefusal) -> None:
        """A refusal as the API's JSON error."""
        self.send_reply(labelling_api.error(refusal.status, refusal.reason))

    def label_reply(self, answer: Callable[[LabellingDesk], Reply]) -> Reply:
        """The labelling API's reply, or 404 when this coordinator keeps no labelling queue."""
        if self.server.labelling is None:
            return labelling_api.error(HTTPStatus.NOT_FOUND, "this coordinator keeps no labelling queue")
        return answer(self.server.labelling)

    def send_reply(self, reply: Reply) -> None:
        """Sends a labelling API reply: JSON, or raw bytes."""
        if reply.body is not None:
            self.send_json(reply.status, reply.body)
        else:
            self.send_body(reply.status, reply.data, reply.content_type)

    def authorised(self) -> bool:
        """True without a token, or when the Authorization header carries it."""
        if self.server.token is None:
            return True
        header = self.headers.get("Authorization", "")
        scheme, _, given = header.partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), self.server.token.encode())

    def api(self, path: str) -> tuple[HTTPStatus, dict]:
        """(status, body) of a JSON API path, read from a fresh store snapshot and the live state."""
        live, snapshot = self.server.live, self.server.snapshots.get()
        if path == "/api/run":
            return HTTPStatus.OK, {**run_view(snapshot, live), "health": health_view(self.server.parts_health)}
        if path == "/api/devices":
            status = self.queue_status()
            return HTTPStatus.OK, {"devices": devices_view(snapshot, live, status), "labelling": labelling_view(status)}
        if path == "/api/rounds":
            return HTTPStatus.OK, {"rounds": rounds_view(snapshot)}
        match = ROUND_PATH.fullmatch(path)
        if match is None:
            return HTTPStatus.NOT_FOUND, {"error": f"no such path {wire.shown(path)}"}
        round_id, what = int(match[1]), match[2]
        view = divergence_view if what == "divergence" else class_accuracy_view
        body = view(snapshot, round_id)
        if body is None:
            return HTTPStatus.NOT_FOUND, {"error": f"round {round_id} is not committed"}
        return HTTPStatus.OK, body

    def metrics(self) -> str:
        """The Prometheus body from the live state (all zero when the server runs without one) and the store's
        serving version."""
        live = self.server.live or LiveState(total_rounds=0)
        serving = serving_stack(self.server.snapshots.get().serving)[-1]
        return render_metrics(
            live.counters(),
            live.online_count(),
            live.progress()["round"],
            serving_version=serving,
            predictions=live.predictions(),
            labelling=self.queue_status(),
            labelling_refused=None if self.server.labelling is None else dict(self.server.labelling.refusals),
            health=self.server.parts_health,
            device_health=live.device_health(),
            pages={self.server.name: self.server.health()},
        )

    def queue_status(self) -> QueueStatus | None:
        """The labelling queue's depth, ages and people now (None without a queue)."""
        desk = self.server.labelling
        return None if desk is None else desk.queue.status(time.time())

    def send_json(self, status: HTTPStatus, body: dict, headers: dict[str, str] | None = None) -> None:
        """Sends body as strict JSON (non-finite numbers become null)."""
        data = json.dumps(json_safe(body), allow_nan=False).encode()
        self.send_body(status, data, "application/json", headers)


class Dashboard:
    """The dashboard server running on a background thread for the duration of a with-block."""

    def __init__(
        self,
        address: ListenAddress,
        run_dir: Path,
        live: LiveState | None,
        token: str | None,
        labelling: LabellingDesk | None = None,
        hosts: tuple[str, ...] = (),
        limits: EdgeLimits = DEFAULT_LIMITS,
        health: Health | None = None,
    ) -> None:
        self.server = DashboardHTTPServer(address, run_dir, live, token, labelling, hosts, limits, health)
        self.thread = SupervisedThread("dashboard", lambda stop: self.server.serve_forever(), self.server.parts_health)

    @property
    def url(self) -> str:
        """The page's address, with the port actually bound (port 0 picks a free one)."""
        host, port = self.server.server_address[:2]
        host = host.decode() if isinstance(host, bytes) else str(host)
        return f"http://[{host}]:{port}/" if ":" in host else f"http://{host}:{port}/"

    def __enter__(self) -> Dashboard:
        """Starts serving."""
        self.thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        """Stops serving and closes the socket."""
        self.thread.stop(timeout=5, wake=self.server.shutdown)
        self.server.server_close()
