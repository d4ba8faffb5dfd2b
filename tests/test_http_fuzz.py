# Fuzzing every HTTP endpoint of the dashboard (with its labelling desk) and the device's label page with raw
# requests: malformed methods, paths, headers, Content-Lengths and bodies (non-finite numbers, out-of-range labels,
# wrong types). Every request gets a well-formed answer below 500, no traceback is logged, and the page stays up.
from __future__ import annotations

import json
import urllib.parse
from collections.abc import Iterator
from pathlib import Path

import pytest
from http_pages import Page, exchange, request, served_page, tracebacks
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from protocol.http_edge import EdgeLimits

ENDPOINTS = {
    "dashboard": [
        "/",
        "/dashboard.js",
        "/dashboard.css",
        "/label",
        "/label.js",
        "/metrics",
        "/api/run",
        "/api/devices",
        "/api/rounds",
        "/api/rounds/1/divergence",
        "/api/rounds/2/class-accuracy",
        "/api/label/next?person=ana",
        "/api/label/image/cam-1/q1",
        "/api/label/answer",
        "/api/label/skip",
    ],
    "device page": ["/", "/label", "/image/"],
}
METHODS = st.sampled_from(["GET", "POST", "POST", "PUT", "DELETE", "HEAD", "OPTIONS", "get", "BREW"]) | st.text(
    "ABCDEFGHIJKLMNOPQRSTUVWXYZ_-", min_size=1, max_size=12
)
PRINTABLE = st.characters(min_codepoint=0x21, max_codepoint=0x2FF, exclude_characters="\x7f")
HEADER_VALUE = st.text(st.characters(min_codepoint=0x20, max_codepoint=0x2FF, exclude_characters="\x7f"), max_size=60)
LENGTHS = (
    st.none() | st.sampled_from(["²", "-1", "1e3", "0x10", " 12", "9" * 40, "", "٣"]) | st.integers(0, 6000).map(str)
)
NUMBERS = (
    st.integers(-(10**30), 10**30)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.sampled_from([-1, 0, 1, 2, 3, 10**6, True, None])
)
JSON_VALUES = st.recursive(
    NUMBERS | st.text(max_size=80) | st.booleans(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=12,
)


def answers(queries: tuple[str, ...]) -> st.SearchStrategy[bytes]:
    """The dashboard's answer bodies, of its queries or not, with labels in and out of range and of any type."""
    return st.fixed_dictionaries(
        {
            "device": st.sampled_from(["cam-1", "cam-2", "", "a" * 100]) | JSON_VALUES,
            "query_id": st.sampled_from([*queries, "nope", "../../etc"]) | JSON_VALUES,
            "person": st.sampled_from(["ana", "bo", "a b", "", "x" * 100]) | JSON_VALUES,
        },
        optional={"label": NUMBERS | JSON_VALUES, "extra": JSON_VALUES},
    ).map(lambda value: json.dumps(value, allow_nan=True).encode())


def forms(queries: tuple[str, ...]) -> st.SearchStrategy[bytes]:
    """The device page's forms, of its queries or not, with labels in and out of range and of any text."""
    return st.fixed_dictionaries(
        {},
        optional={
            "query": st.sampled_from([*queries, "nope.png", ""]) | st.text(max_size=40),
            "label": NUMBERS.map(str) | st.text(max_size=20),
        },
    ).map(lambda form: urllib.parse.urlencode(form).encode())


OTHER_BODIES = (
    JSON_VALUES.map(lambda value: json.dumps(value, allow_nan=True).encode())
    | st.binary(max_size=5000)
    | st.integers(1, 3000).map(lambda depth: b"[" * depth + b"]" * depth)
)


def mostly(usual: list, rare: st.SearchStrategy) -> st.SearchStrategy:
    """One of the usual values seven times in eight, else a rare (malformed) one, so most requests get past the
    early checks and reach the parsers behind them."""
    return st.integers(0, 7).flatmap(lambda roll: rare if roll == 0 else st.sampled_from(usual))


@st.composite
def raw_requests(draw: st.DrawFn, page: Page) -> bytes:
    """One request as an attacker might send it: any method, an endpoint (perhaps mangled), some headers, a body."""
    method = draw(mostly(["GET", "POST", "POST"], METHODS))
    path = draw(st.sampled_from([*ENDPOINTS[page.name], *(f"/image/{name}" for name in page.queries)]))
    path += draw(
        mostly(
            [""], st.sampled_from(["x", "/..%2f..", "?person=%ff", "/" + "9" * 50]) | st.text(PRINTABLE, max_size=20)
        )
    )
    host = draw(mostly([page.host, f"localhost:{page.port}"], st.sampled_from(["evil.example", None]) | HEADER_VALUE))
    headers = {
        "Content-Type": draw(
            mostly([page.post_headers["Content-Type"]], st.sampled_from(["text/plain"]) | HEADER_VALUE)
        ),
        "X-Requested-With": draw(mostly(["edge-fal"], HEADER_VALUE)),
    }
    origin = draw(
        mostly([None, f"http://{page.host}"], st.sampled_from(["http://evil.example", "null"]) | HEADER_VALUE)
    )
    body = draw(answers(page.queries) | forms(page.queries) | OTHER_BODIES)
    length = draw(mostly([str(len(body))], LENGTHS))
    if origin is not None:
        headers["Origin"] = origin
    if length is not None:
        headers["Content-Length"] = length
    if draw(st.integers(0, 7)) == 0:
        headers[draw(st.text("abcdefghijklmnopqrstuvwxyz-", min_size=1, max_size=20))] = draw(HEADER_VALUE)
    return request(method, path, host, headers, body)


@pytest.fixture(params=["dashboard", "device page"])
def page(request, tmp_path: Path) -> Iterator[Page]:
    """Each page with its default bounds and a read timeout short enough for a body shorter than its length."""
    with served_page(request.param, request, tmp_path, EdgeLimits(read_seconds=0.3, request_seconds=2.0)) as served:
        yield served


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_every_endpoint_answers_malformed_requests_below_500_without_a_traceback(page: Page, data: st.DataObject):
    raw = data.draw(raw_requests(page))
    with tracebacks() as logged:
        status, response = exchange(page.port, raw)
    event(f"status {status}")  # --hypothesis-show-statistics: which answers the fuzz reached
    assert 100 <= status < 500, (raw[:300], response[:300])
    assert not logged, [record.getMessage() for record in logged]
    assert page.server.serving
    assert exchange(page.port, request("GET", "/", page.host))[0] == 200
