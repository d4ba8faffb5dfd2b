# The spool of accepted updates: each one's raw payload on disk until its round commits, so a restart resumes.
from __future__ import annotations

import re
import shutil
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from edge_agent.files import atomic_write_bytes
from edge_agent.wire import IDENTIFIER, WireError, check_identifier

SPOOL_SUFFIX = ".msgpack"
ROUND_FOLDER = re.compile(r"round_(\d{4,})")


def check_device_id(device_id: str) -> str:
    """Returns device_id if it is safe to use in a file name (the wire's identifier rule), else ValueError."""
    try:
        return check_identifier("device id", device_id)
    except WireError as error:
        raise ValueError(f"invalid device id: {error}") from None


def check_round_id(round_id: int) -> int:
    """Returns round_id as an int if it is an integer >= 0, else ValueError."""
    if not isinstance(round_id, (int, np.integer)) or isinstance(round_id, bool) or round_id < 0:
        raise ValueError(f"round ids are integers >= 0, got {round_id!r}")
    return int(round_id)


def round_name(round_id: int) -> str:
    """The file-name form of a round id, e.g. round_0003."""
    return f"round_{check_round_id(round_id):04d}"


class Spool:
    """spool/round_NNNN/<device>.msgpack: the raw payload of every accepted update of the rounds not yet committed."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def add(self, round_id: int, device_id: str, payload: bytes) -> Path:
        """Writes an accepted update's raw payload atomically (durable before the update is acked)."""
        path = self.folder / round_name(round_id) / f"{check_device_id(device_id)}{SPOOL_SUFFIX}"
        atomic_write_bytes(path, payload)
        return path

    def payloads(self, round_id: int) -> dict[str, bytes]:
        """The spooled payloads of a round by device id (empty if none)."""
        return dict(self.items(round_id))

    def items(self, round_id: int) -> Iterator[tuple[str, bytes]]:
        """(device id, payload) of a round's spooled updates in device order, one file in memory at a time."""
        folder = self.folder / round_name(round_id)
        if not folder.is_dir():
            return
        for path in sorted(folder.glob(f"*{SPOOL_SUFFIX}")):
            device_id = path.name[: -len(SPOOL_SUFFIX)]
            if IDENTIFIER.fullmatch(device_id):
                yield device_id, path.read_bytes()

    def payload(self, round_id: int, device_id: str) -> bytes:
        """One device's spooled payload of a round (FileNotFoundError if it has none)."""
        return (self.folder / round_name(round_id) / f"{check_device_id(device_id)}{SPOOL_SUFFIX}").read_bytes()

    def discard_through(self, round_id: int) -> None:
        """Deletes the spooled updates of every round up to round_id (committed rounds need them no more)."""
        if not self.folder.is_dir():
            return
        for folder in self.folder.iterdir():
            match = ROUND_FOLDER.fullmatch(folder.name)
            if match and int(match.group(1)) <= check_round_id(round_id):
                shutil.rmtree(folder, ignore_errors=True)
