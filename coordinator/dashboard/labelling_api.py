# The labelling page's JSON API: the next query for a person, its image, an answer or a skip (stored before the
# device is told); every refusal a bounded JSON error with its own status.
from __future__ import annotations

import re
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

from coordinator.labelling.desk import LabellingDesk
from coordinator.labelling.queue import AnswerError, QueuedQuery
from protocol import wire
from protocol.http_requests import HttpRefusal, json_body

MAX_BODY_BYTES = 4096
PERSON = re.compile(r"^[A-Za-z0-9_.@-]{1,64}$")
ANSWER_PATH = "/api/label/answer"
SKIP_PATH = "/api/label/skip"
POST_PATHS = (ANSWER_PATH, SKIP_PATH)
IMAGE_PATH = re.compile(r"/api/label/image/([A-Za-z0-9_.-]{1,64})/([A-Za-z0-9_.-]{1,64})")


@dataclass(frozen=True)
class Reply:
    """An API reply: its status, and a JSON body or raw bytes with their content type."""

    status: HTTPStatus
    body: dict[str, Any] | None = None
    data: bytes = b""
    content_type: str = "application/json"


def error(status: HTTPStatus, reason: str) -> Reply:
    """A JSON error reply (the reason cut short)."""
    return Reply(status, {"error": reason[:300]})


def query_view(desk: LabellingDesk, query: QueuedQuery | None) -> dict[str, Any] | None:
    """A query as the page shows it: its device, id, image address, the model's guess and uncertainty."""
    if query is None:
        return None
    names = desk.queue.class_names
    return {
        "device": query.device,
        "query_id": query.query_id,
        "image": f"/api/label/image/{query.device}/{query.query_id}",
        "image_bytes": query.image_bytes,
        "guess": query.guess,
        "guess_name": names[query.guess] if 0 <= query.guess < len(names) else None,
        "probability": query.probability,
        "uncertainty": query.uncertainty,
        "score": query.score,
        "asked_at": query.asked_at,
    }


def next_reply(desk: LabellingDesk, person: str) -> Reply:
    """The next query for a person, the class names and the queue's depth."""
    depth = desk.queue.depth()
    body = {
        "query": query_view(desk, desk.queue.next_for(person)),
        "classes": list(desk.queue.class_names),
        "open": sum(depth.values()),
        "devices": len(depth),
    }
    return Reply(HTTPStatus.OK, body)


def get(desk: LabellingDesk, path: str, parameters: dict[str, list[str]]) -> Reply:
    """GET /api/label/next?person=P, GET /api/label/image/DEVICE/QUERY."""
    if path == "/api/label/next":
        person = (parameters.get("person") or [""])[0]
        if not PERSON.fullmatch(person):
            return error(HTTPStatus.BAD_REQUEST, "person must be 1-64 letters, digits or _.@-")
        return next_reply(desk, person)
    match = IMAGE_PATH.fullmatch(path)
    query = desk.queue.get(match[1], match[2]) if match else None
    if query is None:
        return error(HTTPStatus.NOT_FOUND, f"no such query image {wire.shown(path)}")
    try:
        image = desk.queue.image_path(query.device, query.query_id, query.media_type).read_bytes()
    # the file removed or unreadable under the queue (a person cleaning RUN_DIR/labelling): gone, not a crash
    except OSError:
        return error(HTTPStatus.GONE, f"the image of query {wire.shown(query.query_id)} is no longer on disk")
    return Reply(HTTPStatus.OK, data=image, content_type=query.media_type)


def post(desk: LabellingDesk, path: str, body: bytes) -> Reply:
    """POST /api/label/answer {device, query_id, label, person} or /api/label/skip {device, query_id, person}:
    the answer stored (and sent to its device when it decides the query), then the person's next query."""
    if path not in POST_PATHS:
        return error(HTTPStatus.NOT_FOUND, f"no such path {wire.shown(path)}")
    try:
        form = json_body(body)
    except HttpRefusal as refused:
        return error(refused.status, refused.reason)
    fields = {"device", "query_id", "person"} | ({"label"} if path == ANSWER_PATH else set())
    if not isinstance(form, dict) or set(form) != fields:
        return error(HTTPStatus.BAD_REQUEST, f"the body must hold exactly {', '.join(sorted(fields))}")
    device, query_id, person = form["device"], form["query_id"], form["person"]
    if not all(isinstance(value, str) and wire.IDENTIFIER.fullmatch(value) for value in (device, query_id)):
        return error(HTTPStatus.BAD_REQUEST, "device and query_id must be 1-64 letters, digits or _.-")
    if not isinstance(person, str) or not PERSON.fullmatch(person):
        return error(HTTPStatus.BAD_REQUEST, "person must be 1-64 letters, digits or _.@-")
    try:
        if path == SKIP_PATH:
            desk.queue.skip(device, query_id, person)
            decided = None
        else:
            label = form["label"]
            if not isinstance(label, int) or isinstance(label, bool):
                return error(HTTPStatus.BAD_REQUEST, "label must be an integer class number (-1: none of these)")
            decided = desk.queue.answer(device, query_id, label, person)
    except AnswerError as refused:
        return error(HTTPStatus(refused.status), refused.reason)
    if decided is not None:
        desk.send(decided)
    reply = next_reply(desk, person)
    return Reply(HTTPStatus.OK, {**(reply.body or {}), "stored": True, "decided": decided is not None})
