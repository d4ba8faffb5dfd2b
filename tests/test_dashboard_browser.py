# A real headless chromium (driven over chromedriver's W3C WebDriver HTTP API) watches a running simulation.
from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from browser import ARTIFACTS, WebDriver, headless_chromium, needs_chromium, wait_for

DEVICES = 3

pytestmark = [pytest.mark.integration, needs_chromium]


class Simulation:
    """`fl-bench simulate --dashboard 127.0.0.1:0` as a user runs it; collects its output lines."""

    def __init__(self, run_dir: Path, rounds: int) -> None:
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "bench",
                "simulate",
                "--devices",
                str(DEVICES),
                "--rounds",
                str(rounds),
                "--pool-size",
                "200",
                "--labels-per-acquisition",
                "20",
                "--epochs",
                "1",
                "--test-samples",
                "500",
                "--no-device-eval",
                "--sampler",
                "random",
                "--init-samples",
                "50",
                "--init-epochs",
                "5",
                "--validation-samples",
                "100",
                "--run-dir",
                str(run_dir),
                "--dashboard",
                "127.0.0.1:0",
                "--json",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.stdout: list[str] = []
        self.stderr: list[str] = []
        self.readers = [
            threading.Thread(target=self.read, args=(stream, lines), daemon=True)
            for stream, lines in ((self.process.stdout, self.stdout), (self.process.stderr, self.stderr))
        ]
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
    simulation = Simulation(tmp_path / "run", rounds=4)  # the first look may land as late as round 3
    try:
        url = wait_for(simulation.dashboard_url, 60, "the dashboard URL on stderr")
        with headless_chromium(tmp_path / "chromium-profile") as browser:
            watch_dashboard(browser, url)
        assert simulation.finish(timeout=600) == 0, "\n".join(simulation.stderr[-20:])
    finally:
        simulation.stop()
    summary = json.loads(simulation.stdout[-1])["summary"]
    assert summary["rounds"] == 4
    report = Path(summary["report"])
    assert report == tmp_path / "run" / "report.html"
    assert report.read_text().count('src="data:image/png;base64,') == 5


def watch_dashboard(browser: WebDriver, url: str) -> None:
    """Two looks at the page while rounds go on: every device listed, the round counter moves, a heatmap row each."""
    browser.open(url)
    rows_script = "return [...document.querySelectorAll('#devices tbody tr')].map(r => r.dataset.device)"
    round_script = "return Number(document.getElementById('round-counter').textContent)"
    first_devices = wait_for(
        lambda: (lambda ids: ids if len(ids) == DEVICES else None)(browser.evaluate(rows_script)),
        180,
        "every device in the table",
    )
    assert first_devices == [f"dev-{i:02d}" for i in range(DEVICES)]
    first_round = wait_for(lambda: browser.evaluate(round_script), 180, "a round number")
    with urllib.request.urlopen(url + "metrics", timeout=30) as response:
        metrics = dict(line.rsplit(" ", 1) for line in response.read().decode().splitlines() if line[0] != "#")
    assert int(metrics["fl_devices_online"]) == DEVICES and int(metrics["fl_current_round"]) >= first_round
    assert int(metrics["fl_updates_accepted_total"]) >= DEVICES * (first_round - 1)
    later_round = wait_for(
        lambda: (lambda r: r if r > first_round else None)(browser.evaluate(round_script)),
        180,
        f"the round counter to pass {first_round}",
    )
    assert later_round > first_round >= 1
    heat_rows = wait_for(
        lambda: browser.evaluate(
            "return [...document.querySelectorAll('#divergence-heatmap g.heat-row')].map(g => g.dataset.device)"
        ),
        120,
        "the divergence heatmap",
    )
    assert heat_rows == first_devices
    cells = browser.evaluate("return document.querySelectorAll('#divergence-heatmap g.heat-row rect').length")
    assert cells == DEVICES * 12  # the paper CNN's 12 tensors
    assert browser.evaluate("return document.querySelectorAll('#timeline tbody tr').length") >= 1
    serving = browser.evaluate("return document.getElementById('run-serving').textContent")
    assert serving.startswith(("W0", "round ")), serving  # which round's model the devices predict with (and why not)
    decided = "return [...document.querySelectorAll('#timeline tbody tr')].map(r => r.lastChild.textContent)"
    assert all(cell in ("promoted", "-") or cell.startswith("not promoted: ") for cell in browser.evaluate(decided))
    assert browser.evaluate("return document.getElementById('connection').className") == "ok"
    shot = browser.screenshot(ARTIFACTS / "dashboard.png")
    print(f"dashboard screenshot: {shot}")
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
