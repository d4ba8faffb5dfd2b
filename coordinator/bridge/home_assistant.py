# Home Assistant's view of a fleet's cameras, pure: HA-safe ids, topics, discovery configs, JSON states, availability.
from __future__ import annotations

import datetime
import hashlib
import json
import re
from dataclasses import dataclass
from typing import Any

from protocol import messages, topics
from protocol.bounds import TIME_RANGE
from protocol.prediction_messages import UNCERTAIN, PredictionBatch
from protocol.release import VERSION

DEFAULT_DISCOVERY_PREFIX = topics.HA_DISCOVERY_PREFIX
ONLINE = "online"
OFFLINE = "offline"  # a device's state in its last will, and what its availability then says
MANUFACTURER = "edge-fal"
ORIGIN = "edge-fal ha-bridge"
DEFAULT_MODEL = "edge-agent"  # a camera whose status names no profile
NOT_HA_ID = re.compile(r"[^A-Za-z0-9_-]")  # HA's node and object ids are [a-zA-Z0-9_-] only
STATE_CHARACTERS = 255  # Home Assistant refuses a longer state
ID_CHARACTERS = 64  # the longest id kept as it is (a topic level holds at most 64)
TEXT_CHARACTERS = 1024  # any other text a device put in its messages, as an attribute or a model name


def ha_id(value: str) -> str:
    """`value` as a Home Assistant node or object id (and a topic level): every character outside [a-zA-Z0-9_-]
    becomes '_', and a value that had any (or is longer than 64 characters) is cut to 55 and gets the first 8 hex
    digits of its sha256 after a '-', so 'cam.1' and 'cam_1' stay two ids, as do two long ones."""
    cleaned = NOT_HA_ID.sub("_", value)
    if cleaned == value and len(value) <= ID_CHARACTERS:
        return value
    return f"{cleaned[: ID_CHARACTERS - 9]}-{hashlib.sha256(value.encode()).hexdigest()[:8]}"


def state_level(device_id: str) -> str:
    """The camera's level in its state and availability topics: its device id, or for a relay's site device
    (`relay/device`, not one topic level) its HA id."""
    return device_id if topics.is_identifier(device_id) else ha_id(device_id)


def unique_id(fleet: str, device_id: str) -> str:
    """The camera's sensor id in Home Assistant: the fleet and the device joined by ':', which neither may hold, so two
    cameras never share one."""
    return f"edge-fal:{fleet}:{device_id}"


@dataclass(frozen=True)
class SensorTopics:
    """Where one fleet's cameras appear for Home Assistant: each camera's discovery config under the discovery prefix
    (its node the fleet, its object the device, both HA ids), its JSON state and availability under edge-fal/<fleet>/,
    and the bridge's own availability."""

    fleet: str
    discovery_prefix: str = DEFAULT_DISCOVERY_PREFIX

    def discovery(self, device_id: str) -> str:
        """The retained discovery config's topic of a camera."""
        node = ha_id(f"edge-fal_{self.fleet}")
        return topics.HA_DISCOVERY.build(prefix=self.discovery_prefix, node=node, object=ha_id(device_id))

    def state(self, device_id: str) -> str:
        """The camera's JSON state topic (its latest prediction)."""
        return topics.HA_STATE.build(fleet=self.fleet, device=state_level(device_id))

    def availability(self, device_id: str) -> str:
        """The camera's availability topic ("online" or "offline")."""
        return topics.HA_AVAILABILITY.build(fleet=self.fleet, device=state_level(device_id))

    @property
    def bridge(self) -> str:
        """The bridge's own availability topic (its last will says "offline")."""
        return topics.HA_BRIDGE.build(fleet=self.fleet)


@dataclass(frozen=True)
class Camera:
    """What Home Assistant's device page shows of a device: its id, its profile (the model) and the version of the
    model it serves (the software), once a status or a prediction has told them."""

    device_id: str
    profile: str = ""
    serving_version: int | None = None


def availability_entry(topic: str) -> dict[str, str]:
    """One availability topic of a discovery config, with its two payloads."""
    return {"topic": topic, "payload_available": ONLINE, "payload_not_available": OFFLINE}


def discovery_config(where: SensorTopics, camera: Camera) -> dict[str, Any]:
    """The camera's MQTT discovery config (a `sensor`): its state is the predicted class's name, its attributes the
    whole JSON state; available while both the bridge and the device are; one HA device per camera."""
    device: dict[str, Any] = {
        "identifiers": [unique_id(where.fleet, camera.device_id)],
        "name": camera.device_id,
        "model": camera.profile[:TEXT_CHARACTERS] or DEFAULT_MODEL,
        "manufacturer": MANUFACTURER,
    }
    if camera.serving_version is not None:
        device["sw_version"] = f"serving version {camera.serving_version}"
    state = where.state(camera.device_id)
    return {
        "name": "Prediction",
        "has_entity_name": True,
        "unique_id": unique_id(where.fleet, camera.device_id),
        "icon": "mdi:cctv",
        "state_topic": state,
        "value_template": "{{ value_json.class_name }}",
        "json_attributes_topic": state,
        "availability": [availability_entry(where.bridge), availability_entry(where.availability(camera.device_id))],
        "availability_mode": "all",
        "qos": 1,
        "device": device,
        "origin": {"name": ORIGIN, "sw_version": VERSION},
    }


def prediction_state(batch: PredictionBatch) -> dict[str, Any] | None:
    """The sensor's JSON state: the batch's newest prediction (the latest time; the last row of equal ones) with its
    class, probability, uncertainty (and whether it counts as uncertain), serving version and time, both as Unix
    seconds and, within the wire's time range, as ISO 8601 UTC; None for an empty batch."""
    if not len(batch):
        return None
    row = batch.rows()[max(range(len(batch)), key=lambda index: (batch.times[index], index))]
    seconds = row["time"]
    within = TIME_RANGE[0] <= seconds <= TIME_RANGE[1]
    return {
        "class_name": row["class_name"][:STATE_CHARACTERS],
        "class_index": row["class_index"],
        "probability": row["probability"],
        "uncertainty": row["uncertainty"],
        "uncertain": row["uncertainty"] > UNCERTAIN,
        "serving_version": row["serving_version"],
        "model_hash": row["model_hash"][:TEXT_CHARACTERS],
        "file": row["file"][:TEXT_CHARACTERS],
        "content_hash": row["content_hash"][:TEXT_CHARACTERS],
        "time": seconds,
        "predicted_at": datetime.datetime.fromtimestamp(seconds, datetime.UTC).isoformat() if within else None,
    }


def availability(status: messages.Status | None) -> str:
    """A device's availability from its status: offline when its last will (or any status) says so, or its retained
    status was cleared; online in any other state (idle, training, waiting for answers)."""
    return OFFLINE if status is None or status.state == OFFLINE else ONLINE


def encoded(document: dict[str, Any]) -> bytes:
    """A config or state as the JSON bytes published (keys sorted, so the same content is the same payload)."""
    return json.dumps(document, sort_keys=True).encode()
