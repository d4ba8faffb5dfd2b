# Device profiles: a firmware_configs/*.toml file -> a frozen, typed, validated DeviceProfile.
from __future__ import annotations

import dataclasses
import tomllib
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from edge_agent.learning.local_rules import CLASSIFIER_ONLY, FULL_MODEL
from protocol.errors import UsageError

BACKENDS = ("torch", "onnxruntime")
TRAINERS = (FULL_MODEL, CLASSIFIER_ONLY)
DEFAULT_PREDICTIONS_LOG_MB = 64


class ProfileError(UsageError):
    """A profile file is unreadable or invalid; the message names the file, the key and what was expected."""


@dataclass(frozen=True)
class MqttProfile:
    """The device's MQTT session settings; TLS paths are absent for a plain-TCP (bench) broker."""

    keepalive: int
    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None


@dataclass(frozen=True)
class DeviceProfile:
    """How hard a device class may work and where it keeps things: the settings of one firmware_configs file."""

    name: str
    backend: str
    threads: int
    inference_batch: int
    mc_passes_cap: int
    execution_providers: tuple[str, ...]
    memory_budget_mb: int
    pool_size_cap: int
    storage_path: str
    mqtt: MqttProfile
    trainer: str = "full"
    predictions_log_mb: int = DEFAULT_PREDICTIONS_LOG_MB  # the predictions log's bound on disk (rotated segments)


def _type_name(expected: Any) -> str:
    """A readable name for a field type, e.g. 'integer', 'list of strings', 'string or absent'."""
    names = {int: "integer", str: "string", float: "number"}
    if typing.get_origin(expected) is tuple:
        return f"list of {names[typing.get_args(expected)[0]]}s"
    if typing.get_origin(expected) in (typing.Union, types.UnionType):
        return f"{_type_name(typing.get_args(expected)[0])} or absent"
    if dataclasses.is_dataclass(expected):
        return "table"
    return names[expected]


def _convert(value: Any, expected: Any, where: str) -> Any:
    """value checked against a field type (bool is not an integer; lists become tuples; tables become dataclasses)."""
    origin = typing.get_origin(expected)
    if origin in (typing.Union, types.UnionType):
        return _convert(value, typing.get_args(expected)[0], where)
    if origin is tuple:
        item = typing.get_args(expected)[0]
        if isinstance(value, list) and all(isinstance(entry, item) for entry in value):
            return tuple(value)
    elif dataclasses.is_dataclass(expected):
        if isinstance(value, dict):
            return _build(typing.cast(type, expected), value, where)
    elif isinstance(value, expected) and not isinstance(value, bool):
        return value
    raise ProfileError(f"{where}: expected {_type_name(expected)}, got {type(value).__name__} {value!r}")


def _build(cls: type, table: dict[str, Any], where: str) -> Any:
    """A dataclass from a TOML table: no unknown keys, every required key present, every value of its type."""
    hints = typing.get_type_hints(cls)
    fields = {field.name: field for field in dataclasses.fields(cls)}
    for key in table:
        if key not in fields:
            raise ProfileError(f"{where}: unknown key {key!r}; known keys: {', '.join(fields)}")
    values = {}
    for name, field in fields.items():
        if name in table:
            values[name] = _convert(table[name], hints[name], f"{where}: key {name!r}")
        elif field.default is dataclasses.MISSING:
            raise ProfileError(f"{where}: missing key {name!r} (expected {_type_name(hints[name])})")
    return cls(**values)


def _check_values(profile: DeviceProfile, where: str) -> None:
    """Ranges and choices the types alone do not express."""
    if profile.backend not in BACKENDS:
        raise ProfileError(f"{where}: key 'backend': expected one of {', '.join(BACKENDS)}, got {profile.backend!r}")
    for key in (
        "threads",
        "inference_batch",
        "mc_passes_cap",
        "memory_budget_mb",
        "pool_size_cap",
        "predictions_log_mb",
    ):
        if getattr(profile, key) < 1:
            raise ProfileError(f"{where}: key {key!r}: expected a positive integer, got {getattr(profile, key)}")
    if profile.trainer not in TRAINERS:
        raise ProfileError(f"{where}: key 'trainer': expected one of {', '.join(TRAINERS)}, got {profile.trainer!r}")
    if profile.trainer == "head" and profile.backend != "onnxruntime":
        raise ProfileError(
            f"{where}: key 'trainer': 'head' scores and trains with onnxruntime; set backend = 'onnxruntime'"
        )
    if not profile.execution_providers:
        raise ProfileError(f"{where}: key 'execution_providers': expected at least one provider")
    if profile.mqtt.keepalive < 5:
        raise ProfileError(f"{where}: key 'mqtt.keepalive': expected at least 5 seconds, got {profile.mqtt.keepalive}")


def load_profile(path: Path | str) -> DeviceProfile:
    """Reads and validates a device profile; any problem is a ProfileError naming the file and key."""
    path = Path(path)
    if not path.is_file():
        raise ProfileError(f"{path}: device profile not found")
    try:
        table = tomllib.loads(path.read_text())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ProfileError(f"{path}: not valid TOML ({exc})") from exc
    profile = _build(DeviceProfile, table, str(path))
    _check_values(profile, str(path))
    return profile
