# A headless chromium driven through chromedriver's W3C WebDriver HTTP API (urllib only, no selenium): the browser
# the tests and the benchmarks' scripted people use.
from __future__ import annotations

import base64
import contextlib
import json
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--window-size=1400,1800",
]


def free_port() -> int:
    """A loopback port nobody listens on right now."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def answers(url: str) -> bool:
    """True once an HTTP server answers at url."""
    try:
        with urllib.request.urlopen(url, timeout=2):
            return True
    except OSError:
        return False


def wait_until(condition: Callable[[], Any], timeout: float, what: str) -> Any:
    """Polls condition until it returns something truthy (returned); TimeoutError naming `what` after timeout s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.2)
    raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")


class WebDriver:
    """Just enough of the W3C WebDriver protocol: a session, navigation, script evaluation and screenshots."""

    def __init__(self, port: int) -> None:
        self.base = f"http://127.0.0.1:{port}"
        self.session = ""
        self.script_timeout = 30.0  # WebDriver's default

    def call(self, method: str, path: str, body: dict | None = None, timeout: float = 60) -> Any:
        """One WebDriver command; returns its 'value' (RuntimeError with the driver's message when it fails, as a
        script that throws)."""
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(
            self.base + path, data=data, method=method, headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                return json.loads(response.read())["value"]
        except urllib.error.HTTPError as failed:
            value = json.loads(failed.read() or b"{}").get("value", {})
            raise RuntimeError(f"webdriver {method} {path}: {str(value.get('message', value))[:500]}") from None

    def start(self, user_data_dir: Path, extra_flags: list[str]) -> None:
        """Opens a headless chromium with a fresh profile and any extra command-line flags."""
        options = {"binary": str(CHROMIUM), "args": CHROMIUM_FLAGS + extra_flags + [f"--user-data-dir={user_data_dir}"]}
        value = self.call(
            "POST",
            "/session",
            {"capabilities": {"alwaysMatch": {"browserName": "chrome", "goog:chromeOptions": options}}},
        )
        self.session = value["sessionId"]

    def open(self, url: str) -> None:
        """Navigates to url."""
        self.call("POST", f"/session/{self.session}/url", {"url": url})

    def evaluate(self, script: str, args: list[Any] | None = None, timeout: float = 30) -> Any:
        """The value of a script's `return` in the page (a returned promise is awaited, for up to `timeout` s)."""
        if timeout != self.script_timeout:
            self.call("POST", f"/session/{self.session}/timeouts", {"script": int(timeout * 1000)})
            self.script_timeout = timeout
        body = {"script": script, "args": args or []}
        return self.call("POST", f"/session/{self.session}/execute/sync", body, timeout=timeout + 30)

    def screenshot(self, path: Path) -> Path:
        """Saves the viewport as a PNG."""
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(base64.b64decode(self.call("GET", f"/session/{self.session}/screenshot")))
        return path

    def quit(self) -> None:
        """Closes the browser."""
        if self.session:
            self.call("DELETE", f"/session/{self.session}")


@contextlib.contextmanager
def headless_chromium(user_data_dir: Path, extra_flags: list[str] | None = None) -> Iterator[WebDriver]:
    """A chromedriver on a free port with one headless chromium session; both are closed on leaving."""
    port = free_port()
    chromedriver = subprocess.Popen(
        [str(CHROMEDRIVER), f"--port={port}"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    browser = WebDriver(port)
    try:
        wait_until(lambda: answers(browser.base + "/status"), 30, "chromedriver")
        browser.start(user_data_dir, extra_flags or [])
        yield browser
    finally:
        try:
            browser.quit()
        finally:
            chromedriver.terminate()
            chromedriver.wait(timeout=30)
