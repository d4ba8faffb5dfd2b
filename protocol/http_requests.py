# What a request's parts may hold: one parser of lengths, bodies, forms, JSON and integers for every page, each
# malformed part an HttpRefusal (a bounded 4xx, never a traceback).
from __future__ import annotations

import io
import json
import re
import urllib.parse
from email.message import Message
from http import HTTPStatus
from typing import Any

from protocol.errors import FalError
from protocol.wire import shown

MAX_JSON_DEPTH = 32
MAX_FORM_FIELDS = 16
MAX_LENGTH_DIGITS = 12
REASON_CHARS = 200
ASCII_INT = re.compile(r"-?[0-9]{1,9}")
JSON_STRING = re.compile(r'"(?:[^"\\]|\\.)*"', re.DOTALL)


class HttpRefusal(FalError):
    """A request refused with its status and a bounded reason: a 4xx for the sender's mistake (never a traceback),
    a 500 only for the server's own bug (logged with its traceback before)."""

    def __init__(self, status: HTTPStatus, reason: str) -> None:
        super().__init__(reason[:REASON_CHARS])
        self.status = status
        self.reason = reason[:REASON_CHARS]


def content_length(headers: Message, limit: int) -> int:
    """The request's Content-Length: ASCII digits only, one value, at most `limit`; HttpRefusal otherwise."""
    if headers.get("Transfer-Encoding") is not None:
        raise HttpRefusal(HTTPStatus.LENGTH_REQUIRED, "send the body with a Content-Length, not a Transfer-Encoding")
    values = {value.strip() for value in headers.get_all("Content-Length") or []}
    if not values:
        raise HttpRefusal(HTTPStatus.LENGTH_REQUIRED, "a Content-Length is required")
    if len(values) > 1:
        raise HttpRefusal(HTTPStatus.BAD_REQUEST, "conflicting Content-Length headers")
    value = values.pop()
    if not value.isascii() or not value.isdigit():
        raise HttpRefusal(HTTPStatus.BAD_REQUEST, f"Content-Length must be ASCII digits, got {shown(value, 40)}")
    if len(value) > MAX_LENGTH_DIGITS or int(value) > limit:
        raise HttpRefusal(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, f"a body of at most {limit} bytes")
    return int(value)


def read_body(headers: Message, rfile: io.BufferedIOBase, limit: int) -> bytes:
    """The request's whole body (its Content-Length checked first); HttpRefusal for a short or late one."""
    length = content_length(headers, limit)
    try:
        data = rfile.read(length)
    # the deadline reader's timeout: the client stopped sending within its request's deadline
    except TimeoutError:
        raise HttpRefusal(HTTPStatus.REQUEST_TIMEOUT, "the body did not arrive in time") from None
    if len(data) < length:
        raise HttpRefusal(HTTPStatus.BAD_REQUEST, f"the body ended after {len(data)} of {length} bytes")
    return data


def json_depth(text: str) -> int:
    """How deep a JSON text's arrays and objects nest (brackets inside strings not counted)."""
    depth = deepest = 0
    for char in JSON_STRING.sub("", text):
        if char in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif char in "]}":
            depth -= 1
    return deepest


def _refuse_constant(name: str) -> Any:
    raise HttpRefusal(HTTPStatus.BAD_REQUEST, f"the body holds a non-finite number ({shown(name, 20)})")


def _finite_float(text: str) -> float:
    value = float(text)
    if value - value != 0:
        _refuse_constant(text)
    return value


def json_body(data: bytes, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """A body as strict JSON: UTF-8, nested at most `max_depth` deep (checked before parsing, so no RecursionError),
    finite numbers only; HttpRefusal(400) otherwise."""
    try:
        text = data.decode("utf-8")
    # a body that is not UTF-8: the sender's mistake
    except UnicodeDecodeError:
        raise HttpRefusal(HTTPStatus.BAD_REQUEST, "the body is not UTF-8") from None
    if json_depth(text) > max_depth:
        raise HttpRefusal(HTTPStatus.BAD_REQUEST, f"the body nests deeper than {max_depth} levels")
    try:
        return json.loads(text, parse_constant=_refuse_constant, parse_float=_finite_float)
    # json.loads raises ValueError (JSONDecodeError, or an integer past Python's digit limit) for a body that is no JSON
    except ValueError as error:
        raise HttpRefusal(HTTPStatus.BAD_REQUEST, f"the body is not JSON ({shown(str(error), 80)})") from None


def form_body(data: bytes) -> dict[str, str]:
    """A urlencoded form's fields (the first value of each): UTF-8, at most 16 fields; HttpRefusal(400) otherwise."""
    try:
        fields = urllib.parse.parse_qs(data.decode("utf-8"), errors="strict", max_num_fields=MAX_FORM_FIELDS)
    # not UTF-8 (in the body or %-escaped) or too many fields: the sender's mistake
    except ValueError:
        raise HttpRefusal(HTTPStatus.BAD_REQUEST, "expected a UTF-8 form of a few fields") from None
    return {name: values[0] for name, values in fields.items()}


def ascii_int(text: str, what: str) -> int:
    """An integer written in ASCII digits (int() also takes other scripts' digits and spaces); HttpRefusal(400)."""
    if not ASCII_INT.fullmatch(text):
        raise HttpRefusal(HTTPStatus.BAD_REQUEST, f"{what} must be an integer, got {shown(text, 40)}")
    return int(text)
