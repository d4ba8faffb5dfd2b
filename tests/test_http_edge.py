# The HTTP edge under attack (issue 43): raw sockets against the real dashboard (with a real desk and mosquitto) and
# the device's label page: idle and slow connections, malformed requests, a rebinding Host, a handler's bug, and a
# real `fl-coordinator labelling serve` kept within its file descriptors by a flood of idle connections.
from __future__ import annotations

import email.parser
import json
import os
import resource
import select
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from http import HTTPStatus
from pathlib import Path

import pytest
from http_pages import (
    FLEET,
    Page,
    body_of,
    connect,
    exchange,
    request,
    served_page,
    tracebacks,
)
from test_labelling_api import png

from coordinator.dashboard.server import Dashboard, ListenAddress, served_names
from coordinator.fleet.broker import free_loopback_port
from protocol import topics, wire
from protocol.errors import UsageError
from protocol.http_edge import DEFAULT_LIMITS, EdgeHandler, EdgeLimits, EdgeServer, HostRule
from protocol.http_requests import MAX_JSON_DEPTH, HttpRefusal, ascii_int, content_length, form_body, json_body
from protocol.label_messages import LabelQuery, QueryReceipt

SMALL = EdgeLimits(read_seconds=1.0, request_seconds=2.0, write_seconds=5.0, connections=8, per_client=4)


@pytest.fixture(params=["dashboard", "device page"])
def page(request, tmp_path: Path) -> Iterator[Page]:
    """Each page the project serves, with small limits: the dashboard with a desk on a real broker, the device's."""
    with served_page(request.param, request, tmp_path, SMALL) as served:
        yield served


def get(page: Page, source: str = "127.0.0.1", path: str = "/") -> int:
    """The status of a plain GET of the page (0: closed without an answer)."""
    return exchange(page.port, request("GET", path, page.host), source)[0]


def wait_for(condition, seconds: float) -> float:
    """Polls until the condition holds; the seconds it took (pytest fails past `seconds`)."""
    start = time.monotonic()
    while not condition():
        assert time.monotonic() - start < seconds, "the condition did not hold in time"
        time.sleep(0.05)
    return time.monotonic() - start


def test_the_default_bounds_are_the_ones_the_guides_state() -> None:
    stated = (DEFAULT_LIMITS.read_seconds, DEFAULT_LIMITS.request_seconds, DEFAULT_LIMITS.write_seconds)
    assert stated == (5.0, 10.0, 30.0)
    assert (DEFAULT_LIMITS.connections, DEFAULT_LIMITS.per_client, MAX_JSON_DEPTH) == (64, 16, 32)


def test_parsing_helpers_turn_every_malformed_value_into_a_bounded_refusal() -> None:
    def length(value: str) -> int:
        return content_length(json_headers(value), 4096)

    assert length("12") == 12
    for value, status in (("²", 400), ("-5", 400), ("1e3", 400), (" ", 400), ("9" * 5000, 413), ("4097", 413)):
        with pytest.raises(HttpRefusal) as refused:
            length(value)
        assert refused.value.status == status and len(refused.value.reason) <= 200, value
    for body in (b"[" * 2000 + b"]" * 2000, b"\xff\xfe", b"{not json", b'{"a": NaN}', b'{"a": 1e999}', b"1" * 5000):
        with pytest.raises(HttpRefusal) as refused:
            json_body(body)
        assert refused.value.status == 400 and len(refused.value.reason) <= 200, body[:20]
    assert json_body(b'{"a": ["[{", 1.5]}') == {"a": ["[{", 1.5]}, "brackets inside strings do not count"
    assert form_body(b"query=a.png&label=3") == {"query": "a.png", "label": "3"}
    for form in (b"a=%ff", b"&".join(b"f%d=1" % n for n in range(20))):
        with pytest.raises(HttpRefusal):
            form_body(form)
    assert ascii_int("-1", "label") == -1
    for text in ("٣", "²", " 3", "3.0", "1" * 20):
        with pytest.raises(HttpRefusal):
            ascii_int(text, "label")


def json_headers(length: str):
    """Headers as the server parses them, with one Content-Length."""
    return email.parser.Parser().parsestr(f"Content-Length: {length}\r\n\r\n")


def test_the_host_rule_serves_loopback_names_the_bound_address_and_given_names_only() -> None:
    loopback = HostRule.serving("127.0.0.1")
    for host in ("localhost:8080", "127.0.0.1:8080", "[::1]:8080", "127.0.0.1", "LOCALHOST"):
        assert loopback.allows(host), host
    for host in ("evil.example", "evil.example:8080", "127.0.0.1.evil.example", "192.0.2.7:8080", "a b", ""):
        assert not loopback.allows(host), host
    beyond = HostRule.serving("0.0.0.0", ("fal.example",))
    for host in ("fal.example:8443", "192.0.2.7:8080", "[2001:db8::1]:80", socket.gethostname(), "localhost"):
        assert beyond.allows(host), host
    assert not beyond.allows("evil.example:8080")
    assert served_names(["fal.example", "[2001:db8::1]"]) == ("fal.example", "2001:db8::1")
    for bad in (["fal.example:8080"], ["a b"], ["x" * 300]):
        with pytest.raises(UsageError, match="--dashboard-host"):
            served_names(bad)


def test_idle_connections_beyond_the_bounds_cost_no_thread_and_the_page_comes_back_by_itself(page: Page) -> None:
    """The EMFILE class: idle connections no longer each hold a thread and a descriptor for ever."""
    held = [connect(page.port, "127.0.0.2") for _ in range(3 * SMALL.per_client)]
    wait_for(lambda: page.server.health().open_connections == SMALL.per_client, SMALL.read_seconds)
    assert page.threads() <= SMALL.per_client, "one address holds at most its share"
    assert get(page) == 200, "another client is served at once"
    held += [connect(page.port, f"127.0.0.{source}") for source in range(3, 7) for _ in range(SMALL.per_client)]
    # the bound full (before the first ones' read timeout frees places, however loaded the machine)
    wait_for(lambda: page.server.health().open_connections == SMALL.connections, SMALL.read_seconds)
    assert page.threads() <= SMALL.connections
    assert get(page) in (503, 0), "beyond the bound a new connection is refused at once"
    assert page.server.health().refused_connections >= 2 * SMALL.per_client
    took = wait_for(lambda: get(page) == 200, SMALL.request_seconds + 3)
    assert took <= SMALL.read_seconds + 1, "a silent connection is cut at its read timeout"
    wait_for(lambda: select.select(held, [], [], 0)[0] == held, SMALL.read_seconds + 1)  # each one closed
    for sock in held:
        sock.close()
    assert page.server.serving and page.server.health().timed_out_requests >= SMALL.connections - 1


def test_a_slowloris_is_cut_off_by_the_request_deadline_not_the_per_read_timeout(page: Page) -> None:
    with connect(page.port) as sock:
        start = time.monotonic()
        sock.sendall(f"GET / HTTP/1.1\r\nHost: {page.host}\r\nX-Slow: ".encode())
        closed = False
        while not closed and time.monotonic() - start < SMALL.request_seconds + 3:
            try:
                sock.sendall(b"a")  # one byte well within the per-read timeout
            except OSError:
                break
            closed = bool(select.select([sock], [], [], SMALL.read_seconds * 0.6)[0])
        took = time.monotonic() - start
    assert SMALL.request_seconds - 0.2 <= took <= SMALL.request_seconds + 1.5
    assert page.server.health().timed_out_requests >= 1


def test_a_body_sent_too_slowly_gets_408(page: Page) -> None:
    headers = {**page.post_headers, "Content-Length": "100"}
    with connect(page.port) as sock:
        sock.sendall(request("POST", page.post_path, page.host, headers))
        start = time.monotonic()
        reply = b""
        while not reply and time.monotonic() - start < SMALL.request_seconds + 3:
            sock.sendall(b"1")
            if select.select([sock], [], [], 0.3)[0]:
                reply = sock.recv(4096)
    assert reply.startswith(b"HTTP/1.0 408 "), reply[:80]


def malformed(page: Page) -> list[tuple[str, bytes, int]]:
    """(what, raw request, status) of the requests that ended in tracebacks or hung, and their refusals now."""
    post = page.post_headers

    def posted(length: str, body: bytes, extra: dict[str, str] | None = None) -> bytes:
        return request("POST", page.post_path, page.host, {**post, "Content-Length": length, **(extra or {})}, body)

    nested = b"[" * 2000 + b"]" * 2000
    return [
        ("superscript length", posted("²", b"{}"), 400),
        ("negative length", posted("-1", b"{}"), 400),
        ("huge length", posted("9" * 40, b"{}"), 413),
        ("length over the limit", posted("5000", b"x" * 5000), 413),
        ("two lengths", posted("2", b"{}", {"content-length": "3"}), 400),
        ("chunked", request("POST", page.post_path, page.host, {**post, "Transfer-Encoding": "chunked"}), 411),
        ("no length", request("POST", page.post_path, page.host, post), 411),
        ("2000 nested [", posted(str(len(nested)), nested), 400),
        ("not UTF-8", posted("4", b"\xff\xfe\xfd\xfc"), 400),
        ("not JSON", posted("9", b"{not json"), 400),
        ("wrong shape", posted("9", b"[1, 2, 3]"), 400),
        ("NaN", posted("12", b'{"label":NaN}'), 400),
        ("short body", posted("50", b"{}"), 400),
        ("unknown path", request("GET", "/etc/passwd", page.host), 404),
        ("unknown post path", request("POST", "/nope", page.host, {**post, "Content-Length": "2"}, b"{}"), 404),
        ("unknown method", request("BREW", "/", page.host), 405),
        ("HEAD", request("HEAD", "/", page.host), 405),
        ("garbage line", b"\x00\x01\x02 \xff\r\n\r\n", 400),
        ("long line", b"GET /" + b"a" * 70000 + b" HTTP/1.1\r\n\r\n", 414),
        ("many headers", request("GET", "/", page.host, {f"X-{n}": "1" for n in range(200)}), 431),
        ("no Host", request("GET", "/", None), 400),
        ("two Hosts", request("GET", "/", page.host, {"host": "localhost"}), 400),
        ("rebinding Host", request("GET", "/", f"evil.example:{page.port}"), 421),
        (
            "rebinding post",
            request("POST", page.post_path, "rebind.evil.example", {**post, "Content-Length": "2"}, b"{}"),
            421,
        ),
        ("another site's post", posted("2", b"{}", {"Origin": "http://evil.example"}), 403),
        ("a sandboxed post", posted("2", b"{}", {"Origin": "null"}), 403),
        ("a big round number", request("GET", "/api/rounds/" + "9" * 5000 + "/divergence", page.host), 404),
    ]


def test_requests_that_ended_in_tracebacks_get_a_bounded_4xx_and_the_page_keeps_serving(page: Page, capfd) -> None:
    with tracebacks() as logged:
        for what, raw, expected in malformed(page):
            status, response = exchange(page.port, raw)
            assert status == expected, (page.name, what, response[:200])
            assert len(body_of(response)) < 400, (what, response[:200])
    assert not logged, [record.getMessage() for record in logged]
    assert "Traceback" not in capfd.readouterr().err
    assert get(page) == 200 and page.server.serving


class BuggyHandler(EdgeHandler):
    """A handler with a bug on /bug, as any page might have one."""

    def do_GET(self) -> None:
        """200 on /, a bug on /bug."""
        if self.path == "/bug":
            raise RuntimeError("a bug in a handler")
        self.send_body(HTTPStatus.OK, b"ok\n", "text/plain")


def test_a_handler_bug_is_logged_with_its_traceback_answered_500_and_the_server_keeps_serving(capfd) -> None:
    server = EdgeServer(("127.0.0.1", 0), BuggyHandler, "buggy", HostRule.serving("127.0.0.1"), SMALL)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    port = server.server_address[1]
    try:
        wait_for(lambda: server.serving, 5)
        with tracebacks() as logged:
            status, response = exchange(port, request("GET", "/bug", f"localhost:{port}"))
        assert status == 500 and b"a bug" not in response, "the client learns nothing of the bug"
        assert [record.getMessage() for record in logged] == [
            "http handler failed server=buggy request='GET /bug HTTP/1.1'"
        ]
        assert logged[0].exc_info is not None and str(logged[0].exc_info[1]) == "a bug in a handler"
        assert exchange(port, request("GET", "/", f"localhost:{port}"))[0] == 200
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)
    assert not server.serving and "Traceback" not in capfd.readouterr().err, "no stdlib traceback on stderr"


def test_beyond_loopback_the_dashboard_answers_its_served_names_and_addresses_only(tmp_path: Path) -> None:
    address = ListenAddress("0.0.0.0", 0)
    with Dashboard(address, tmp_path / "run", None, "a-token-of-sixteen-chars", hosts=("fal.example",)) as dashboard:
        port = dashboard.server.server_address[1]
        for host, status in (
            (f"fal.example:{port}", 200),
            (f"127.0.0.1:{port}", 200),
            (f"192.0.2.7:{port}", 200),
            (f"evil.example:{port}", 421),
            ("fal.example.evil.example", 421),
        ):
            assert exchange(port, request("GET", "/", host))[0] == status, host


def test_dashboard_host_needs_a_dashboard_and_a_name_without_a_port(tmp_path: Path, capsys) -> None:
    from coordinator.cli import main

    run = ["run", "--run-dir", str(tmp_path / "run"), "--rounds", "1"]
    assert main([*run, "--dashboard-host", "fal.example"]) == 2
    assert "--dashboard-host needs --dashboard" in capsys.readouterr().err
    serve = ["labelling", "serve", str(tmp_path / "run"), "--broker", "mqtt://127.0.0.1:1", "--dashboard", "0"]
    assert main([*serve, "--dashboard-host", "fal.example:80"]) == 2
    assert "--dashboard-host must be a host name" in capsys.readouterr().err


def fds_and_threads(pid: int) -> tuple[int, int]:
    """A process's open file descriptors and threads, from /proc."""
    return len(os.listdir(f"/proc/{pid}/fd")), len(os.listdir(f"/proc/{pid}/task"))


def test_a_flood_of_idle_connections_leaves_a_real_desk_its_descriptors_and_it_still_takes_queries(
    tmp_path: Path, module_broker, sessions
) -> None:
    """The fault as found: `fl-coordinator labelling serve` under 256 descriptors and 400 idle connections from 25
    addresses; before the bounds the next query's image write failed with EMFILE."""
    port = free_loopback_port()
    command = [sys.executable, "-m", "coordinator", "labelling", "serve", str(tmp_path / "run")]
    command += ["--broker", f"mqtt://127.0.0.1:{module_broker.port}", "--fleet", FLEET, "--dashboard", str(port)]
    with open(tmp_path / "desk.log", "wb") as log:
        desk = subprocess.Popen(
            command,
            stdout=log,
            stderr=log,
            preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256)),
        )
    held: list[socket.socket] = []
    try:
        url = f"http://127.0.0.1:{port}/"
        wait_for(lambda: answers(url), 30)
        before = fds_and_threads(desk.pid)
        for source in range(2, 27):
            for _ in range(16):
                held.append(connect(port, f"127.0.0.{source}"))
        time.sleep(1.0)
        fds, threads = fds_and_threads(desk.pid)
        assert fds <= before[0] + 64 + 4 and threads <= before[1] + 64 + 2, (before, fds, threads)
        device = sessions(module_broker.address, "cam-9")
        device.subscribe(topics.LABELLING_DOWN.build(fleet=FLEET, device="cam-9"))
        query = LabelQuery("cam-9", "q9", png(), "image/png", 1.0, 1, 0.7, 0.3, 0.5)
        receipt = None
        for _ in range(10):
            device.publish(topics.LABEL_QUERIES.build(fleet=FLEET, device="cam-9"), wire.encode(query))
            message = device.next_message(timeout=2)
            if message is not None:
                receipt = wire.decode(message.payload, QueryReceipt)
                break
        assert receipt is not None and receipt.queued, "the query's image was written despite the flood"
        for sock in held:
            sock.close()
        held.clear()
        wait_for(lambda: next_query(url) == "q9", 15)
        with urllib.request.urlopen(url + "metrics", timeout=5) as response:
            metrics = response.read().decode()
        refused = next(line for line in metrics.splitlines() if line.startswith("fl_http_connections_refused_total"))
        assert float(refused.split()[-1]) >= 400 - 64, "the refusals at the bound show in /metrics"
    finally:
        for sock in held:
            sock.close()
        desk.terminate()
        desk.wait(10)
    assert "Traceback" not in (tmp_path / "desk.log").read_text(), (tmp_path / "desk.log").read_text()[-2000:]


def answers(url: str) -> bool:
    """Whether the page answers 200."""
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


def next_query(url: str) -> str | None:
    """The query id the labelling API shows next, None when it does not answer."""
    try:
        with urllib.request.urlopen(url + "api/label/next?person=ana", timeout=2) as response:
            shown = json.loads(response.read())["query"]
    except OSError:
        return None
    return None if shown is None else shown["query_id"]
