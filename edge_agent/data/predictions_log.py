# A device's predictions log: JSON lines in the state folder, in numbered segments, bounded on disk, never fatal.
from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

PREDICTIONS_FOLDER = "predictions"
SEGMENTS = 4  # a segment is a quarter of the bound: rotating drops at most a quarter of what is kept
SEGMENT_NAME = re.compile(r"predictions-(\d{6})\.jsonl")


def segment_path(folder: Path, number: int) -> Path:
    """The path of segment `number` (numbers grow; the newest segment is the one written)."""
    return folder / f"predictions-{number:06d}.jsonl"


def segment_number(path: Path) -> int:
    """The number of a segment's path (one `segments` listed)."""
    return int(path.name[len("predictions-") : -len(".jsonl")])


class PredictionLog:
    """`STATE_DIR/predictions/predictions-NNNNNN.jsonl`: one JSON object a line, appended and synced; a new segment
    starts when the current one would pass max_bytes / SEGMENTS, and the oldest segments are deleted while all of
    them hold more than max_bytes. A write that fails (a full disk, a read-only or missing folder: any OSError)
    loses those lines, not the device: one warning names the folder and the error until a write succeeds again."""

    def __init__(self, folder: Path, max_bytes: int) -> None:
        if max_bytes < 1:
            raise ValueError(f"the predictions log's bound must be positive, got {max_bytes}")
        self.folder, self.max_bytes = Path(folder), max_bytes
        self.segment_bytes = max(1, max_bytes // SEGMENTS)
        self.failing = False
        self.lost = 0

    def segments(self) -> list[Path]:
        """The log's segments, oldest first ([] when the folder is missing or unreadable)."""
        try:
            names = [(SEGMENT_NAME.fullmatch(path.name), path) for path in self.folder.iterdir()]
        except OSError:
            return []
        return [path for match, path in sorted(names, key=lambda pair: pair[1].name) if match]

    def last(self) -> dict[str, Any] | None:
        """The newest complete line, parsed (None when there is none or it cannot be read)."""
        for path in reversed(self.segments()):
            try:
                raw = _tail(path)
            except OSError:
                return None
            lines = raw[: raw.rfind(b"\n") + 1].splitlines()
            if lines:
                try:
                    row = json.loads(lines[-1])
                except (json.JSONDecodeError, UnicodeDecodeError):
                    return None
                return row if isinstance(row, dict) else None
        return None

    def append(self, rows: Sequence[dict[str, Any]]) -> bool:
        """Appends one line per row; False (after the warning, once per failing spell) when they could not be kept."""
        lines = [json.dumps(row, sort_keys=True, separators=(",", ":")).encode() + b"\n" for row in rows]
        try:
            self._write(lines)
        except OSError as error:
            self.lost += len(lines)
            if not self.failing:
                self.failing = True
                log.warning(
                    "predictions log cannot be written folder=%s error=%s: predictions are not kept until it can "
                    "(the device keeps running)",
                    *(self.folder, str(error)[:200]),
                )
            return False
        if self.failing:
            self.failing = False
            log.info("predictions log written again folder=%s lost=%d", self.folder, self.lost)
            self.lost = 0
        return True

    def _write(self, lines: list[bytes]) -> None:
        """Appends the lines across segments, then trims the oldest segments to the bound."""
        self.folder.mkdir(parents=True, exist_ok=True)
        segments = self.segments()
        number = segment_number(segments[-1]) if segments else 1
        path = segment_path(self.folder, number)
        size = _complete(path)
        pending: list[bytes] = []
        for line in lines:
            if size and size + len(line) > self.segment_bytes:
                _append_synced(path, b"".join(pending))
                number, pending, size = number + 1, [], 0
                path = segment_path(self.folder, number)
            pending.append(line)
            size += len(line)
        _append_synced(path, b"".join(pending))
        self._trim()

    def _trim(self) -> None:
        """Deletes the oldest segments while the log holds more than max_bytes (never the newest)."""
        segments = self.segments()
        sizes = [path.stat().st_size for path in segments]
        while len(segments) > 1 and sum(sizes) > self.max_bytes:
            segments.pop(0).unlink()
            sizes.pop(0)


def _complete(path: Path) -> int:
    """The segment's size after cutting off an unfinished last line (a crash mid-append); 0 when it is absent."""
    if not path.is_file():
        return 0
    size = path.stat().st_size
    with open(path, "rb") as handle:
        handle.seek(max(0, size - 1))
        if handle.read(1) in (b"\n", b""):
            return size
        handle.seek(0)
        raw = handle.read()
    complete = raw.rfind(b"\n") + 1
    if complete != len(raw):
        os.truncate(path, complete)
    return complete


def _tail(path: Path, count: int = 1 << 16) -> bytes:
    """The last `count` bytes of a file (a line of the log is far shorter)."""
    with open(path, "rb") as handle:
        handle.seek(max(0, path.stat().st_size - count))
        return handle.read()


def _append_synced(path: Path, data: bytes) -> None:
    """Appends bytes to a file and flushes them to disk."""
    if not data:
        return
    with open(path, "ab") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())
