# Devices' prediction counts in the run's SQLite: each device's hours (count, uncertain, classes) and its totals.
from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass

from coordinator.storage.database import Database


@dataclass(frozen=True)
class StoredHour:
    """One device's predictions in one hour (`hour`: Unix seconds // 3600, by the coordinator's clock): how many, how
    many uncertain, and how many of each class name."""

    device_id: str
    hour: int
    predictions: int
    uncertain: int
    classes: dict[str, int]


@dataclass(frozen=True)
class StoredDevice:
    """One device's predictions over the run and the serving version its last batch named."""

    device_id: str
    total: int
    serving_version: int


class PredictionTable:
    """The `prediction_hours` and `prediction_devices` tables of a run's store: what the coordinator counted of its
    devices' predictions, so a restart shows the same hour. Written by one coordinator in batches (`save`)."""

    def __init__(self, database: Database) -> None:
        self.database = database

    def hours(self, since_hour: int) -> list[StoredHour]:
        """Every device's hours from `since_hour` on, by device then hour."""
        rows = self.database.read(
            "SELECT device_id, hour, predictions, uncertain, classes FROM prediction_hours WHERE hour >= ? "
            "ORDER BY device_id, hour",
            (int(since_hour),),
        )
        return [
            StoredHour(device, hour, count, uncertain, json.loads(classes))
            for device, hour, count, uncertain, classes in rows
        ]

    def devices(self) -> list[StoredDevice]:
        """Every device's totals, by device."""
        rows = self.database.read("SELECT device_id, total, serving_version FROM prediction_devices ORDER BY device_id")
        return [StoredDevice(*row) for row in rows]

    def save(self, hours: Sequence[StoredHour], devices: Sequence[StoredDevice], before_hour: int) -> None:
        """Writes the hours and devices given (each replacing its stored row) and deletes the hours before
        `before_hour`, in one transaction."""
        statements: list[tuple[str, tuple]] = [
            (
                "INSERT OR REPLACE INTO prediction_hours VALUES (?, ?, ?, ?, ?)",
                (row.device_id, int(row.hour), int(row.predictions), int(row.uncertain), json.dumps(row.classes)),
            )
            for row in hours
        ]
        statements += [
            (
                "INSERT OR REPLACE INTO prediction_devices VALUES (?, ?, ?)",
                (row.device_id, int(row.total), int(row.serving_version)),
            )
            for row in devices
        ]
        statements.append(("DELETE FROM prediction_hours WHERE hour < ?", (int(before_hour),)))
        self.database.write(statements)
