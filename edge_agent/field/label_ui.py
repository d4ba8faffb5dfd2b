# The on-device labelling page: pending queries with one button per class, a click stores the answer at once; the
# latest answered ones below it, where a click corrects the label.
from __future__ import annotations

import html
import logging
import re
import urllib.parse
from http import HTTPStatus
from typing import ClassVar

from edge_agent.data.query_records import DECLINED, LabelKind, Query, Road
from edge_agent.field.folder_oracle import QueryBook
from protocol.errors import UsageError
from protocol.http_edge import DEFAULT_LIMITS, EdgeHandler, EdgeLimits, EdgeServer, HostRule, same_origin
from protocol.http_requests import HttpRefusal, ascii_int, form_body
from protocol.supervision import Health, SupervisedThread
from protocol.wire import shown

log = logging.getLogger(__name__)

DEFAULT_HOST = "127.0.0.1"
MAX_FORM_BYTES = 4096
PORT = re.compile(r"[0-9]{1,5}")
IMAGE_TYPES = {".png": "image/png", ".jpg": "image/jpeg", ".jpeg": "image/jpeg"}
PAGE_STYLE = (
    "body{font-family:sans-serif;margin:1em}.query{display:inline-block;border:1px solid #ccc;"
    "margin:.5em;padding:.5em;width:15em;vertical-align:top}.query img{width:112px;height:112px;"
    "image-rendering:pixelated;display:block;margin-bottom:.5em}button{margin:.1em}.answered{background:#f4f6f8}"
    "button[aria-pressed=true]{font-weight:bold;border:2px solid #1d2330}"
)
ANSWERED_SHOWN = 12  # the latest answered queries the page offers to correct


def parse_listen_address(value: str) -> tuple[str, int]:
    """`[HOST:]PORT` -> (host, port); loopback when no host is given; UsageError for anything else."""
    host, _, port = value.rpartition(":")
    if not PORT.fullmatch(port) or int(port) > 65535:
        raise UsageError(f"--label-ui expects [HOST:]PORT, got {shown(value)}")
    return host.removeprefix("[").removesuffix("]") or DEFAULT_HOST, int(port)


def query_card(query: Query, class_names: tuple[str, ...], held: int | None) -> str:
    """One query's card: its image and one form button per class; an answered one (`held`: the label it carries)
    posts a correction and marks the label held."""
    name = html.escape(query.name, quote=True)
    mark = "data-query" if held is None else "data-answered"
    buttons = "".join(
        f'<button type="submit" name="label" value="{number}" {mark}="{name}"'
        f"{' aria-pressed=true' if number == held else ''}>{html.escape(label)}</button>"
        for number, label in enumerate(class_names)
    )
    change = "" if held is None else '<input type="hidden" name="change" value="1">'
    now = (
        ""
        if held is None
        else f" &middot; now {'none of these' if held == DECLINED else html.escape(class_names[held])}"
    )
    return (
        f'<div class="{"query" if held is None else "answered"}" id="q-{name}"><img src="/image/'
        f'{urllib.parse.quote(query.name)}" alt="{name}"><form method="post" action="/label"><input type="hidden" '
        f'name="query" value="{name}">{change}{buttons}</form><small>round {query.round_id} &middot; {name}{now}'
        "</small></div>"
    )


def render_page(book: QueryBook) -> str:
    """The HTML of the page: every pending query's card, then the latest answered ones' to correct (no scripts, no
    CDN)."""
    stored = book.stored_answers()
    queries = book.queries()
    cards = [query_card(query, book.class_names, None) for query in queries if query.name not in stored]
    answered = [query for query in queries if query.name in stored][-ANSWERED_SHOWN:]
    corrections = "".join(query_card(query, book.class_names, stored[query.name]) for query in reversed(answered))
    body = "".join(cards) or '<p id="empty">Nothing to label.</p>'
    below = f"<h2>Answered: click another class to correct it</h2>{corrections}" if corrections else ""
    return (
        f'<!doctype html><html><head><meta charset="utf-8"><title>Label queries</title>'
        f"<style>{PAGE_STYLE}</style></head><body><h1>Pending queries: {len(cards)}</h1>{body}{below}</body></html>"
    )


class LabelHandler(EdgeHandler):
    """GET / (the page), GET /image/<name> (a query's copy), POST /label (query, label, and change=1 for a
    correction) -> 303 back to /."""

    book: ClassVar[QueryBook]

    def do_GET(self) -> None:
        """Serves the page or one query image; nothing else on the device is reachable."""
        path = urllib.parse.urlsplit(self.path).path
        if path == "/":
            self.send_body(HTTPStatus.OK, render_page(self.book).encode(), "text/html; charset=utf-8")
            return
        if path.startswith("/image/"):
            name = urllib.parse.unquote(path[len("/image/") :])
            query = self.book.store.query(name)
            kind = IMAGE_TYPES.get(self.book.image_path(query).suffix.lower()) if query else None
            if query is not None and kind is not None and self.book.image_path(query).is_file():
                self.send_body(HTTPStatus.OK, self.book.image_path(query).read_bytes(), kind)
                return
        self.send_body(HTTPStatus.NOT_FOUND, b"not found\n", "text/plain")

    def do_POST(self) -> None:
        """Stores one answer or correction in the query store (durable before the redirect), then sends the browser
        back; a post from another site's page (its Origin) is refused."""
        if urllib.parse.urlsplit(self.path).path != "/label":
            raise HttpRefusal(HTTPStatus.NOT_FOUND, "answers are posted to /label")
        if not same_origin(self.headers):
            raise HttpRefusal(HTTPStatus.FORBIDDEN, "answers come from this page only")
        form = form_body(self.read_body(MAX_FORM_BYTES))
        if "query" not in form or "label" not in form:
            raise HttpRefusal(HTTPStatus.BAD_REQUEST, "label not saved: the form needs query and label")
        name, label = form["query"], ascii_int(form["label"], "label")
        kind = LabelKind.CORRECTION if form.get("change") == "1" else LabelKind.ANSWER
        try:
            self.book.record_answer(name, label, Road.PAGE, kind=kind)
        # record_answer's refusals (no such query, a label out of range): the person's input
        except (KeyError, ValueError) as error:
            raise HttpRefusal(HTTPStatus.BAD_REQUEST, f"label not saved: {str(error)[:200]}") from None
        log.info("label saved query=%s label=%d kind=%s", shown(name, 200), label, kind)
        self.send_response(HTTPStatus.SEE_OTHER)
        self.send_header("Location", "/")
        self.send_header("Content-Length", "0")
        self.end_headers()


def make_handler(book: QueryBook) -> type[LabelHandler]:
    """The request handler class bound to one QueryBook."""
    return type("BoundLabelHandler", (LabelHandler,), {"book": book})


class LabelServer:
    """The labelling page on an edge server on a background thread (loopback unless a host is given; it answers to
    the names of HostRule.serving, and its connections and requests are bounded by `limits`)."""

    def __init__(
        self,
        book: QueryBook,
        host: str = DEFAULT_HOST,
        port: int = 0,
        limits: EdgeLimits = DEFAULT_LIMITS,
        health: Health | None = None,
    ) -> None:
        self._server = EdgeServer((host, port), make_handler(book), "label-ui", HostRule.serving(host), limits)
        self._thread = SupervisedThread("label-ui", lambda stop: self._server.serve_forever(), health or Health())

    @property
    def server(self) -> EdgeServer:
        """The edge server (its `serving` flag and health)."""
        return self._server

    @property
    def url(self) -> str:
        """Where the page is served."""
        host, port = self._server.server_address[:2]
        return f"http://{host!s}:{port}/" if isinstance(host, str) else f"http://{host.decode()}:{port}/"

    def start(self) -> LabelServer:
        """Starts serving on the background thread."""
        self._thread.start()
        log.info("label page serving url=%s", self.url)
        return self

    def stop(self) -> None:
        """Stops serving and closes the socket."""
        self._thread.stop(timeout=5, wake=self._server.shutdown)
        self._server.server_close()
