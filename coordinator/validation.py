# Checks every incoming update before it may touch the aggregate: schema, round, base model, tensors, values.
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from edge_agent import wire
from edge_agent.models import WeightSpec, check_weights_match


class Rejection(Exception):
    """An update that must not be aggregated; `reason` is what the device is told on its ack topic."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True)
class Expectation:
    """What a valid update for the current round looks like."""

    round_id: int
    base_hash: str
    spec: WeightSpec
    num_classes: int
    max_bytes: int


def validate_update(device_id: str, payload: bytes, expected: Expectation) -> wire.Update:
    """The decoded update if it is valid for this round and device; Rejection with a specific reason otherwise."""
    if len(payload) > expected.max_bytes:
        raise Rejection(f"too large: {len(payload)} bytes exceeds the limit of {expected.max_bytes}")
    try:
        update = wire.decode(payload, wire.Update, max_bytes=expected.max_bytes)
    except wire.WireError as error:
        raise Rejection(f"undecodable: {error}") from None
    if update.device_id != device_id:
        raise Rejection(f"device id {update.device_id!r} does not match the topic's {device_id!r}")
    if update.round_id != expected.round_id:
        when = "stale" if update.round_id < expected.round_id else "future"
        raise Rejection(f"{when} round: update is for round {update.round_id}, the current round is {expected.round_id}")
    if update.base_hash != expected.base_hash:
        raise Rejection(f"base model mismatch: update trained from {update.base_hash[:12]}, "
                        f"round {expected.round_id} announced {expected.base_hash[:12]}")
    try:
        check_weights_match(expected.spec, update.tensors)
    except ValueError as error:
        raise Rejection(f"tensor mismatch: {error}") from None
    for name, array in update.tensors.items():
        if not np.all(np.isfinite(array)):
            raise Rejection(f"non-finite values in tensor {name!r}")
    if update.num_samples < 0:
        raise Rejection(f"negative sample count {update.num_samples}")
    if not 0 <= update.acquired_labels <= update.num_samples:
        raise Rejection(f"acquired_labels {update.acquired_labels} must lie in [0, num_samples={update.num_samples}]")
    if len(update.class_counts) != expected.num_classes or min(update.class_counts, default=0) < 0:
        raise Rejection(f"class_counts must be {expected.num_classes} non-negative integers")
    return update
