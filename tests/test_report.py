# The run report: one self-contained HTML file (PNG charts as data: URIs) that renders with no network at all.
from __future__ import annotations

import base64
import io
import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
from browser import headless_chromium, needs_chromium
from PIL import Image
from run_records import fill_store

from coordinator.dashboard.report import write_report
from coordinator.labelling.queue import LabelQueue
from coordinator.rounds.evaluation import class_accuracies
from coordinator.storage.store import RunStore
from protocol.label_messages import LabelQuery

CHARTS = 5  # accuracy per round, accuracy against labels, divergence heatmap, per-class accuracy, timeline


def embedded_pngs(page: str) -> list[Image.Image]:
    """Every <img> of the page decoded from its data: URI."""
    return [
        Image.open(io.BytesIO(base64.b64decode(data)))
        for data in re.findall(r'<img [^>]*src="data:image/png;base64,([A-Za-z0-9+/=]+)"', page)
    ]


def test_report_is_self_contained(tmp_path: Path) -> None:
    fill_store(tmp_path / "run")
    path = write_report(tmp_path / "run")
    assert path == tmp_path / "run" / "report.html"
    page = path.read_text()
    assert not re.search(r"https?://", page)
    assert not re.search(r"<(script|link|iframe)\b", page)
    sources = re.findall(r'\b(?:src|href)="([^"]*)"', page)
    assert len(sources) == CHARTS and all(s.startswith("data:image/png;base64,") for s in sources)
    images = embedded_pngs(page)
    assert len(images) == CHARTS
    assert all(image.format == "PNG" and image.width >= 400 and image.height >= 100 for image in images)
    assert "intruder: stale round" in page and "dev-02" in page and "run-x" in page


def test_report_counts_the_labelling_queues_answers_and_corrections(tmp_path: Path) -> None:
    fill_store(tmp_path / "run")
    assert "<h2>Labelling</h2>" not in write_report(tmp_path / "run").read_text(), "no queue, no section"
    queue = LabelQueue(tmp_path / "run", ("cat", "dog"))
    buffer = io.BytesIO()
    Image.fromarray(np.zeros((8, 8), dtype=np.uint8)).save(buffer, format="PNG")
    for query_id in ("q1", "q2"):
        queue.add(LabelQuery("cam-1", query_id, buffer.getvalue(), "image/png", 1.0), "cam-1")
    queue.record("cam-1", "q1", 0, "ana")
    queue.record("cam-1", "q1", 1, "ana", change=True)
    queue.close()
    page = write_report(tmp_path / "run").read_text()
    assert "1 open queries; 1 corrections of answers already sent (1 not yet stored by their devices)" in page
    assert "<td>ana</td><td>1</td><td>1</td>" in page


def test_report_of_a_run_without_rounds_says_so(tmp_path: Path) -> None:
    with RunStore(tmp_path / "run") as store:
        store.set_config({"run_id": "empty-run", "settings": {}})
    page = write_report(tmp_path / "run", tmp_path / "elsewhere" / "r.html").read_text()
    assert "No round has been committed yet" in page and "<img" not in page


def test_report_command(tmp_path: Path) -> None:
    fill_store(tmp_path / "run")
    result = subprocess.run(
        [sys.executable, "-m", "coordinator", "report", str(tmp_path / "run")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str(tmp_path / "run" / "report.html")
    assert len(embedded_pngs((tmp_path / "run" / "report.html").read_text())) == CHARTS
    missing = subprocess.run(
        [sys.executable, "-m", "coordinator", "report", str(tmp_path / "nothing")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert missing.returncode == 2 and missing.stderr.strip().splitlines() == [
        f"fl-coordinator: {tmp_path / 'nothing'} holds no run (no run.sqlite)"
    ]
    assert not (tmp_path / "nothing").exists()


@needs_chromium
def test_report_renders_in_a_browser_without_network(tmp_path: Path) -> None:
    fill_store(tmp_path / "run")
    path = write_report(tmp_path / "run")
    offline = ["--proxy-server=http://127.0.0.1:9", "--proxy-bypass-list=<-loopback>"]  # any fetch would fail
    with headless_chromium(tmp_path / "chromium-profile", offline) as browser:
        browser.open(path.as_uri())
        sizes = browser.evaluate("return [...document.images].map(i => [i.complete, i.naturalWidth])")
    assert len(sizes) == CHARTS and all(complete and width >= 400 for complete, width in sizes)


def test_class_accuracies_per_class_and_none_for_absent_classes() -> None:
    labels = np.array([0, 0, 1, 1, 1, 3])
    predicted = np.array([0, 1, 1, 1, 0, 3])
    assert class_accuracies(predicted, labels, 4) == [0.5, 2 / 3, None, 1.0]


def test_a_benchmark_runs_report_shows_its_sweeps_label_efficiency_figure_and_table(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    fill_store(sweep / "type2-margin-seed0")
    figure = io.BytesIO()
    Image.new("RGB", (640, 240), "white").save(figure, format="PNG")
    (sweep / "label_efficiency.png").write_bytes(figure.getvalue())
    curve = {"seeds": [0, 1, 2], "aulc": 0.8179, "final": 0.8758, "aulc_gain_over_random": 0.0253}
    summary = {"type2": {"margin": {**curve, "labels_to_random_final": 4100}, "random": {**curve, "aulc": 0.7926}}}
    (sweep / "label_efficiency.json").write_text(json.dumps({"summary": summary, "runs": []}))
    page = write_report(sweep / "type2-margin-seed0").read_text()
    assert "Label efficiency of the sweep this run belongs to" in page
    assert len(embedded_pngs(page)) == CHARTS + 1
    assert "<td>margin</td><td>3</td><td>0.8179</td>" in page and "<td>4100</td>" in page
    fill_store(tmp_path / "alone")
    assert "Label efficiency" not in write_report(tmp_path / "alone").read_text()
