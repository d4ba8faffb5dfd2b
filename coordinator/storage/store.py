# Run state in SQLite (rounds, per-device records, strategy state, rejections, config) plus model checkpoints and the update spool.
from __future__ import annotations

import dataclasses
import json
import sqlite3
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from coordinator.storage.checkpoints import Checkpoints
from coordinator.storage.database import Database
from coordinator.storage.prediction_counts import PredictionTable
from coordinator.storage.serving_history import ServingHistory
from coordinator.storage.spool import Spool, check_device_id, check_round_id
from protocol.errors import UsageError
from protocol.files import load_arrays, save_arrays
from protocol.model_spec import DEFAULT_SPEC, ModelSpec, spec_from_dict
from protocol.tensors import Weights

# A secure round's record keeps no device's update; its metrics carry these instead.
SECURE_LABELS = "secagg_labels"  # the new labels of the round's survivors, known only as their sum
SECURE_WEIGHT = "secagg_weight"  # the survivors' summed weight (see protocol.secagg.weighting.device_weight)
AGGREGATE_CHANGE = "aggregate_divergence"  # divergence's stand-in: ||W_base - W_new|| / ||W_base|| per layer


@dataclass(frozen=True)
class RoundRecord:
    """One committed round: its timing, the new global model's hash, accuracy, counts and the strategy's report."""

    round_id: int
    started_at: float
    closed_at: float
    model_hash: str
    accuracy: float | None
    labels: int
    accepted: int
    rejected: int
    report: dict
    metrics: dict


@dataclass(frozen=True)
class DeviceRoundRecord:
    """One device's update in a committed round: accepted or why not, its counts, metrics and divergence."""

    round_id: int
    device_id: str
    accepted: bool
    reason: str
    num_samples: int
    class_counts: list[int]
    local_accuracy: float | None
    divergence: dict[str, float]
    update_bytes: int
    received_at: float
    acquired_labels: int = 0


@dataclass(frozen=True)
class StrategyState:
    """A stateful strategy's state after a round (e.g. CADIS's similarity sums), tagged with the strategy's name."""

    strategy: str
    state: dict
    tensors: Weights = field(default_factory=dict)


def _optional_float(value: float | None) -> float | None:
    """value as a Python float, keeping None (SQLite cannot bind numpy scalars)."""
    return None if value is None else float(value)


def _to_json(value: Any, what: str) -> str:
    """JSON text for a record field; a value JSON cannot hold is a ValueError naming the field."""
    try:
        return json.dumps(value, sort_keys=True)
    # json raises ValueError for a circular value: the caller's record, named in the error
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{what} is not JSON-serialisable: {exc}") from exc


def _round_row(record: RoundRecord) -> tuple:
    """A RoundRecord as a rounds-table row, with numpy scalars made plain and dicts as JSON."""
    return (
        int(record.round_id),
        float(record.started_at),
        float(record.closed_at),
        str(record.model_hash),
        _optional_float(record.accuracy),
        int(record.labels),
        int(record.accepted),
        int(record.rejected),
        _to_json(record.report, f"round {record.round_id} report"),
        _to_json(record.metrics, f"round {record.round_id} metrics"),
    )


def _device_row(record: DeviceRoundRecord) -> tuple:
    """A DeviceRoundRecord as a device_rounds-table row, with numpy scalars made plain and lists/dicts as JSON."""
    divergence = {str(layer): float(value) for layer, value in record.divergence.items()}
    return (
        int(record.round_id),
        record.device_id,
        int(bool(record.accepted)),
        str(record.reason),
        int(record.num_samples),
        json.dumps([int(c) for c in record.class_counts]),
        _optional_float(record.local_accuracy),
        json.dumps(divergence, sort_keys=True),
        int(record.update_bytes),
        float(record.received_at),
        int(record.acquired_labels),
    )


def _round_from_row(r: tuple) -> RoundRecord:
    """A rounds-table row as a RoundRecord."""
    return RoundRecord(r[0], r[1], r[2], r[3], r[4], r[5], r[6], r[7], json.loads(r[8]), json.loads(r[9]))


def _device_from_row(r: tuple) -> DeviceRoundRecord:
    """A device_rounds-table row as a DeviceRoundRecord."""
    return DeviceRoundRecord(
        r[0], r[1], bool(r[2]), r[3], r[4], json.loads(r[5]), r[6], json.loads(r[7]), r[8], r[9], r[10]
    )


def commit_statements(
    record: RoundRecord, devices: Sequence[DeviceRoundRecord], strategy_state: StrategyState | None
) -> list[tuple[str, tuple]]:
    """The inserts that commit one round: its row, one row per device record, the strategy's state if any."""
    round_id = check_round_id(record.round_id)
    for device in devices:
        check_device_id(device.device_id)
        if device.round_id != round_id:
            raise ValueError(f"device {device.device_id} record is for round {device.round_id}, not {round_id}")
    placeholders = ", ".join("?" * len(dataclasses.fields(DeviceRoundRecord)))
    statements = [("INSERT INTO rounds VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)", _round_row(record))]
    statements += [(f"INSERT INTO device_rounds VALUES ({placeholders})", _device_row(d)) for d in devices]
    if strategy_state is not None:
        body = _to_json(strategy_state.state, f"round {round_id} strategy state")
        statements.append(("INSERT INTO strategy_state VALUES (?, ?, ?)", (round_id, strategy_state.strategy, body)))
    return statements


class RunStore:
    """A run's durable state in run_dir: run.sqlite (WAL), checkpoints/ and spool/, so a restart resumes."""

    def __init__(self, run_dir: Path | str, read_only: bool = False, keep_updates: bool = False) -> None:
        """Opens (creating if missing) the run directory, its database schema and the checkpoint folder.

        read_only opens an existing run's database for reading beside the process that writes it (dashboard,
        report): nothing is created, and a missing database is a FileNotFoundError. keep_updates keeps every
        round's spooled updates after it commits (by default they are deleted then).
        """
        self.run_dir = Path(run_dir)
        self.keep_updates = keep_updates
        self.spool = Spool(self.run_dir / "spool")
        if not read_only:
            (self.run_dir / "checkpoints").mkdir(parents=True, exist_ok=True)
        self.database = Database(self.run_dir / "run.sqlite", read_only)
        self.checkpoints = Checkpoints(self.run_dir / "checkpoints", self.database)
        self.serving = ServingHistory(self.database)
        self.predictions = PredictionTable(self.database)

    def __enter__(self) -> RunStore:
        """The store itself; closed on leaving the with-block."""
        return self

    def __exit__(self, *exc_info: object) -> None:
        """Closes the database connection."""
        self.close()

    def close(self) -> None:
        """Closes the database connection and the spool's segments."""
        self.spool.close()
        self.database.close()

    def set_config(self, config: dict) -> None:
        """Stores the run's configuration (JSON), replacing any earlier one."""
        body = _to_json(config, "run config")
        self.database.write([("INSERT OR REPLACE INTO config (id, body) VALUES (1, ?)", (body,))])

    def config(self) -> dict | None:
        """The stored run configuration, or None before set_config."""
        rows = self.database.read("SELECT body FROM config WHERE id = 1")
        return json.loads(rows[0][0]) if rows else None

    def commit_round(
        self,
        record: RoundRecord,
        devices: Sequence[DeviceRoundRecord],
        strategy_state: StrategyState | None = None,
    ) -> None:
        """Records a closed round, its per-device records and the strategy's state after it in one transaction;
        a round commits only once. Then the spool of this and earlier rounds goes, unless keep_updates."""
        round_id = check_round_id(record.round_id)
        statements = commit_statements(record, devices, strategy_state)
        if strategy_state is not None and strategy_state.tensors:
            save_arrays(self.checkpoints.strategy_tensors_path(round_id), strategy_state.tensors)
        try:
            self.database.write(statements)
        except sqlite3.IntegrityError as exc:
            if self.database.read("SELECT 1 FROM rounds WHERE round_id = ?", (round_id,)):
                raise ValueError(f"round {round_id} is already committed") from exc
            raise ValueError(f"round {round_id} records conflict (a device listed twice?): {exc}") from exc
        self.spool.seal_through(round_id)
        if not self.keep_updates:
            self.spool.discard_through(round_id)

    def latest_strategy_state(self) -> StrategyState | None:
        """The strategy state committed with the latest round that has one (with its tensors, if it saved any)."""
        rows = self.database.read("SELECT round_id, strategy, body FROM strategy_state ORDER BY round_id DESC LIMIT 1")
        return self._strategy_state_from(rows)

    def strategy_state(self, round_id: int) -> StrategyState | None:
        """The strategy state committed with one round (with its tensors, if it saved any); None if it has none."""
        rows = self.database.read("SELECT round_id, strategy, body FROM strategy_state WHERE round_id = ?", (round_id,))
        return self._strategy_state_from(rows)

    def _strategy_state_from(self, rows: list[tuple]) -> StrategyState | None:
        """The StrategyState of the first of `rows` (round_id, strategy, body), its tensors loaded; None for none."""
        if not rows:
            return None
        round_id, strategy, body = rows[0]
        tensors_path = self.checkpoints.strategy_tensors_path(round_id)
        tensors = load_arrays(tensors_path) if tensors_path.exists() else {}
        return StrategyState(strategy, json.loads(body), tensors)

    def last_committed_round(self) -> int | None:
        """The highest committed round id, or None if none is committed yet."""
        return self.database.read("SELECT MAX(round_id) FROM rounds")[0][0]

    def rounds(self) -> list[RoundRecord]:
        """Every committed round, in round order."""
        return [_round_from_row(row) for row in self.database.read("SELECT * FROM rounds ORDER BY round_id")]

    def device_rounds(self, round_id: int | None = None) -> list[DeviceRoundRecord]:
        """Per-device records of one committed round (or of all), ordered by round then device id."""
        where, params = ("WHERE round_id = ?", (round_id,)) if round_id is not None else ("", ())
        rows = self.database.read(f"SELECT * FROM device_rounds {where} ORDER BY round_id, device_id", params)
        return [_device_from_row(row) for row in rows]

    def record_rejection(self, round_id: int, device_id: str, reason: str, update_bytes: int, kind: str = "") -> None:
        """Counts a rejected update (its reason and kind) at once, so the tally survives if its round never commits."""
        insert = "INSERT INTO rejections (round_id, device_id, reason, update_bytes, recorded_at, kind) VALUES (?, ?, ?, ?, ?, ?)"
        row = (check_round_id(round_id), str(device_id)[:128], str(reason), int(update_bytes), time.time(), str(kind))
        self.database.write([(insert, row)])

    def first_round_of_nonce(self, device_id: str, nonce: bytes, round_id: int) -> int:
        """The round in which a device's nonce was first seen, recording round_id if it is new: a nonce outlives
        a coordinator restart, so a replay after one is still refused."""
        insert = "INSERT OR IGNORE INTO nonces (device_id, nonce, round_id) VALUES (?, ?, ?)"
        self.database.write([(insert, (str(device_id), bytes(nonce), check_round_id(round_id)))])
        query = "SELECT round_id FROM nonces WHERE device_id = ? AND nonce = ?"
        return int(self.database.read(query, (str(device_id), bytes(nonce)))[0][0])

    def revision(self) -> tuple:
        """Changes whenever the config is set, a round commits, a rejection or a serving decision is recorded:
        readers that cache what they read compare it instead of re-reading every record."""
        serving = "(SELECT MAX(id) FROM serving)" if self.serving.present() else "NULL"
        return self.database.read(
            "SELECT (SELECT body FROM config WHERE id = 1), (SELECT MAX(round_id) FROM rounds), "
            f"(SELECT MAX(id) FROM rejections), {serving}"
        )[0]

    def rejections(self) -> list[tuple[int, str, str, int, float]]:
        """Every rejected update as (round id, device id, reason, bytes, recorded at), in the order they came."""
        return self.database.read(
            "SELECT round_id, device_id, reason, update_bytes, recorded_at FROM rejections ORDER BY id"
        )

    def rejection_kinds(self) -> dict[str, int]:
        """How many updates were rejected for each kind, over the whole run."""
        return dict(self.database.read("SELECT kind, COUNT(*) FROM rejections GROUP BY kind ORDER BY kind"))

    def rejection_counts(self) -> dict[str, int]:
        """How many updates were rejected for each reason, over the whole run."""
        return dict(self.database.read("SELECT reason, COUNT(*) FROM rejections GROUP BY reason ORDER BY reason"))


def existing_run(run_dir: Path) -> RunStore:
    """The store of a run directory a person named (its schema brought up to date); a UsageError in one line when
    the folder holds no run."""
    if not (Path(run_dir) / "run.sqlite").is_file():
        raise UsageError(f"{run_dir} is not a run directory (no run.sqlite)")
    return RunStore(run_dir)


def stored_spec(config: dict | None) -> ModelSpec:
    """The model spec a run directory's stored settings name (runs from before specs: the default)."""
    raw = (config or {}).get("settings", {}).get("spec", dataclasses.asdict(DEFAULT_SPEC))
    return spec_from_dict(raw, "the run's stored model spec")
