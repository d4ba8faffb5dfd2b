# The labelling page's JSON API: the next query for a person (or a grid of one guessed class), its image, an answer, a
# grid's answers, a correction, an undo or a skip (stored before the device is told); every refusal a bounded JSON
# error with its own status.
from __future__ import annotations

import base64
import re
import time
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

from coordinator.labelling.desk import LabellingDesk
from coordinator.labelling.queue_records import AnswerError, Given, QueuedQuery, Recording
from protocol import wire
from protocol.http_requests import HttpRefusal, ascii_int, json_body

MAX_BODY_BYTES = 4096
GRID_BODY_BYTES = 16384  # a grid's post names up to GRID_MAX queries
PERSON = re.compile(r"^[A-Za-z0-9_.@-]{1,64}$")
ANSWER_PATH = "/api/label/answer"
CORRECT_PATH = "/api/label/correct"
GRID_PATH = "/api/label/grid"
SKIP_PATH = "/api/label/skip"
UNDO_PATH = "/api/label/undo"
POST_PATHS = (ANSWER_PATH, CORRECT_PATH, GRID_PATH, SKIP_PATH, UNDO_PATH)
IMAGE_PATH = re.compile(r"/api/label/image/([A-Za-z0-9_.-]{1,64})/([A-Za-z0-9_.-]{1,64})")
HISTORY = 64  # a person's latest answers the page lists (to correct one, or see where it stands)
GRID_SIZE = 32  # a page of thumbnails every one of which a key can mark (8 x 4)
GRID_MAX = 48
INLINE_IMAGE_BYTES = 32 * 1024  # a grid's images up to this size come inside its reply (one request, not 48)
PERSON_RULE = "person must be 1-64 letters, digits or _.@-"
IDS_RULE = "device and query_id must be 1-64 letters, digits or _.-"
LABEL_RULE = "label must be an integer class number (-1: none of these)"


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


def body_limit(path: str) -> int:
    """The largest body a POST to `path` may carry."""
    return GRID_BODY_BYTES if path == GRID_PATH else MAX_BODY_BYTES


def image_of(device: str, query_id: str) -> str:
    """The address of a query's image."""
    return f"/api/label/image/{device}/{query_id}"


def class_name(desk: LabellingDesk, label: int | None) -> str | None:
    """A class's name, or None for no guess, no answer or none of these."""
    names = desk.queue.class_names
    return names[label] if label is not None and 0 <= label < len(names) else None


def query_view(desk: LabellingDesk, query: QueuedQuery | None) -> dict[str, Any] | None:
    """A query as the page shows it: its device, id, image address, the model's guess and uncertainty, and the label
    it holds (None while open)."""
    if query is None:
        return None
    return {
        "device": query.device,
        "query_id": query.query_id,
        "image": image_of(query.device, query.query_id),
        "image_bytes": query.image_bytes,
        "guess": query.guess,
        "guess_name": class_name(desk, query.guess),
        "probability": query.probability,
        "uncertainty": query.uncertainty,
        "score": query.score,
        "asked_at": query.asked_at,
        "label": query.label,
    }


def given_view(desk: LabellingDesk, given: Given) -> dict[str, Any]:
    """One of a person's answers as their history shows it."""
    return {
        "device": given.device,
        "query_id": given.query_id,
        "image": image_of(given.device, given.query_id),
        "given": given.given,
        "label": given.label,
        "label_name": class_name(desk, given.label),
        "state": given.state,
    }


def next_reply(desk: LabellingDesk, person: str) -> Reply:
    """The next query for a person, the class names, the queue's depth, the person's latest answers and their count
    today, and the fleet's corrections."""
    return Reply(HTTPStatus.OK, {"query": query_view(desk, desk.queue.next_for(person)), **page_state(desk, person)})


def page_state(desk: LabellingDesk, person: str) -> dict[str, Any]:
    """What every reply to the page carries beside its query or grid."""
    depth = desk.queue.depth()
    tally = desk.queue.tally(person, time.time())
    return {
        "classes": list(desk.queue.class_names),
        "open": sum(depth.values()),
        "devices": len(depth),
        "history": [given_view(desk, given) for given in desk.queue.history(person, HISTORY)],
        "today": tally.today,
        "corrections": tally.corrections,
        "undo_answers": desk.queue.undo_window.answers,
        "undo_seconds": desk.queue.undo_window.seconds,
    }


def grid_reply(desk: LabellingDesk, person: str, parameters: dict[str, list[str]]) -> Reply:
    """A page of open queries of one guessed class (`class`, or the class with the most), at most `size`."""
    try:
        size = ascii_int((parameters.get("size") or [str(GRID_SIZE)])[0], "size")
        chosen = parameters.get("class")
        guess = None if not chosen else ascii_int(chosen[0], "class")
    except HttpRefusal as refused:
        return error(refused.status, refused.reason)
    if not 1 <= size <= GRID_MAX or (guess is not None and not 0 <= guess < len(desk.queue.class_names)):
        return error(HTTPStatus.BAD_REQUEST, f"size must be 1..{GRID_MAX} and class a class number of the spec")
    queries = desk.queue.grid_for(person, size, guess)
    label = queries[0].guess if queries else guess
    views = [{**(query_view(desk, query) or {}), "data": inline_image(desk, query)} for query in queries]
    body = {"class": label, "class_name": class_name(desk, label), "queries": views}
    return Reply(HTTPStatus.OK, {**body, **page_state(desk, person)})


def inline_image(desk: LabellingDesk, query: QueuedQuery) -> str | None:
    """A small query image as a data: URL (None for a large one, or one gone from disk: the page fetches those)."""
    if query.image_bytes > INLINE_IMAGE_BYTES:
        return None
    try:
        image = desk.queue.image_path(query.device, query.query_id, query.media_type).read_bytes()
    # the file removed or unreadable under the queue: the page's own fetch of it says so (410)
    except OSError:
        return None
    return f"data:{query.media_type};base64,{base64.b64encode(image[:INLINE_IMAGE_BYTES]).decode()}"


def get(desk: LabellingDesk, path: str, parameters: dict[str, list[str]]) -> Reply:
    """GET /api/label/next?person=P, /api/label/grid?person=P[&class=K][&size=N], /api/label/image/DEVICE/QUERY."""
    if path in ("/api/label/next", GRID_PATH):
        person = (parameters.get("person") or [""])[0]
        if not PERSON.fullmatch(person):
            return error(HTTPStatus.BAD_REQUEST, PERSON_RULE)
        return next_reply(desk, person) if path == "/api/label/next" else grid_reply(desk, person, parameters)
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


def fields_of(path: str) -> tuple[set[str], set[str]]:
    """(required, optional) fields of a POST body to `path`."""
    if path == UNDO_PATH:
        return {"person"}, set()
    if path == GRID_PATH:
        return {"person", "label", "queries"}, {"hold"}
    if path == SKIP_PATH:
        return {"device", "query_id", "person"}, set()
    return {"device", "query_id", "person", "label"}, ({"hold"} if path == ANSWER_PATH else set())


def checked_form(path: str, body: bytes) -> dict[str, Any]:
    """A POST body parsed and checked field by field; HttpRefusal (400) naming the first bad field."""
    form = json_body(body)
    required, optional = fields_of(path)
    if not isinstance(form, dict) or not required <= set(form) <= required | optional:
        names = ", ".join(sorted(required)) + (f" (and optionally {', '.join(sorted(optional))})" if optional else "")
        raise HttpRefusal(HTTPStatus.BAD_REQUEST, f"the body must hold exactly {names}")
    if not isinstance(form["person"], str) or not PERSON.fullmatch(form["person"]):
        raise HttpRefusal(HTTPStatus.BAD_REQUEST, PERSON_RULE)
    pairs = [[form["device"], form["query_id"]]] if "device" in form else form.get("queries", [])
    if not isinstance(pairs, list) or (path == GRID_PATH and not 1 <= len(pairs) <= GRID_MAX):
        raise HttpRefusal(HTTPStatus.BAD_REQUEST, f"queries must be a list of 1..{GRID_MAX} [device, query_id] pairs")
    form["keys"] = [checked_ids(pair) for pair in pairs]  # checked (device, query id) pairs
    if "label" in form and (not isinstance(form["label"], int) or isinstance(form["label"], bool)):
        raise HttpRefusal(HTTPStatus.BAD_REQUEST, LABEL_RULE)
    if not isinstance(form.get("hold", False), bool):
        raise HttpRefusal(HTTPStatus.BAD_REQUEST, "hold must be true or false")
    return form


def checked_ids(pair: Any) -> tuple[str, str]:
    """A (device, query id) pair from a body; HttpRefusal (400) unless both are identifiers."""
    if not isinstance(pair, list) or len(pair) != 2:
        raise HttpRefusal(HTTPStatus.BAD_REQUEST, IDS_RULE)
    if not all(isinstance(value, str) and wire.IDENTIFIER.fullmatch(value) for value in pair):
        raise HttpRefusal(HTTPStatus.BAD_REQUEST, IDS_RULE)
    return pair[0], pair[1]


def post(desk: LabellingDesk, path: str, body: bytes) -> Reply:
    """POST /api/label/answer {device, query_id, label, person[, hold]}: an answer to an open query (with `hold`, as
    the page sends, it waits for an undo before it goes to its device); /api/label/correct {device, query_id, label,
    person}: a new label for an answered query (a correction once it was sent); /api/label/grid {person, label,
    queries: [[device, query_id], ...][, hold]}: one label for a grid's queries, all or none; /api/label/skip
    {device, query_id, person}; /api/label/undo {person}: the person's latest answer taken back while it is not sent
    (its query comes back as `query`), else returned to be corrected. Then the person's next query."""
    if path not in POST_PATHS:
        return error(HTTPStatus.NOT_FOUND, f"no such path {wire.shown(path)}")
    try:
        form = checked_form(path, body)
    except HttpRefusal as refused:
        return error(refused.status, refused.reason)
    person, keys = form["person"], form["keys"]
    try:
        if path == UNDO_PATH:
            return undo_reply(desk, person)
        if path == SKIP_PATH:
            device, query_id = keys[0]
            desk.queue.skip(device, query_id, person)
            recording = Recording([], [])
        else:
            change, hold = path == CORRECT_PATH, bool(form.get("hold", False))
            recording = desk.queue.record_all(keys, form["label"], person, change, hold)
    except AnswerError as refused:
        return error(HTTPStatus(refused.status), refused.reason)
    send(desk, recording)
    reply = next_reply(desk, person)
    outcomes = [item.outcome.value for item in recording.recorded]
    decided = any(item.decided is not None for item in recording.recorded)
    return Reply(HTTPStatus.OK, {**(reply.body or {}), "stored": True, "decided": decided, "outcomes": outcomes})


def send(desk: LabellingDesk, recording: Recording) -> None:
    """Sends what the person's word made: corrections at once, decisions once their hold is over (at once when they
    were not held), and the held answers it pushed out of their undo window."""
    for item in recording.recorded:
        if item.correction is not None:
            desk.send_correction(item.correction)
        if item.decided is not None and not item.held:
            desk.send(item.decided)
    for decided in recording.released:
        desk.send(decided)


def undo_reply(desk: LabellingDesk, person: str) -> Reply:
    """The undo's reply: the query taken back (now open: answer it again) or sent already (correct it), or 404."""
    undone = desk.queue.undo(person)
    if undone is None:
        return error(HTTPStatus.NOT_FOUND, f"{wire.shown(person)} has no answer left to undo")
    query, state = undone
    return Reply(HTTPStatus.OK, {"query": query_view(desk, query), "undone": state.value, **page_state(desk, person)})
