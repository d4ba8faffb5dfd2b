# A real headless chromium (driven over chromedriver's W3C WebDriver HTTP API) watches a running simulation.
from __future__ import annotations

import base64
import json
import re
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any, Callable

import pytest

CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
ARTIFACTS = Path(__file__).resolve().parent.parent / "test-artifacts"
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--no-first-run", "--window-size=1400,1800"]
DEVICES = 3

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(not (CHROMIUM.exists() and CHROMEDRIVER.exists()),
                       reason="needs Debian's chromium and chromium-driver (make system-deps installs them)"),
]


def free_port() -> int:
    """A loopback port nobody listens on right now."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def wait_for(condition: Callable[[], Any], timeout: float, what: str) -> Any:
    """Polls condition until it returns something truthy (returned), failing the test after timeout seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.5)
    pytest.fail(f"timed out after {timeout:.0f}s waiting for {what}")


class WebDriver:
    """Just enough of the W3C WebDriver protocol: a session, navigation, script evaluation and screenshots."""

    def __init__(self, port: int) -> None:
        self.base = f"http://127.0.0.1:{port}"
        self.session = ""

    def call(self, method: str, path: str, body: dict | None = None) -> Any:
        """One WebDriver command; returns its 'value'."""
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.base + path, data=data, method=method,
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as response:
            return json.loads(response.read())["value"]

    def start(self, user_data_dir: Path) -> None:
        """Opens a headless chromium with a fresh profile."""
        options = {"binary": str(CHROMIUM), "args": CHROMIUM_FLAGS + [f"--user-data-dir={user_data_dir}"]}
        value = self.call("POST", "/session", {"capabilities": {"alwaysMatch": {
            "browserName": "chrome", "goog:chromeOptions": options}}})
        self.session = value["sessionId"]

    def open(self, url: str) -> None:
        """Navigates to url."""
        self.call("POST", f"/session/{self.session}/url", {"url": url})

    def evaluate(self, script: str) -> Any:
        """The value of a script's `return` in the page."""
        return self.call("POST", f"/session/{self.session}/execute/sync", {"script": script, "args": []})

    def screenshot(self, path: Path) -> Path:
        """Saves the viewport as a PNG."""
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(base64.b64decode(self.call("GET", f"/session/{self.session}/screenshot")))
        return path

    def quit(self) -> None:
        """Closes the browser."""
        if self.session:
            self.call("DELETE", f"/session/{self.session}")


class Simulation:
    """`fl-coordinator simulate --dashboard 127.0.0.1:0` as a user runs it; collects its output lines."""

    def __init__(self, run_dir: Path, rounds: int) -> None:
        self.process = subprocess.Popen([
            sys.executable, "-m", "coordinator", "simulate", "--devices", str(DEVICES), "--rounds", str(rounds),
            "--pool-size", "200", "--labels-per-acquisition", "20", "--epochs", "1", "--test-samples", "500",
            "--no-device-eval", "--sampler", "random", "--init-samples", "50", "--init-epochs", "5",
            "--validation-samples", "100", "--run-dir", str(run_dir), "--dashboard", "127.0.0.1:0", "--json",
        ], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.stdout: list[str] = []
        self.stderr: list[str] = []
        self.readers = [threading.Thread(target=self.read, args=(stream, lines), daemon=True)
                        for stream, lines in ((self.process.stdout, self.stdout), (self.process.stderr, self.stderr))]
        for reader in self.readers:
            reader.start()

    @staticmethod
    def read(stream: Any, lines: list[str]) -> None:
        """Appends every line of a pipe until it closes."""
        for line in stream:
            lines.append(line.rstrip("\n"))

    def dashboard_url(self) -> str | None:
        """The URL the coordinator printed, once it has."""
        found = [m[1] for line in self.stderr if (m := re.match(r"dashboard at (http://\S+)", line))]
        return found[0] if found else None

    def finish(self, timeout: float) -> int:
        """Waits for the run to end; returns its exit code."""
        code = self.process.wait(timeout=timeout)
        for reader in self.readers:
            reader.join(timeout=10)
        return code

    def stop(self) -> None:
        """Terminates the run if it is still going (on a failed test)."""
        if self.process.poll() is None:
            self.process.terminate()
            self.process.wait(timeout=60)


def test_browser_watches_a_running_simulation(tmp_path: Path) -> None:
    """Device table lists every device, the round counter advances between two looks, the heatmap has a row per
    device; a screenshot is kept in test-artifacts/."""
    simulation = Simulation(tmp_path / "run", rounds=4)
    driver_port = free_port()
    chromedriver = subprocess.Popen([str(CHROMEDRIVER), f"--port={driver_port}"], stdout=subprocess.DEVNULL,
                                    stderr=subprocess.DEVNULL)
    browser = WebDriver(driver_port)
    try:
        url = wait_for(simulation.dashboard_url, 60, "the dashboard URL on stderr")
        wait_for(lambda: _answers(browser.base + "/status"), 30, "chromedriver")
        browser.start(tmp_path / "chromium-profile")
        browser.open(url)
        rows_script = "return [...document.querySelectorAll('#devices tbody tr')].map(r => r.dataset.device)"
        round_script = "return Number(document.getElementById('round-counter').textContent)"
        first_devices = wait_for(lambda: (lambda ids: ids if len(ids) == DEVICES else None)(
            browser.evaluate(rows_script)), 180, "every device in the table")
        assert first_devices == [f"dev-{i:02d}" for i in range(DEVICES)]
        first_round = wait_for(lambda: browser.evaluate(round_script), 180, "a round number")
        later_round = wait_for(lambda: (lambda r: r if r > first_round else None)(browser.evaluate(round_script)),
                               180, f"the round counter to pass {first_round}")
        assert later_round > first_round >= 1
        heat_rows = wait_for(lambda: browser.evaluate(
            "return [...document.querySelectorAll('#divergence-heatmap g.heat-row')].map(g => g.dataset.device)"),
            120, "the divergence heatmap")
        assert heat_rows == first_devices
        cells = browser.evaluate("return document.querySelectorAll('#divergence-heatmap g.heat-row rect').length")
        assert cells == DEVICES * 12  # the paper CNN's 12 tensors
        timeline = browser.evaluate("return document.querySelectorAll('#timeline tbody tr').length")
        assert timeline >= 1
        assert browser.evaluate("return document.getElementById('connection').className") == "ok"
        shot = browser.screenshot(ARTIFACTS / "dashboard.png")
        print(f"dashboard screenshot: {shot}")
        assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    finally:
        try:
            browser.quit()
        finally:
            chromedriver.terminate()
            chromedriver.wait(timeout=30)
    try:
        assert simulation.finish(timeout=600) == 0, "\n".join(simulation.stderr[-20:])
    finally:
        simulation.stop()
    summary = json.loads(simulation.stdout[-1])["summary"]
    assert summary["rounds"] == 4


def _answers(url: str) -> bool:
    """True once an HTTP server answers at url."""
    try:
        with urllib.request.urlopen(url, timeout=2):
            return True
    except OSError:
        return False
