# The dashboard's and the report's data: a run's store (read-only) plus the live state, as plain JSON-able dicts.
from __future__ import annotations

import math
import threading
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from coordinator.dashboard.live import LiveState
from coordinator.labelling.queue_records import QueueStatus
from coordinator.rounds.closing import DEVICE_EPSILON, FIELD_ACCURACY, FIELD_IMAGES, TEST_IMAGES
from coordinator.storage.serving_history import HELD, ServingEvent, serving_stack
from coordinator.storage.store import AGGREGATE_CHANGE, DeviceRoundRecord, RoundRecord, RunStore, stored_spec
from coordinator.strategies.method_kinds import method_kinds
from coordinator.strategies.pooled_head import pool_refinement
from protocol.model_spec import spec_hash
from protocol.supervision import Health

T = TypeVar("T")
Rejection = tuple[int, str, str, int, float]  # round id, device id, reason, bytes, recorded at


@dataclass(frozen=True)
class RunSnapshot:
    """Everything committed so far in a run's store, read in one go (empty before the store exists)."""

    config: dict = field(default_factory=dict)
    rounds: list[RoundRecord] = field(default_factory=list)
    device_rounds: list[DeviceRoundRecord] = field(default_factory=list)
    rejections: list[Rejection] = field(default_factory=list)
    serving: list[ServingEvent] = field(default_factory=list)


def snapshot_of(store: RunStore) -> RunSnapshot:
    """Everything committed in the store."""
    return RunSnapshot(
        store.config() or {}, store.rounds(), store.device_rounds(), store.rejections(), store.serving.events()
    )


def load_snapshot(run_dir: Path) -> RunSnapshot:
    """Reads the run's store through its own read-only connection; an empty snapshot if there is no store yet."""
    try:
        store = RunStore(run_dir, read_only=True)
    except FileNotFoundError:
        return RunSnapshot()
    with store:
        return snapshot_of(store)


class SnapshotCache:
    """The run's latest snapshot, re-read only when the store's revision changes (a round commits, a rejection is
    recorded), so a dashboard polling every second costs one small query per request between rounds."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self._lock = threading.Lock()
        self._revision: tuple | None = None
        self._snapshot = RunSnapshot()

    def get(self) -> RunSnapshot:
        """The current snapshot, through a fresh read-only connection of this request's own."""
        try:
            store = RunStore(self.run_dir, read_only=True)
        except FileNotFoundError:
            return RunSnapshot()
        with store, self._lock:
            revision = store.revision()
            if revision != self._revision:
                self._snapshot, self._revision = snapshot_of(store), revision
            return self._snapshot


def json_safe(value: Any) -> Any:
    """value with every NaN or infinity replaced by None (JSON has neither; a zero layer's divergence is inf)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: json_safe(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(item) for item in value]
    return value


def class_names(snapshot: RunSnapshot) -> list[str]:
    """The run's class names, from the model spec in its stored settings."""
    return list(stored_spec(snapshot.config).class_names)


def model_view(snapshot: RunSnapshot) -> dict:
    """The run's model spec as the dashboard shows it: architecture, input shape, class names, spec hash."""
    spec = stored_spec(snapshot.config)
    return {
        "architecture": spec.architecture,
        "input_shape": list(spec.input_shape),
        "class_names": list(spec.class_names),
        "spec_hash": spec_hash(spec),
    }


def run_view(snapshot: RunSnapshot, live: LiveState | None) -> dict:
    """The run's identity and progress: id, fleet, strategy, rounds done and planned, the current round and phase."""
    settings = snapshot.config.get("settings", {})
    last = snapshot.rounds[-1].round_id if snapshot.rounds else 0
    progress = live.progress() if live else {}
    total = progress.get("total_rounds") or settings.get("policy", {}).get("rounds")
    recipe = settings.get("recipe", {})
    options = {**recipe.get("options", {}), **settings.get("strategy_options", {})}
    return {
        "run_id": snapshot.config.get("run_id"),
        "fleet": settings.get("fleet"),
        "model": model_view(snapshot),
        "strategy": settings.get("strategy"),
        "recipe": recipe,
        "methods": recipe_view(
            recipe.get("sampler", ""), recipe.get("local_rule", ""), settings.get("strategy", ""), options
        ),
        "total_rounds": total,
        "rounds_completed": len(snapshot.rounds),
        "last_committed_round": last,
        "round": progress.get("round", last),
        "phase": progress.get("phase", "finished" if total and last >= total else "stored"),
        "needed": progress.get("needed"),
        "round_opened_at": progress.get("round_opened_at"),
        "devices_online": live.online_count() if live else None,
        "privacy": privacy_view(snapshot),
        "secure": secure_view(snapshot),
        "serving": serving_view(snapshot),
    }


SERVING_HISTORY = 50  # the serving decisions the run view lists, the latest last


def serving_view(snapshot: RunSnapshot) -> dict:
    """The serving version (the model devices predict with) apart from the latest round's model: which round
    serves (0: W0) and since when, the latest round the gate held and why, the recent decisions, and a one-line
    summary."""
    events = snapshot.serving
    version = serving_stack(events)[-1]
    since = next(
        (event.recorded_at for event in reversed(events) if event.serving == version and event.decision != HELD), None
    )
    held = next((event for event in reversed(events) if event.decision == HELD), None)
    summary = "W0" if version == 0 else f"round {version}"
    if held is not None:
        summary += f"; round {held.round_id} not promoted: {held.reason}"
    return {
        "version": version,
        "since": since,
        "held": None if held is None else {"round": held.round_id, "reason": held.reason},
        "history": [serving_event_view(event) for event in events[-SERVING_HISTORY:]],
        "summary": summary,
    }


def serving_event_view(event: ServingEvent) -> dict:
    """One serving decision as the dashboard and the report show it."""
    return {
        "round": event.round_id,
        "decision": event.decision,
        "serving": event.serving,
        "reason": event.reason,
        "who": event.who,
        "at": event.recorded_at,
    }


def secure_view(snapshot: RunSnapshot) -> dict:
    """The run's secure aggregation: its mode, where divergence comes from (each device's update, or under secure
    aggregation only the aggregate's per-layer change), the last round's outcome, and a one-line summary."""
    mode = snapshot.config.get("settings", {}).get("recipe", {}).get("secure_aggregation", "off")
    last: dict = next((r.metrics for r in reversed(snapshot.rounds) if "secure_aggregation" in r.metrics), {})
    source = "devices" if mode == "off" else "aggregate"
    summary = "off"
    if mode != "off":
        summary = f"{mode}: per-device divergence off, divergence is the aggregate's per-layer change"
        if last:
            summary += f"; last round {last['secure_aggregation']} ({last.get('secagg_survivors', 0)} survivors)"
    return {"mode": mode, "divergence_source": source, "last_round": last.get("secure_aggregation"), "summary": summary}


def dp_sgd_epsilons(rounds: list[RoundRecord]) -> dict[str, float]:
    """Each DP-SGD device's example-level epsilon as its latest accepted update reported it (empty without DP-SGD)."""
    latest: dict[str, float] = {}
    for record in rounds:
        latest.update(record.metrics.get(DEVICE_EPSILON, {}))
    return latest


def privacy_view(snapshot: RunSnapshot) -> dict:
    """The run's differential privacy: its placement, the epsilon spent by the committed rounds at the run's delta,
    the budget, the last round's clip and noise multiplier, the DP-SGD devices' own example-level epsilons, and a
    one-line summary ("off" for a run with neither)."""
    settings = snapshot.config.get("settings", {})
    placement = settings.get("recipe", {}).get("dp", "off")
    dp = {"delta": 1e-5, "epsilon_budget": None, **settings.get("dp", {})}
    last: dict = next((record.report["dp"] for record in reversed(snapshot.rounds) if "dp" in record.report), {})
    epsilon = last.get("epsilon", 0.0) if placement != "off" else None
    budget = dp["epsilon_budget"]
    devices = dp_sgd_epsilons(snapshot.rounds)
    parts = [] if epsilon is None else [f"{placement}: epsilon {epsilon:.3g} at delta {dp['delta']:g}"]
    if epsilon is not None and budget is not None:
        parts[0] += f" of {budget:g}"
    if devices:
        parts.append(f"DP-SGD on {len(devices)} devices: example-level epsilon up to {max(devices.values()):.3g}")
    return {
        "placement": placement,
        "epsilon": epsilon,
        "delta": dp["delta"],
        "epsilon_budget": budget,
        "clip": last.get("clip"),
        "noise_multiplier": last.get("noise_multiplier"),
        "dp_sgd_epsilons": devices,
        "summary": "; ".join(parts) or "off",
    }


def grouped(items: Iterable[T], key: Callable[[T], Any]) -> dict[Any, list[T]]:
    """items in lists by key, each list in the items' order (one pass, so views stay linear in the run's size)."""
    groups: dict[Any, list[T]] = defaultdict(list)
    for item in items:
        groups[key(item)].append(item)
    return groups


def last_answer_from_store(accepted: list[DeviceRoundRecord], rejections: list[Rejection]) -> dict | None:
    """A device's last update as the store knows it: its latest accepted record or rejection, whichever is newer."""
    candidates = [
        {"round_id": r.round_id, "size": r.update_bytes, "accepted": True, "reason": "", "answered_at": r.received_at}
        for r in accepted
    ] + [
        {"round_id": round_id, "size": size, "accepted": False, "reason": reason, "answered_at": at}
        for round_id, _, reason, size, at in rejections
    ]
    return max(candidates, key=lambda answer: float(answer["answered_at"]), default=None)  # type: ignore[arg-type]


def devices_view(snapshot: RunSnapshot, live: LiveState | None, queue: QueueStatus | None = None) -> list[dict]:
    """One row per device: presence, last seen, profile, rounds joined, labelled count and class histogram of its
    latest accepted update, its latest local accuracy, its last update's size and ack, its predictions (per
    hour, class mix, uncertain share, drift; None when it has published none to this coordinator), and its open
    queries in the fleet's labelling queue with the oldest one's age (None without a queue)."""
    present = live.devices() if live else {}
    waiting = {} if queue is None else queue.open_by_device
    accepted_by_device = grouped((r for r in snapshot.device_rounds if r.accepted), lambda r: r.device_id)
    rejections_by_device = grouped(snapshot.rejections, lambda rejection: rejection[1])
    rows = []
    for device in sorted(set(accepted_by_device) | set(rejections_by_device) | set(present) | set(waiting)):
        records = accepted_by_device.get(device, [])
        latest = records[-1] if records else None
        presence = present.get(device, {})
        rows.append(
            {
                "device_id": device,
                "state": presence.get("state", "unknown"),
                "online": presence.get("state", "offline") not in ("offline", "unknown"),
                "last_seen": presence.get("last_seen") or (latest.received_at if latest else None),
                "profile": presence.get("profile", ""),
                "peak_rss_mb": presence.get("peak_rss_mb") or None,
                "part_restarts": presence.get("part_restarts", 0),
                "set_aside": presence.get("set_aside", 0),
                "rounds_joined": len(records),
                "labelled": presence.get("labelled") or (latest.num_samples if latest else 0),
                "acquired_labels": latest.acquired_labels if latest else 0,
                "class_counts": latest.class_counts if latest else [],
                "local_accuracy": latest.local_accuracy if latest else None,
                "last_update": presence.get("last_update")
                or last_answer_from_store(records, rejections_by_device.get(device, [])),
                "predictions": presence.get("predictions"),
                "label_queue": None if queue is None else label_queue_view(*waiting.get(device, (0, 0.0))),
            }
        )
    return rows


def label_queue_view(open_queries: int, oldest_age: float) -> dict:
    """A device's share of the labelling queue: its open queries and the oldest one's age (None when none is open)."""
    return {"open": open_queries, "oldest_age_seconds": round(oldest_age, 1) if open_queries else None}


def labelling_view(queue: QueueStatus | None) -> dict | None:
    """The fleet's labelling queue at a glance: open queries in all, each person's answers in the last hour and
    today (most today first), and the corrections made; None when the coordinator keeps no queue."""
    if queue is None:
        return None
    names = set(queue.answers_today) | set(queue.answers_last_hour)
    people = sorted(names, key=lambda name: (-queue.answers_today.get(name, 0), name))
    return {
        "open": sum(count for count, _ in queue.open_by_device.values()),
        "people": [
            {
                "person": person,
                "answers_last_hour": queue.answers_last_hour.get(person, 0),
                "answers_today": queue.answers_today.get(person, 0),
            }
            for person in people
        ],
        "corrections": queue.corrections,
    }


def health_view(health: Health) -> dict:
    """The supervised parts at a glance: each part's state, restarts and last failure, and the messages set aside
    by sender (the dashboard shows a part that is down or restarted, and who sent what the parts set aside)."""
    parts, set_aside = health.snapshot()
    return {
        "parts": [
            {"part": p.name, "up": p.up, "restarts": p.restarts, "last_error": p.last_error, "failed_at": p.failed_at}
            for p in sorted(parts, key=lambda part: part.name)
        ],
        "set_aside": [
            {"part": part, "sender": sender, "messages": count} for (part, sender), count in sorted(set_aside.items())
        ],
    }


def rounds_view(snapshot: RunSnapshot) -> list[dict]:
    """One row per committed round: timing, accuracy (on the server's test images, and on the field set, each with
    its size), labels, quorum, stragglers, rejections, suspects, the weight the pools refined a pooled head with
    (None: not refined), each device's local accuracy and the promotion gate's decision on it."""
    devices_by_round = grouped(snapshot.device_rounds, lambda r: r.round_id)
    rejections_by_round = grouped(snapshot.rejections, lambda rejection: rejection[0])
    gate = {event.round_id: event for event in snapshot.serving if event.who == "gate"}
    rows = []
    for record in snapshot.rounds:
        devices = devices_by_round.get(record.round_id, [])
        rows.append(
            {
                "round": record.round_id,
                "started_at": record.started_at,
                "closed_at": record.closed_at,
                "seconds": record.closed_at - record.started_at,
                "accuracy": record.accuracy,
                "test_images": record.metrics.get(TEST_IMAGES),
                "field_accuracy": record.metrics.get(FIELD_ACCURACY),
                "field_images": record.metrics.get(FIELD_IMAGES, 0),
                "labels": record.labels,
                "accepted": record.accepted,
                "rejected": record.rejected,
                "quorum": record.metrics.get("quorum"),
                "stragglers": record.metrics.get("stragglers", []),
                "rejections": [
                    {"device_id": device, "reason": reason}
                    for _, device, reason, *_ in rejections_by_round.get(record.round_id, [])
                ],
                "suspects": record.report.get("suspects", {}),
                "excluded": record.report.get("excluded", []),
                "pool_weight": pool_refinement(record.report),
                "aggregation_seconds": record.report.get("aggregation_seconds"),
                "dp": record.report.get("dp"),
                "device_accuracy": {r.device_id: r.local_accuracy for r in devices if r.local_accuracy is not None},
                "serving": serving_event_view(gate[record.round_id]) if record.round_id in gate else None,
            }
        )
    return rows


def find_round(snapshot: RunSnapshot, round_id: int) -> RoundRecord | None:
    """The committed round with that id, or None."""
    return next((record for record in snapshot.rounds if record.round_id == round_id), None)


def divergence_view(snapshot: RunSnapshot, round_id: int) -> dict | None:
    """The round's per-layer divergence matrix (one row per device, one column per layer; a secure round's one row
    is the aggregate's change from the round's model) and its suspects, or None if the round is not committed."""
    record = find_round(snapshot, round_id)
    if record is None:
        return None
    rows = {r.device_id: r.divergence for r in snapshot.device_rounds if r.round_id == round_id and r.divergence}
    if AGGREGATE_CHANGE in record.metrics:
        rows["aggregate"] = record.metrics[AGGREGATE_CHANGE]
    layers = sorted({layer for divergence in rows.values() for layer in divergence})
    return {
        "round": round_id,
        "layers": layers,
        "devices": list(rows),
        "values": [[divergence.get(layer) for layer in layers] for divergence in rows.values()],
        "suspects": record.report.get("suspects", {}),
    }


def class_accuracy_view(snapshot: RunSnapshot, round_id: int) -> dict | None:
    """The round's per-class test accuracy of the aggregate and of each device model (Figure 11), or None if the
    round is not committed."""
    record = find_round(snapshot, round_id)
    if record is None:
        return None
    aggregate = record.metrics.get("class_accuracy", [])
    return {
        "round": round_id,
        "classes": class_names(snapshot)[: len(aggregate)],
        "aggregate": aggregate,
        "devices": record.metrics.get("device_class_accuracy", {}),
    }


def recipe_view(sampler: str, local_rule: str, strategy: str, options: dict[str, float]) -> list[dict[str, Any]]:
    """Each chosen method with its options (value, default, help): what the dashboard's recipe view shows."""
    chosen = {"sampler": sampler, "local rule": local_rule, "strategy": strategy}
    view: list[dict[str, Any]] = []
    for kind in method_kinds():
        name = chosen[kind.label]
        if name not in kind.registry:
            view.append({"kind": kind.label, "method": name, "summary": "", "options": []})
            continue
        method = kind.registry.get(name)
        declared = method.options
        view.append(
            {
                "kind": kind.label,
                "method": name,
                "summary": method.summary,
                "options": [
                    {"flag": o.cli_flag, "value": options.get(o.key, o.default), "default": o.default, "help": o.help}
                    for o in declared
                ],
            }
        )
    return view
