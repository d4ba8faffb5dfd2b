# A run's self-contained HTML report: the dashboard's charts as embedded PNGs plus per-class accuracy (Figure 11).
from __future__ import annotations

import base64
import html
import json
import time
from pathlib import Path

from coordinator.dashboard import charts
from coordinator.dashboard.views import (
    RunSnapshot,
    class_accuracy_view,
    devices_view,
    divergence_view,
    load_snapshot,
    rounds_view,
    run_view,
)
from coordinator.labelling.queue import LabelQueue
from coordinator.labelling.queue_schema import DATABASE, QUEUE_FOLDER
from protocol.errors import UsageError
from protocol.files import atomic_write_bytes

REPORT_NAME = "report.html"
SWEEP_FIGURE = "label_efficiency.png"  # what benchmarks/label_efficiency.py writes beside its runs' directories
SWEEP_SUMMARY = "label_efficiency.json"
STYLE = """
body { font-family: sans-serif; margin: 2em; color: #1d2330; }
table { border-collapse: collapse; margin-bottom: 1.5em; font-size: 0.9em; }
th, td { text-align: left; padding: 0.25em 0.6em; border-bottom: 1px solid #e3e5ea; }
img { display: block; max-width: 100%; margin-bottom: 1.5em; }
.rejected { color: #b42318; }
"""


def image(png: bytes, alt: str) -> str:
    """An <img> carrying the PNG itself as a data: URI, so the file needs nothing beside it."""
    return f'<img alt="{html.escape(alt)}" src="data:image/png;base64,{base64.b64encode(png).decode()}">'


def table(headers: list[str], rows: list[list[object]]) -> str:
    """An HTML table with every cell escaped."""
    head = "".join(f"<th>{html.escape(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def number(value: float | None, digits: int = 4) -> str:
    """value with `digits` decimals, or '-' when missing."""
    return "-" if value is None else f"{value:.{digits}f}"


def last_update_text(update: dict | None) -> str:
    """A device's last update as 'round N, B bytes, accepted' or '... rejected: reason'."""
    if update is None:
        return "-"
    outcome = "accepted" if update["accepted"] else f"rejected: {update['reason']}"
    return f"round {update['round_id']}, {update['size']} bytes, {outcome}"


def report_html(snapshot: RunSnapshot, sweep: list[str] | None = None, labelling: list[str] | None = None) -> str:
    """The whole report page for a run's snapshot, with the label-efficiency sweep's section and the labelling
    queue's when it has them."""
    run = run_view(snapshot, None)
    rounds = rounds_view(snapshot)
    title = f"edge-fal run {run['run_id'] or '(unnamed)'}"
    parts = [
        f"<h1>{html.escape(title)}</h1>",
        run_table(run, rounds),
        model_table(run["model"]),
        *devices_section(devices_view(snapshot, None)),
        *(labelling or []),
    ]
    if not rounds:
        return page(title, [*parts, "<p>No round has been committed yet.</p>"])
    serving = serving_section(run["serving"])
    return page(title, parts + charts_section(snapshot, rounds) + (sweep or []) + timeline_section(rounds) + serving)


def run_table(run: dict, rounds: list[dict]) -> str:
    """The run's one-line summary: fleet, strategy, progress, final accuracy, labels, when written."""
    final = rounds[-1] if rounds else {"accuracy": None, "labels": 0}
    progress = f"{run['rounds_completed']} of {run['total_rounds']}"
    row = [
        run["fleet"],
        run["strategy"],
        progress,
        number(final["accuracy"]),
        final["labels"],
        run["privacy"]["summary"],
        run["secure"]["summary"],
        time.strftime("%Y-%m-%d %H:%M:%S"),
    ]
    headers = ["fleet", "strategy", "rounds", "final accuracy", "labels used", "differential privacy"]
    headers += ["secure aggregation", "written"]
    return table(headers, [row]) + privacy_table(run["privacy"])


def privacy_table(privacy: dict) -> str:
    """A private run's accountant figures: the spent epsilon, delta, budget, last clip and noise multiplier."""
    if privacy["epsilon"] is None:
        return ""
    row = [
        privacy["placement"],
        number(privacy["epsilon"]),
        f"{privacy['delta']:g}",
        "-" if privacy["epsilon_budget"] is None else f"{privacy['epsilon_budget']:g}",
        number(privacy["clip"]),
        number(privacy["noise_multiplier"]),
    ]
    return table(["DP placement", "epsilon spent", "delta", "budget", "clip", "noise multiplier"], [row])


def model_table(model: dict) -> str:
    """The model the run trained: architecture, input shape, class names (index: name) and spec hash."""
    shape = "x".join(str(side) for side in model["input_shape"])
    names = ", ".join(f"{index}: {name}" for index, name in enumerate(model["class_names"]))
    return table(
        ["model", "input", "classes", "spec"], [[model["architecture"], shape, names, model["spec_hash"][:12]]]
    )


def devices_section(devices: list[dict]) -> list[str]:
    """The device table: rounds joined, labels, class histogram, last local accuracy and last update."""
    header = [
        "device",
        "rounds joined",
        "labelled",
        "oracle labels",
        "class histogram",
        "last local accuracy",
        "last update",
    ]
    rows = [
        [
            d["device_id"],
            d["rounds_joined"],
            d["labelled"],
            d["acquired_labels"],
            " ".join(str(c) for c in d["class_counts"]),
            number(d["local_accuracy"]),
            last_update_text(d["last_update"]),
        ]
        for d in devices
    ]
    return ["<h2>Devices</h2>", table(header, rows)]


def charts_section(snapshot: RunSnapshot, rounds: list[dict]) -> list[str]:
    """Accuracy per round and against labels; the last round's divergence heatmap and per-class accuracy."""
    last = rounds[-1]["round"]
    parts = [
        "<h2>Accuracy</h2>",
        image(charts.accuracy_chart(rounds), "accuracy per round"),
        image(charts.labels_chart(rounds), "accuracy against labels used"),
    ]
    divergence = divergence_view(snapshot, last)
    if divergence and divergence["devices"]:
        parts += ["<h2>Per-layer divergence</h2>", image(charts.divergence_heatmap(divergence), "divergence heatmap")]
    classes = class_accuracy_view(snapshot, last)
    if classes and classes["aggregate"]:
        parts += ["<h2>Per-class accuracy</h2>", image(charts.class_accuracy_chart(classes), "per-class accuracy")]
    return parts


def sweep_section(run_dir: Path) -> list[str]:
    """The label-efficiency figure (and its per-sampler table) of the benchmark sweep this run belongs to, read from
    the run directory's parent where the benchmark writes them; nothing for a run that came from elsewhere."""
    figure = run_dir.parent / SWEEP_FIGURE
    if not figure.is_file():
        return []
    parts = ["<h2>Label efficiency of the sweep this run belongs to</h2>", image(figure.read_bytes(), SWEEP_FIGURE)]
    try:
        summary = json.loads((run_dir.parent / SWEEP_SUMMARY).read_text())["summary"]
    # json raises ValueError for a damaged sweep summary: the report then shows the figure alone
    except (OSError, ValueError, KeyError, TypeError):
        return parts
    header = ["partition", "sampler", "seeds", "AULC", "final", "AULC gain over random", "labels to random's final"]
    rows = [
        [partition, sampler, len(c["seeds"]), number(c["aulc"]), number(c["final"])]
        + [number(c.get("aulc_gain_over_random")), c.get("labels_to_random_final") or "-"]
        for partition, curves in summary.items()
        for sampler, c in curves.items()
    ]
    return [*parts, table(header, rows)]


def round_name(row: dict) -> str:
    """A round's number, with the weight the pools refined it with where they did (a pooled head's round)."""
    weight = row.get("pool_weight")
    return str(row["round"]) if weight is None else f"{row['round']} (refined by the pools, weight {weight:.3f})"


def timeline_section(rounds: list[dict]) -> list[str]:
    """The round timeline chart and table: duration, quorum, accepted, stragglers, rejections, suspects, accuracy on
    both test sets with their sizes."""
    header = [
        *("round", "seconds", "quorum", "accepted", "stragglers", "rejected", "suspects"),
        *("accuracy", "test images", "field accuracy", "field images", "labels"),
    ]
    rows = [
        [
            round_name(r),
            f"{r['seconds']:.1f}",
            r["quorum"],
            r["accepted"],
            ", ".join(r["stragglers"]) or "-",
            "; ".join(f"{x['device_id']}: {x['reason']}" for x in r["rejections"]) or "-",
            ", ".join(sorted(r["suspects"])) or "-",
            number(r["accuracy"]),
            r["test_images"] if r["test_images"] is not None else "-",
            number(r["field_accuracy"]) if r["field_images"] else "-",
            r["field_images"],
            r["labels"],
        ]
        for r in rounds
    ]
    return ["<h2>Round timeline</h2>", image(charts.timeline_chart(rounds), "round timeline"), table(header, rows)]


def serving_section(serving: dict) -> list[str]:
    """The serving-version history: each decision on a round (the gate's or a person's), what served after it,
    and why."""
    rows = [
        [
            event["round"],
            event["decision"].replace("_", " "),
            "W0" if event["serving"] == 0 else f"round {event['serving']}",
            event["who"],
            event["reason"],
            time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(event["at"])),
        ]
        for event in serving["history"]
    ]
    headers = ["round", "decision", "serving after it", "by", "why", "when"]
    lead = f"<p>Serving now: {html.escape(serving['summary'])}.</p>"
    return ["<h2>Serving version</h2>", lead, table(headers, rows) if rows else "<p>No decision yet: W0 serves.</p>"]


def labelling_section(run_dir: Path) -> list[str]:
    """The run's labelling queue, when it kept one: open queries, answers by person today, and the corrections of
    answers already sent (and how many wait for their devices)."""
    if not (run_dir / QUEUE_FOLDER / DATABASE).is_file():
        return []
    queue = LabelQueue(run_dir, ())
    try:
        status = queue.status(time.time())
    finally:
        queue.close()
    open_queries = sum(count for count, _ in status.open_by_device.values())
    rows = [[person, count, status.answers_last_hour.get(person, 0)] for person, count in status.answers_today.items()]
    lead = (
        f"<p>{open_queries} open queries; {status.corrections} corrections of answers already sent "
        f"({status.corrections_undelivered} not yet stored by their devices); {status.held} answers held for an "
        "undo.</p>"
    )
    people = table(["person", "answers today", "in the last hour"], rows) if rows else "<p>No answer today.</p>"
    return ["<h2>Labelling</h2>", lead, people]


def page(title: str, parts: list[str]) -> str:
    """The HTML document around the report's parts, with its style inline."""
    return (
        f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>'
        f"<style>{STYLE}</style></head><body>\n" + "\n".join(parts) + "\n</body></html>\n"
    )


def write_report(run_dir: Path, out: Path | None = None) -> Path:
    """Writes the run's report (RUN_DIR/report.html unless `out` says otherwise) atomically; returns its path."""
    if not (Path(run_dir) / "run.sqlite").is_file():
        raise UsageError(f"{run_dir} holds no run (no run.sqlite)")
    path = out or Path(run_dir) / REPORT_NAME
    run_dir = Path(run_dir)
    page = report_html(load_snapshot(run_dir), sweep_section(run_dir.resolve()), labelling_section(run_dir))
    atomic_write_bytes(path, page.encode())
    return path
