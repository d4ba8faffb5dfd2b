# What a person reads of a camera-fleet run: one line a round and a closing table, from the store and agents' logs.
from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from coordinator.storage.serving_history import GATE
from coordinator.storage.store import RunStore
from edge_agent.data.predictions_log import PREDICTIONS_FOLDER, PredictionLog

FOOTPRINT = "footprint round="


@dataclass(frozen=True)
class RoundRow:
    """One committed round of a camera run: every label its model learnt from (the server's W0 samples included)
    and each device's share, the test accuracy, how long it took, the device whose accepted update arrived last
    and that device's peak RSS so far, the promotion gate's decision on the round (promoted, held) and the version
    serving after it (a round id, 0: W0), and the centralised probe's accuracy on the same labels (once fitted)."""

    round_id: int
    labels: int
    device_labels: dict[str, int]
    accuracy: float | None
    seconds: float
    slowest_device: str | None
    slowest_rss_mb: float | None
    gate: str | None = None
    serving: int | None = None
    probe_accuracy: float | None = None


def footprint_peaks(log_file: Path) -> dict[int, float]:
    """A field agent's peak RSS (MB, /proc VmHWM) after each round, from its `footprint round=N` log lines: the
    highest phase peak it reported for round N (its phases keep their highest peak over the run)."""
    peaks: dict[int, float] = {}
    for line in log_file.read_text(errors="replace").splitlines():
        if FOOTPRINT not in line:
            continue
        round_id, fields = line.split(FOOTPRINT, 1)[1].split(" peak_rss_mb ", 1)
        peaks[int(round_id)] = max(float(item.split("=", 1)[1]) for item in fields.split())
    return peaks


def logged_predictions(state_dir: Path) -> list[dict[str, Any]]:
    """Every line of a field agent's predictions log (STATE_DIR/predictions), oldest first."""
    segments = PredictionLog(state_dir / PREDICTIONS_FOLDER, 1).segments()
    return [json.loads(line) for path in segments for line in path.read_text().splitlines()]


def round_rows(run_dir: Path, agent_logs: Mapping[str, Path]) -> list[RoundRow]:
    """Every committed round of the run in `run_dir`, with each device's human labels so far (its last accepted
    update's count) and the slowest device's peak RSS from its log in `agent_logs` (device id -> log file)."""
    with RunStore(run_dir, read_only=True) as store:
        rounds = store.rounds()
        accepted = [record for record in store.device_rounds() if record.accepted]
        gate = {event.round_id: event for event in store.serving.events() if event.who == GATE}
    peaks = {device: footprint_peaks(log) for device, log in agent_logs.items() if log.is_file()}
    rows, held = [], dict.fromkeys(agent_logs, 0)
    for record in rounds:
        updates = [update for update in accepted if update.round_id == record.round_id]
        held.update({update.device_id: update.acquired_labels for update in updates})
        slowest = max(updates, key=lambda update: update.received_at, default=None)
        device = None if slowest is None else slowest.device_id
        rss = peaks.get(device, {}).get(record.round_id) if device is not None else None
        seconds = round(record.closed_at - record.started_at, 1)
        decided = gate.get(record.round_id)
        rows.append(
            RoundRow(
                *(record.round_id, record.labels, dict(held), record.accuracy, seconds, device, rss),
                *((None, None) if decided is None else (decided.decision, decided.serving)),
            )
        )
    return rows


def _number(value: float | None, form: str, missing: str = "-") -> str:
    """A number in `form`, or `missing` where there is none."""
    return missing if value is None else format(value, form)


def round_line(row: Mapping[str, Any], total_rounds: int) -> str:
    """The line a person reads for one round (a RoundRow as a dict, as the run's JSON holds it)."""
    asked = sum(row["device_labels"].values())
    slowest = row["slowest_device"] or "-"
    return (
        f"round {row['round_id']:>2}/{total_rounds}  labels {row['labels']:>4} "
        f"(server {row['labels'] - asked} + devices {asked})  accuracy {_number(row['accuracy'], '.4f')}  "
        f"probe {_number(row['probe_accuracy'], '.4f')}  slowest {slowest} "
        f"peak {_number(row['slowest_rss_mb'], '.0f')} MB  {row['seconds']:.1f}s{_gate(row)}"
    )


def _gate(row: Mapping[str, Any]) -> str:
    """The round's promotion decision and the version serving after it, as the round line ends ('' undecided)."""
    if row.get("gate") is None:
        return ""
    return f"  {row['gate']}, serving {version_name(row['serving'])}"


def version_name(version: int) -> str:
    """A serving version as a person reads it: W0 or round N."""
    return "W0" if version == 0 else f"round {version}"


def table(headers: Sequence[str], rows: Sequence[Sequence[str]], text_columns: int = 0) -> str:
    """Columns as wide as their widest cell, two spaces apart, under a header line: the first `text_columns`
    aligned left, the numbers after them right."""
    widths = [max(len(cell) for cell in column) for column in zip(headers, *rows)]

    def line(cells: Sequence[str]) -> str:
        aligned = [
            cell.ljust(w) if i < text_columns else cell.rjust(w) for i, (cell, w) in enumerate(zip(cells, widths))
        ]
        return "  ".join(aligned).rstrip()

    return "\n".join(line(cells) for cells in [headers, *rows])


SUMMARY_HEADERS = ("backbone", "sampler", "seed", "rounds", "labels", "final", "probe", "gap", "peak MB", "seconds")


def summary_row(run: Mapping[str, Any]) -> list[str]:
    """One run's cells of the summary table: its final accuracy against the probe's on the same labels, the highest
    peak RSS of any of its devices, its wall time."""
    final = run["accuracy"][-1] if run["accuracy"] else None
    probe = run.get("probe_accuracy")
    gap = None if final is None or probe is None else final - probe
    return [
        run["backbone"],
        run["sampler"],
        str(run["seed"]),
        str(len(run["accuracy"])),
        str(run["labels"][-1] if run["labels"] else 0),
        _number(final, ".4f"),
        _number(probe, ".4f"),
        _number(gap, "+.4f"),
        _number(max(run["device_peak_rss_mb"], default=None), ".0f"),
        f"{run['seconds']:.1f}",
    ]


def serving_lines(run: Mapping[str, Any]) -> list[str]:
    """What a run's fleet serves: the serving version, each device's predictions (its log's lines), and with
    central labelling the answers given on the fleet's page and the predictions the coordinator was sent."""
    if "serving_version" not in run:
        return []
    name = f"({run['backbone']}, {run['sampler']}, seed {run['seed']})"
    counts = ", ".join(f"{device} {count}" for device, count in run["predictions"].items())
    lines = [f"serving {name}: {version_name(run['serving_version'])}; predictions per device: {counts}"]
    if "page_answers" in run:
        published = ", ".join(f"{device} {count}" for device, count in run["predictions_published"].items())
        lines.append(f"labelling page {name}: {run['page_answers']} answers; predictions published: {published}")
    return lines


def summary(runs: Sequence[Mapping[str, Any]], results_file: Path) -> str:
    """The closing table of every run, each run's HTML report and where the JSON of the whole sweep went."""
    reports = [f"report ({run['backbone']}, {run['sampler']}, seed {run['seed']}): {run['report']}" for run in runs]
    return "\n".join(
        [
            "",
            table(SUMMARY_HEADERS, [summary_row(run) for run in runs], text_columns=2),
            "",
            *(line for run in runs for line in serving_lines(run)),
            *reports,
            f"results: {results_file}",
        ]
    )
