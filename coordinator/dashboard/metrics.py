# The coordinator's counters and gauges in the Prometheus text exposition format (version 0.0.4).
from __future__ import annotations

from collections.abc import Sequence

from coordinator.dashboard.live import Counters
from coordinator.labelling.queue_records import QueueStatus
from protocol.http_edge import EdgeHealth
from protocol.supervision import Health

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


def device_prediction_samples(predictions: dict[str, dict]) -> dict[str, list[tuple[str, float]]]:
    """Per device, the samples of each predictions gauge: the last hour's count, the uncertain share (where any),
    the drift flag and, per class, the predicted class mix."""
    samples: dict[str, list[tuple[str, float]]] = {"per_hour": [], "uncertain": [], "drift": [], "mix": []}
    for device, summary in predictions.items():
        label = f'device="{escape_label(device)}"'
        samples["per_hour"].append((f"{{{label}}}", summary["per_hour"]))
        if summary["uncertain_share"] is not None:
            samples["uncertain"].append((f"{{{label}}}", float(summary["uncertain_share"])))
        samples["drift"].append((f"{{{label}}}", int(summary["drift"])))
        for name, fraction in summary["class_mix"].items():
            samples["mix"].append((f'{{{label},class="{escape_label(name)}"}}', float(fraction)))
    return samples


def prediction_metrics(counters: Counters, predictions: dict[str, dict]) -> list[str]:
    """The predictions' families: totals, and per device the last hour's count, the uncertain share, the drift flag
    and the predicted class mix (over the hours the coordinator keeps)."""
    per_device = device_prediction_samples(predictions)
    return (
        metric(
            "fl_predictions_received_total",
            "counter",
            "Predictions received from devices.",
            [("", counters.predictions_received)],
        )
        + metric(
            "fl_prediction_batches_refused_total",
            "counter",
            "Prediction batches refused (undecodable, inconsistent, another device's).",
            [("", counters.predictions_refused)],
        )
        + metric(
            "fl_device_predictions_last_hour", "gauge", "A device's predictions this hour.", per_device["per_hour"]
        )
        + metric(
            "fl_device_uncertain_share",
            "gauge",
            "A device's share of uncertain predictions (normalised entropy above 0.5) over the last 24 hours.",
            per_device["uncertain"],
        )
        + metric(
            "fl_device_prediction_drift",
            "gauge",
            "1 when a device's uncertain share this hour jumped 0.2 above its share in the hours before.",
            per_device["drift"],
        )
        + metric("fl_device_predicted_class_share", "gauge", "A device's predicted class mix.", per_device["mix"])
    )


def labelling_metrics(status: QueueStatus, refused: dict[tuple[str, str], int]) -> list[str]:
    """The labelling queue's families: per device its open queries and the oldest one's age, per person the answers
    given in the last hour, the corrections made (and those waiting for their devices), and the desk's refusals by
    sender and kind."""
    devices = [(f'{{device="{escape_label(device)}"}}', value) for device, value in status.open_by_device.items()]
    people = [(f'{{person="{escape_label(person)}"}}', count) for person, count in status.answers_last_hour.items()]
    refusals = [
        (f'{{device="{escape_label(device)}",kind="{escape_label(kind)}"}}', count)
        for (device, kind), count in sorted(refused.items())
    ]
    return (
        metric(
            "fl_labelling_open_queries",
            "gauge",
            "Open queries of a device in the fleet's labelling queue.",
            [(label, count) for label, (count, _) in devices],
        )
        + metric(
            "fl_labelling_oldest_open_seconds",
            "gauge",
            "Seconds since the queue received a device's oldest open query.",
            [(label, float(age)) for label, (_, age) in devices],
        )
        + metric("fl_labelling_answers_last_hour", "gauge", "Answers a person gave in the last hour.", people)
        + metric(
            "fl_labelling_corrections_total", "counter", "Corrections of sent answers.", [("", status.corrections)]
        )
        + metric(
            "fl_labelling_corrections_undelivered",
            "gauge",
            "Corrections their devices have not confirmed storing yet.",
            [("", status.corrections_undelivered)],
        )
        + metric("fl_labelling_refused_total", "counter", "Messages the labelling desk refused, by sender.", refusals)
    )


def health_metrics(health: Health, devices: dict[str, tuple[int, int]]) -> list[str]:
    """The supervised parts' families: whether each is up, how often it restarted, and the messages each set aside
    after failing to handle them, by sender; and what devices report of their own parts (restarts, set aside),
    for the devices whose parts restarted or set a message aside."""
    parts, set_aside = health.snapshot()
    troubled = sorted((device, counts) for device, counts in devices.items() if any(counts))
    return (
        metric("fl_part_up", "gauge", "1 while a supervised part runs, 0 while it restarts.", _by_part(parts, "up"))
        + metric(
            "fl_part_restarts_total",
            "counter",
            "Times a supervised part failed and restarted.",
            _by_part(parts, "restarts"),
        )
        + metric(
            "fl_messages_set_aside_total",
            "counter",
            "Messages a part set aside after its handler failed on them three times, by sender.",
            [
                (f'{{part="{escape_label(part)}",sender="{escape_label(sender)}"}}', count)
                for (part, sender), count in sorted(set_aside.items())
            ],
        )
        + metric(
            "fl_device_part_restarts",
            "gauge",
            "Times a device's supervised parts restarted, as its status last said.",
            [(f'{{device="{escape_label(device)}"}}', restarts) for device, (restarts, _) in troubled],
        )
        + metric(
            "fl_device_messages_set_aside",
            "gauge",
            "Messages a device's parts set aside, as its status last said.",
            [(f'{{device="{escape_label(device)}"}}', aside) for device, (_, aside) in troubled],
        )
    )


def page_metrics(pages: dict[str, EdgeHealth]) -> list[str]:
    """The HTTP edges' families, by server: open connections, connections refused at the bounds, and requests cut
    off by their deadlines (what an idle-connection flood or a slow client shows as)."""
    by_server = sorted(pages.items())
    return (
        metric(
            "fl_http_open_connections",
            "gauge",
            "Connections a page server holds open.",
            [(f'{{server="{escape_label(name)}"}}', edge.open_connections) for name, edge in by_server],
        )
        + metric(
            "fl_http_connections_refused_total",
            "counter",
            "Connections a page server refused at its bounds (503, no thread).",
            [(f'{{server="{escape_label(name)}"}}', edge.refused_connections) for name, edge in by_server],
        )
        + metric(
            "fl_http_requests_timed_out_total",
            "counter",
            "Requests a page server cut off at their read timeout or deadline.",
            [(f'{{server="{escape_label(name)}"}}', edge.timed_out_requests) for name, edge in by_server],
        )
    )


def _by_part(parts: Sequence, attribute: str) -> list[tuple[str, float]]:
    """One sample per part of one of its health's attributes."""
    return [(f'{{part="{escape_label(part.name)}"}}', int(getattr(part, attribute))) for part in parts]


def render_metrics(
    counters: Counters,
    devices_online: int,
    current_round: int,
    *,
    serving_version: int = 0,
    predictions: dict[str, dict] | None = None,
    labelling: QueueStatus | None = None,
    labelling_refused: dict[tuple[str, str], int] | None = None,
    health: Health | None = None,
    device_health: dict[str, tuple[int, int]] | None = None,
    pages: dict[str, EdgeHealth] | None = None,
) -> str:
    """The /metrics body: the rounds' metrics, the devices' predictions once any came in (a fleet whose serving
    message does not ask for them has none), the labelling queue when the coordinator keeps one, the supervised
    parts' health, and the DP spend."""
    lines = round_metrics(counters, devices_online, current_round, serving_version)
    if counters.predictions_received or counters.predictions_refused:
        lines += prediction_metrics(counters, predictions or {})
    if labelling is not None:
        lines += labelling_metrics(labelling, labelling_refused or {})
    if health is not None:
        lines += health_metrics(health, device_health or {})
    if pages:
        lines += page_metrics(pages)
    if counters.dp_epsilon is not None:
        lines += metric(
            "fl_dp_epsilon_spent",
            "gauge",
            "Differential privacy: the epsilon the committed rounds spent, at the run's delta.",
            [("", counters.dp_epsilon)],
        )
    return "\n".join(lines) + "\n"


def round_metrics(counters: Counters, devices_online: int, current_round: int, serving_version: int) -> list[str]:
    """Rounds, updates by outcome (rejections by reason), devices online, aggregation time, bytes received and the
    serving version."""
    rejected = [
        (f'{{reason="{escape_label(kind)}"}}', count) for kind, count in sorted(counters.rejected_by_kind.items())
    ]
    return (
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
