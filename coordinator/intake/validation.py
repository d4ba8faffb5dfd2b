# Checks every incoming update before it may touch the aggregate: schema, round, base model, tensors, values.
from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import numpy as np

from protocol import messages, wire
from protocol.errors import RefusalError
from protocol.messages import RejectionKind
from protocol.tensors import LayoutError, Weights, WeightSpec, check_layout
from protocol.update_codec import CodecError, Encoded, decode_update

METRIC_TOLERANCE = 1e-4
MAX_CONTRIBUTORS = 100_000


MAX_REASON_CHARS = 300


def capped(text: str, limit: int = MAX_REASON_CHARS) -> str:
    """The text cut to `limit` characters (with a marker), so no stored reason grows with the input."""
    marker = " ... [truncated]"
    return text if len(text) <= limit else text[: limit - len(marker)] + marker


class Rejection(RefusalError):
    """An update that must not be aggregated: its kind (a stable label for acks, the store and metrics) and the
    reason the device is told on its ack topic, capped at MAX_REASON_CHARS."""

    def __init__(self, kind: RejectionKind, reason: str) -> None:
        self.kind = kind
        self.reason = capped(reason)
        super().__init__(self.reason)


@dataclass(frozen=True)
class Expectation:
    """What a valid update for the current round looks like: `spec` is the layout of the tensors the model spec
    trains (the trained set, all an update carries), `base` those tensors of the round's model, which delta-encoded
    updates are decoded against. `min_samples` and `max_samples` bound one device's claimed sample count (a relay's
    bound is max_samples per contributor; None: no bound). `relays`: the devices whose updates may name
    contributors."""

    round_id: int
    base_hash: str
    spec: WeightSpec
    num_classes: int
    max_bytes: int
    authenticate: Callable[[messages.Update, bytes, int], None] | None = None
    required_metrics: Mapping[str, tuple[float, float]] = field(default_factory=dict)
    base: Weights = field(default_factory=dict)
    min_samples: int = 0
    max_samples: int | None = None
    relays: tuple[str, ...] = ()

    def for_model(self, round_id: int, model_hash: str, model: Weights) -> Expectation:
        """This expectation for another round's model (asynchronous versions): its hash, and its tensors of the
        trained set (the layout's names) to decode deltas against."""
        base = {name: model[name] for name in self.spec}
        return dataclasses.replace(self, round_id=round_id, base_hash=model_hash, base=base)


@dataclass(frozen=True)
class Incoming:
    """An update message decoded once: the device whose topic it came on, the payload as it came (spooled, and
    hashed to tell a redelivery from other content), the update and the bytes its signature covers (b"" unsigned).
    Everything after the decode (validation, the rejection ack, the aggregator, the spool) works from this."""

    device_id: str
    payload: bytes
    update: messages.Update
    signed: bytes = b""


def validate_update(device_id: str, payload: bytes, expected: Expectation) -> messages.Update:
    """The decoded update if it is valid for this round and device; Rejection with a specific reason otherwise."""
    return validated(decoded(device_id, payload, expected), expected)


def validated(incoming: Incoming, expected: Expectation) -> messages.Update:
    """A decoded update, its tensors as float32 weights, if it is valid for this round and its device; Rejection
    with a specific reason otherwise."""
    update = check_sender(incoming)
    if expected.authenticate is not None:
        expected.authenticate(update, incoming.signed, expected.round_id)
    check_round(update, expected)
    update = with_weights(update, expected.base)
    check_tensors(update, expected)
    check_counts(update, expected.num_classes)
    check_contributions(update, expected.relays)
    check_sample_claim(update, expected)
    check_required_metrics(update.metrics, expected.required_metrics)
    return update


def check_sender(incoming: Incoming) -> messages.Update:
    """The update, unless it names another device than the topic it came on (a Rejection)."""
    update = incoming.update
    if update.device_id != incoming.device_id:
        raise Rejection(
            RejectionKind.DEVICE_MISMATCH,
            f"device id {update.device_id!r} does not match the topic's {incoming.device_id!r}",
        )
    return update


def decoded(device_id: str, payload: bytes, expected: Expectation) -> Incoming:
    """The payload decoded (the one decode of an update) within the size limit."""
    if len(payload) > expected.max_bytes:
        raise Rejection(
            RejectionKind.TOO_LARGE, f"too large: {len(payload)} bytes exceeds the limit of {expected.max_bytes}"
        )
    try:
        update, signed = wire.decode_update(payload, max_bytes=expected.max_bytes)
    except wire.WireError as error:
        raise Rejection(RejectionKind.UNDECODABLE, f"undecodable: {error}") from None
    return Incoming(device_id, payload, update, signed)


def check_round(update: messages.Update, expected: Expectation) -> None:
    """Rejection unless the update is for this round and was trained from this round's base model."""
    if update.round_id != expected.round_id:
        stale = update.round_id < expected.round_id
        raise Rejection(
            RejectionKind.STALE_ROUND if stale else RejectionKind.FUTURE_ROUND,
            f"{'stale' if stale else 'future'} round: update is for round {update.round_id}, "
            f"the current round is {expected.round_id}",
        )
    if update.base_hash != expected.base_hash:
        raise Rejection(
            RejectionKind.BASE_MISMATCH,
            f"base model mismatch: update trained from {update.base_hash[:12]}, "
            f"round {expected.round_id} announced {expected.base_hash[:12]}",
        )


def with_weights(update: messages.Update, base: Weights) -> messages.Update:
    """The update as float32 weights: a delta-encoded one decoded against the base model of its round; a
    malformed encoding (a scale that is NaN, infinite, zero or negative, bad sparse indices) is a Rejection."""
    try:
        weights = decode_update(Encoded.of(update), base)
    except CodecError as error:
        raise Rejection(error.kind, f"encoded update: {error}") from None
    return dataclasses.replace(update, tensors=weights, encoding="float32", scales={}, indices={})


def check_tensors(update: messages.Update, expected: Expectation) -> None:
    """Rejection unless the tensors are exactly the trained set (a frozen tensor is refused, never ignored), in the
    model's layout, with only finite values."""
    try:
        check_layout(expected.spec, update.tensors)
    except LayoutError as error:
        reason = f"tensor mismatch: an update carries the {len(expected.spec)} tensors the spec trains: {error}"
        raise Rejection(RejectionKind.TENSOR_MISMATCH, reason) from None
    for name, array in update.tensors.items():
        if not np.all(np.isfinite(array)):
            raise Rejection(RejectionKind.NON_FINITE, f"non-finite values in tensor {name!r}")


def check_counts(update: messages.Update, num_classes: int) -> None:
    """Rejection unless sample, label and class counts are non-negative and consistent."""
    if update.num_samples < 0:
        raise Rejection(RejectionKind.BAD_COUNTS, f"negative sample count {update.num_samples}")
    if not 0 <= update.acquired_labels <= update.num_samples:
        raise Rejection(
            RejectionKind.BAD_COUNTS,
            f"acquired_labels {update.acquired_labels} must lie in [0, num_samples={update.num_samples}]",
        )
    if len(update.class_counts) != num_classes or min(update.class_counts, default=0) < 0:
        raise Rejection(RejectionKind.BAD_COUNTS, f"class_counts must be {num_classes} non-negative integers")


def check_contributions(update: messages.Update, relays: tuple[str, ...]) -> None:
    """Rejection unless a relay's contributions (none for a device) are distinct device ids, each with a non-negative
    sample count, that add up to the update's num_samples: a relay may not weigh more than its devices reported, and
    only a device named as a relay may name contributors (each lifts its share cap, see ClientUpdate.devices)."""
    names, counts = update.contributors, update.contributor_samples
    if (names or counts) and update.device_id not in relays:
        raise Rejection(
            RejectionKind.NOT_RELAY,
            f"{wire.shown(update.device_id)} names {len(names)} contributors but is no relay of this fleet "
            "(fl-coordinator run --relay names them)",
        )
    if len(names) != len(counts):
        raise Rejection(
            RejectionKind.BAD_COUNTS, f"{len(names)} contributors but {len(counts)} contributor sample counts"
        )
    if len(names) > MAX_CONTRIBUTORS:
        raise Rejection(RejectionKind.BAD_COUNTS, f"{len(names)} contributors, more than {MAX_CONTRIBUTORS}")
    invalid = [name for name in names if not wire.IDENTIFIER.fullmatch(name)]
    repeated = sorted(name for name, times in Counter(names).items() if times > 1)
    if invalid or repeated:
        shown = wire.shown_names(invalid or repeated)
        raise Rejection(RejectionKind.BAD_COUNTS, f"contributors must be distinct device ids: {shown}")
    if min(counts, default=0) < 0:
        raise Rejection(RejectionKind.BAD_COUNTS, "contributor sample counts must be non-negative")
    reported = sum(counts)
    if names and reported != update.num_samples:
        raise Rejection(
            RejectionKind.BAD_COUNTS,
            f"claims {update.num_samples} samples, but its {len(names)} contributors reported {reported}",
        )


def contributing_devices(update: messages.Update) -> int:
    """How many devices' data an update sums: a relay's contributors, else the one device that sent it."""
    return max(1, len(update.contributors))


def check_sample_claim(update: messages.Update, expected: Expectation) -> None:
    """Rejection when the claimed sample count lies outside what a device (or a relay's devices together) can hold:
    a strategy that weighs by samples takes no zero-sample update, nor a claim above the schedule's bound."""
    if update.num_samples < expected.min_samples:
        raise Rejection(
            RejectionKind.BAD_COUNTS,
            f"claims {update.num_samples} samples: the strategy weighs updates by their samples, so it takes at least "
            f"{expected.min_samples}",
        )
    devices = contributing_devices(update)
    if expected.max_samples is not None and update.num_samples > expected.max_samples * devices:
        holders = f"its {devices} devices" if update.contributors else "a device"
        raise Rejection(
            RejectionKind.BAD_COUNTS,
            f"claims {update.num_samples} samples, more than the {expected.max_samples * devices} {holders} can hold "
            f"by round {expected.round_id}",
        )


def check_required_metrics(metrics: Mapping[str, float], required: Mapping[str, tuple[float, float]]) -> None:
    """Rejection unless every metric the strategy needs is present and within its [low, high] bounds (the wire
    refused a non-finite one)."""
    for name, (low, high) in required.items():
        if name not in metrics:
            raise Rejection(RejectionKind.MISSING_METRIC, f"missing metric {name!r}: the strategy weighs updates by it")
        value = metrics[name]
        if not low - METRIC_TOLERANCE <= value <= high + METRIC_TOLERANCE:
            raise Rejection(
                RejectionKind.BAD_METRIC, f"metric {name!r} = {value!r} lies outside [{low:.6g}, {high:.6g}]"
            )
