# The coordinator's counters and gauges in the Prometheus text exposition format (version 0.0.4).
from __future__ import annotations

from collections.abc import Sequence

from coordinator.dashboard.live import Counters

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def escape_label(value: str) -> str:
    """A label value with backslash, double quote and newline escaped as the format requires."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def metric(name: str, kind: str, help_text: str, samples: Sequence[tuple[str, float]]) -> list[str]:
    """One metric family: its HELP and TYPE lines, then one line per (suffix, value) sample, where the suffix
    follows the name: a label set like {reason="x"}, a summary's _sum or _count, or nothing."""
    return [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"] + [
        f"{name}{suffix} {float(value)!r}" if isinstance(value, float) else f"{name}{suffix} {int(value)}"
        for suffix, value in samples
    ]


def render_metrics(counters: Counters, devices_online: int, current_round: int, serving_version: int = 0) -> str:
    """The /metrics body: rounds, updates by outcome (rejections by reason), devices online, aggregation, bytes,
    the serving version."""
    rejected = [
        (f'{{reason="{escape_label(kind)}"}}', count) for kind, count in sorted(counters.rejected_by_kind.items())
    ]
    lines = (
        metric(
            "fl_rounds_completed_total",
            "counter",
            "Rounds aggregated and committed by this coordinator process.",
            [("", counters.rounds_completed)],
        )
        + metric("fl_current_round", "gauge", "The round being collected (0 before the first).", [("", current_round)])
        + metric(
            "fl_serving_version",
            "gauge",
            "The round whose model devices predict with (0: the initial model W0).",
            [("", serving_version)],
        )
        + metric("fl_updates_accepted_total", "counter", "Device updates accepted.", [("", counters.updates_accepted)])
        + metric("fl_updates_rejected_total", "counter", "Device updates rejected, by the kind of reason.", rejected)
        + metric("fl_devices_online", "gauge", "Devices whose last status is not offline.", [("", devices_online)])
        + metric(
            "fl_aggregation_seconds",
            "summary",
            "Seconds spent aggregating a round.",
            [("_sum", float(counters.aggregation_seconds_sum)), ("_count", counters.aggregations)],
        )
        + metric(
            "fl_update_bytes_received_total",
            "counter",
            "Bytes of device updates received (accepted or not).",
            [("", counters.bytes_received)],
        )
    )
    if counters.dp_epsilon is not None:
        lines += metric(
            "fl_dp_epsilon_spent",
            "gauge",
            "Differential privacy: the epsilon the committed rounds spent, at the run's delta.",
            [("", counters.dp_epsilon)],
        )
    return "\n".join(lines) + "\n"
