# The spool of accepted updates: each one's raw payload on disk until its round commits, so a restart resumes.
"""Group commit: accepted updates are staged and a whole batch is made durable with one fdatasync, appended to
the process's segment of the round (spool/round_NNNN/segment_NNNNNN.log). Each record is framed (magic, device id
length, payload length, crc32); a reader stops a segment at its first incomplete or corrupt record, so the torn
tail a crash leaves is ignored and every record before it (everything that was acked) is kept."""

from __future__ import annotations

import os
import re
import shutil
import struct
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np

from protocol.files import fsync_directory
from protocol.wire import IDENTIFIER, WireError, check_identifier

SEGMENT = re.compile(r"segment_(\d{6,})\.log")
ROUND_FOLDER = re.compile(r"round_(\d{4,})")
RECORD_HEADER = struct.Struct(">4sHII")  # magic, device id bytes, payload bytes, crc32 of device id + payload
MAGIC = b"SPL1"


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


@dataclass(frozen=True)
class Location:
    """Where a spooled payload lies: its segment file, the payload's offset and its length."""

    segment: Path
    offset: int
    length: int


def frame(device_id: str, payload: bytes) -> bytes:
    """One spool record: header, device id, payload."""
    name = device_id.encode()
    return RECORD_HEADER.pack(MAGIC, len(name), len(payload), zlib.crc32(payload, zlib.crc32(name))) + name + payload


def read_segment(path: Path) -> Iterator[tuple[str, Location]]:
    """(device id, location) of each whole record of a segment, in order, up to its first torn or corrupt one."""
    with path.open("rb") as handle:
        while True:
            header = handle.read(RECORD_HEADER.size)
            if len(header) < RECORD_HEADER.size:
                return
            magic, name_length, payload_length, crc = RECORD_HEADER.unpack(header)
            name, payload = handle.read(name_length), handle.read(payload_length)
            whole = magic == MAGIC and len(name) == name_length and len(payload) == payload_length
            if not whole or zlib.crc32(payload, zlib.crc32(name)) != crc:
                return
            device_id = name.decode(errors="replace")
            if IDENTIFIER.fullmatch(device_id):
                yield device_id, Location(path, handle.tell() - payload_length, payload_length)


class Spool:
    """spool/round_NNNN/segment_*.log: the raw payload of every accepted update of the rounds not yet committed."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.staged: list[tuple[int, str, bytes]] = []
        self.segments: dict[int, tuple[Path, BinaryIO]] = {}
        self.index: dict[int, dict[str, Location]] = {}

    def stage(self, round_id: int, device_id: str, payload: bytes) -> None:
        """Holds an accepted update's payload for the next commit (not durable, so not to be acked, before it)."""
        self.staged.append((check_round_id(round_id), check_device_id(device_id), payload))

    def commit(self) -> None:
        """Makes every staged payload durable: appended to its round's segment, one fdatasync per segment."""
        staged, self.staged = self.staged, []
        for round_id in sorted({round_id for round_id, _, _ in staged}):
            self.append(round_id, [(device, payload) for rid, device, payload in staged if rid == round_id])

    def add(self, round_id: int, device_id: str, payload: bytes) -> None:
        """Stages and commits one payload (a batch of one)."""
        self.stage(round_id, device_id, payload)
        self.commit()

    def append(self, round_id: int, records: list[tuple[str, bytes]]) -> None:
        """Appends records to this process's segment of the round and syncs them; a failed write closes the segment
        (its tail may be torn: readers stop there, and the next batch goes to a new segment)."""
        index = self.round_index(round_id)
        path, handle = self.segment(round_id)
        try:
            offset = handle.tell()
            for device_id, payload in records:
                handle.write(frame(device_id, payload))
                offset += RECORD_HEADER.size + len(device_id.encode())
                index.setdefault(device_id, Location(path, offset, len(payload)))
                offset += len(payload)
            handle.flush()
            os.fdatasync(handle.fileno())
        except BaseException:
            self.segments.pop(round_id)[1].close()
            self.index.pop(round_id, None)
            raise

    def segment(self, round_id: int) -> tuple[Path, BinaryIO]:
        """This process's open segment of a round, created (and its folder entry synced) on first use."""
        if round_id not in self.segments:
            folder = self.folder / round_name(round_id)
            folder.mkdir(parents=True, exist_ok=True)
            numbers = [int(m.group(1)) for p in folder.iterdir() if (m := SEGMENT.fullmatch(p.name))]
            path = folder / f"segment_{max(numbers, default=0) + 1:06d}.log"
            handle = open(path, "xb")  # noqa: SIM115 (kept open across batches, closed by close())
            fsync_directory(folder)
            self.segments[round_id] = (path, handle)
        return self.segments[round_id]

    def round_index(self, round_id: int) -> dict[str, Location]:
        """Device id -> location of its first spooled payload of a round, read from disk once, then kept current."""
        if round_id not in self.index:
            folder = self.folder / round_name(round_id)
            index: dict[str, Location] = {}
            paths = sorted(folder.glob("segment_*.log"), key=lambda p: p.name) if folder.is_dir() else []
            for path in paths:
                for device_id, location in read_segment(path):
                    index.setdefault(device_id, location)
            self.index[round_id] = index
        return self.index[round_id]

    def payloads(self, round_id: int) -> dict[str, bytes]:
        """The spooled payloads of a round by device id (empty if none)."""
        return dict(self.items(round_id))

    def items(self, round_id: int) -> Iterator[tuple[str, bytes]]:
        """(device id, payload) of a round's spooled updates in device order, one payload in memory at a time."""
        index = self.round_index(check_round_id(round_id))
        for device_id in sorted(index):
            yield device_id, self.payload(round_id, device_id)

    def payload(self, round_id: int, device_id: str) -> bytes:
        """One device's spooled payload of a round (FileNotFoundError if it has none)."""
        location = self.round_index(check_round_id(round_id)).get(check_device_id(device_id))
        if location is None:
            raise FileNotFoundError(f"no spooled update of {device_id} for {round_name(round_id)}")
        with location.segment.open("rb") as handle:
            handle.seek(location.offset)
            return handle.read(location.length)

    def seal_through(self, round_id: int) -> int:
        """Closes this process's segments of every round up to round_id (committed: nothing more is appended);
        returns round_id checked."""
        last = check_round_id(round_id)
        for sealed in [r for r in self.segments if r <= last]:
            self.segments.pop(sealed)[1].close()
        return last

    def discard_through(self, round_id: int) -> None:
        """Deletes the spooled updates of every round up to round_id (committed rounds need them no more)."""
        last = self.seal_through(round_id)
        self.index = {r: index for r, index in self.index.items() if r > last}
        if not self.folder.is_dir():
            return
        for folder in self.folder.iterdir():
            match = ROUND_FOLDER.fullmatch(folder.name)
            if match and int(match.group(1)) <= last:
                shutil.rmtree(folder, ignore_errors=True)

    def close(self) -> None:
        """Closes the open segments (what they hold is already durable)."""
        for _, handle in self.segments.values():
            handle.close()
        self.segments.clear()
