# The agent's small key/value journal: JSON in one file, every change written atomically before it is adopted.
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from protocol.files import atomic_write_bytes


class Journal:
    """A persisted JSON object of the agent's progress (last finished round, queried batches, ...)."""

    def __init__(self, path: Path) -> None:
        """Opens the journal at path: empty if the file is absent, a ValueError if it is not a JSON object."""
        self.path = path
        self._state: dict[str, Any] = {}
        if not path.is_file():
            return
        try:
            state = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ValueError(f"{path}: corrupt state file ({str(exc)[:200]})") from exc
        if not isinstance(state, dict):
            raise ValueError(f"{path}: state file must hold a JSON object")
        self._state = state

    def get(self, key: str, default: Any = None) -> Any:
        """A value from the journal, or default."""
        return self._state.get(key, default)

    def set(self, key: str, value: Any) -> None:
        """Stores a JSON-able value under key and persists the whole journal atomically."""
        if not isinstance(key, str):
            raise ValueError(f"state keys must be strings, got {key!r}")
        updated = {**self._state, key: value}
        try:
            encoded = json.dumps(updated, allow_nan=False, sort_keys=True).encode()
        # json raises ValueError for NaN (allow_nan=False) or a circular value: the caller's, named
        except (TypeError, ValueError) as exc:
            raise ValueError(f"state value for {key!r} is not JSON-serialisable: {exc}") from exc
        atomic_write_bytes(self.path, encoded)
        self._state = json.loads(encoded)
