# The labelling page: served from real query files, clicked in headless chromium (W3C WebDriver over urllib).
from __future__ import annotations

import json
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from test_folder_pool import camera_oracle

from bench.browser import CHROMEDRIVER, CHROMIUM, CHROMIUM_FLAGS
from edge_agent.field.folder_oracle import QueryBook
from edge_agent.field.label_ui import LabelServer, parse_listen_address

ELEMENT_KEY = "element-6066-11e4-a52e-4f735466cecf"


@pytest.fixture()
def book(tmp_path: Path) -> QueryBook:
    """Three real PNG queries in round 1, written by the folder oracle itself."""
    oracle = camera_oracle(tmp_path, 3)
    oracle.start_round(1)
    oracle.ask(np.arange(3))
    return oracle.book


@pytest.fixture()
def server(book: QueryBook):
    running = LabelServer(book).start()
    yield running
    running.stop()


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def http(method: str, url: str, body: dict | bytes | None = None) -> tuple[int, bytes]:
    """(status, body) of one request; a JSON body for dicts, a form body for bytes."""
    data = json.dumps(body).encode() if isinstance(body, dict) else body
    headers = {"Content-Type": "application/json" if isinstance(body, dict) else "application/x-www-form-urlencoded"}
    request = urllib.request.Request(url, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()


class WebDriver:
    """Just enough of the W3C WebDriver protocol to open a page, find, click and run a script."""

    def __init__(self, profile_dir: Path) -> None:
        self.port = free_port()
        self.process = subprocess.Popen(
            [str(CHROMEDRIVER), f"--port={self.port}"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        self.base = f"http://127.0.0.1:{self.port}"
        deadline = time.monotonic() + 20
        while not self._ready():
            if time.monotonic() > deadline:
                raise RuntimeError("chromedriver did not start")
            time.sleep(0.1)
        options = {"binary": str(CHROMIUM), "args": CHROMIUM_FLAGS + [f"--user-data-dir={profile_dir}"]}
        created = self.call(
            "POST",
            "/session",
            {"capabilities": {"alwaysMatch": {"browserName": "chrome", "goog:chromeOptions": options}}},
        )
        self.session = created["sessionId"]

    def _ready(self) -> bool:
        try:
            return json.loads(http("GET", f"{self.base}/status")[1])["value"]["ready"]
        except (OSError, ValueError, KeyError):
            return False

    def call(self, method: str, path: str, body: dict | None = None):
        status, raw = http(method, self.base + path, body if body is not None else ({} if method == "POST" else None))
        value = json.loads(raw)["value"]
        assert status == 200, f"webdriver {method} {path}: {status} {value}"
        return value

    def command(self, method: str, path: str, body: dict | None = None):
        return self.call(method, f"/session/{self.session}{path}", body)

    def find_all(self, css: str) -> list[str]:
        return [e[ELEMENT_KEY] for e in self.command("POST", "/elements", {"using": "css selector", "value": css})]

    def script(self, source: str):
        return self.command("POST", "/execute/sync", {"script": source, "args": []})

    def close(self) -> None:
        try:
            self.call("DELETE", f"/session/{self.session}")
        finally:
            self.process.terminate()
            self.process.wait(timeout=10)


def test_a_click_in_headless_chromium_labels_a_query_and_the_label_is_on_disk(tmp_path, book, server):
    driver = WebDriver(tmp_path / "chrome-profile")
    try:
        driver.command("POST", "/url", {"url": server.url})
        assert len(driver.find_all("div.query")) == 3
        widths = driver.script("return Array.from(document.images).map(i => i.complete ? i.naturalWidth : -1)")
        assert widths == [28, 28, 28], "every query image is served from the device"
        target = book.queries()[1]
        buttons = driver.find_all(f'button[data-query="{target.name}"][value="3"]')
        assert len(buttons) == 1 and driver.command("GET", f"/element/{buttons[0]}/text") == "Dress"
        driver.command("POST", f"/element/{buttons[0]}/click", {})
        deadline = time.monotonic() + 20
        while not book.answers() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert book.answers() == {target.name: 3}
        stored = [(answer.query_id, answer.label, answer.road) for answer in book.store.answers()]
        assert stored == [(target.query_id, 3, "page")], "the page delivers to the query store, nothing else"
        assert not book.labels_path.exists()
        deadline = time.monotonic() + 20
        while len(driver.find_all("div.query")) != 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not driver.find_all(f'button[data-query="{target.name}"]'), "the answered query left the page"
        assert len(driver.find_all("div.query")) == 2
    finally:
        driver.close()


def test_bad_posts_are_refused_and_lose_nothing_and_only_query_images_are_served(book, server):
    name = book.queries()[0].name
    assert http("POST", server.url + "label", f"query={name}&label=4".encode())[0] == 200
    before = book.store.answers()
    for form in (
        b"query=nope.png&label=1",
        f"query={name}&label=10".encode(),
        f"query={name}&label=x".encode(),
        f"query={name}".encode(),
    ):
        status, body = http("POST", server.url + "label", form)
        assert status == 400 and body.startswith((b"label not saved", b"label must be an integer")), form
    assert book.store.answers() == before
    assert http("GET", server.url + f"image/{name}")[0] == 200
    for path in ("image/..%2F..%2Fstate%2Flabels.npz", "image/index.csv", "etc/passwd"):
        assert http("GET", server.url + path)[0] == 404, path
    assert b"Pending queries: 2" in http("GET", server.url)[1]


def test_listen_address_defaults_to_loopback_and_rejects_garbage():
    assert parse_listen_address("8080") == ("127.0.0.1", 8080)
    assert parse_listen_address("0.0.0.0:9000") == ("0.0.0.0", 9000)
    assert parse_listen_address("[::1]:9000") == ("::1", 9000)
    for bad in ("", "host:", "80a", "1:99999", "²", "host:²", "1" * 5000):
        with pytest.raises(ValueError, match=r"\[HOST:\]PORT"):
            parse_listen_address(bad)
