# The run's model checkpoints: one npz per round in checkpoints/, each hash recorded in the run's database.
from __future__ import annotations

import time
from pathlib import Path

from coordinator.storage.database import Database
from coordinator.storage.spool import check_round_id, round_name
from protocol.files import load_arrays, save_arrays
from protocol.tensors import Weights, weights_hash


class Checkpoints:
    """The global model after every round (and W0 as round 0), written atomically and verified on reading."""

    def __init__(self, folder: Path, database: Database) -> None:
        """Checkpoints live in `folder`; their hashes in the database's checkpoints table."""
        self.folder = folder
        self.database = database

    def path(self, round_id: int) -> Path:
        """Where the global model after round_id is stored, e.g. checkpoints/round_0003.npz."""
        return self.folder / f"{round_name(round_id)}.npz"

    def strategy_tensors_path(self, round_id: int) -> Path:
        """Where the strategy's per-parameter state after round_id lives (written before the round commits, so
        the committed round always has its file), e.g. checkpoints/strategy_round_0003.npz."""
        return self.folder / f"strategy_{round_name(round_id)}.npz"

    def save(self, round_id: int, weights: Weights) -> str:
        """Writes the model after round_id atomically and records its hash; returns that hash.

        Re-saving an uncommitted round replaces it; a committed round's checkpoint may only be re-saved unchanged.
        """
        round_id = check_round_id(round_id)
        path = self.path(round_id)
        model_hash = weights_hash(weights)
        committed = self.database.read(
            "SELECT model_hash FROM checkpoints WHERE round_id = ? AND round_id IN (SELECT round_id FROM rounds)",
            (round_id,),
        )
        if committed and committed[0][0] != model_hash:
            raise ValueError(f"round {round_id} is committed; its checkpoint {path} cannot be replaced")
        save_arrays(path, weights)
        insert = "INSERT OR REPLACE INTO checkpoints (round_id, model_hash, file_name, saved_at) VALUES (?, ?, ?, ?)"
        self.database.write([(insert, (round_id, model_hash, path.name, time.time()))])
        return model_hash

    def load(self, round_id: int) -> Weights:
        """The model saved for round_id, verified against the hash recorded at save time."""
        round_id = check_round_id(round_id)
        path = self.path(round_id)
        rows = self.database.read("SELECT model_hash FROM checkpoints WHERE round_id = ?", (round_id,))
        if not rows:
            raise FileNotFoundError(f"no checkpoint recorded for round {round_id} in {self.folder.parent}")
        weights = load_arrays(path)
        actual = weights_hash(weights)
        if actual != rows[0][0]:
            raise ValueError(f"{path}: checkpoint hash {actual[:16]} differs from the recorded {rows[0][0][:16]}")
        return weights

    def latest_round(self) -> int | None:
        """The highest round with a recorded checkpoint, or None."""
        return self.database.read("SELECT MAX(round_id) FROM checkpoints")[0][0]
