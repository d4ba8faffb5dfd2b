# Chunked transfer, sending side: a message too large for the broker travels as numbered chunks on
# <topic>/chunk/<i> (protocol.reassembly puts them back together). Pure: no paho.
from __future__ import annotations

import hashlib
import math

from protocol import messages, wire
from protocol.errors import RefusalError, UsageError
from protocol.messages import RejectionKind
from protocol.topics import CHUNKS

# The PUBLISH packet around a payload: fixed header (5), topic length (2), packet id (2), properties (1); generous.
PACKET_OVERHEAD = 64
# The chunk's msgpack envelope around its data (measured at about 180 bytes; tests/test_chunks.py checks the sum).
ENVELOPE_OVERHEAD = 256
MIN_CHUNK_DATA = 1024
# The smallest broker packet limit this side accepts to be told: room for a topic, the envelope and MIN_CHUNK_DATA.
MIN_PACKET_BYTES = 4096
MAX_CHUNKS = 1 << 16


def given_packet_limit(limit: int | None) -> int | None:
    """A broker's packet limit a person gave (--max-message-bytes), if any: it must leave room for a chunk."""
    if limit is not None and limit < MIN_PACKET_BYTES:
        raise UsageError(f"--max-message-bytes must be at least {MIN_PACKET_BYTES}, got {limit}")
    return limit


class ChunkingError(RefusalError, ValueError):
    """A payload that cannot be cut under the broker's limit (the limit leaves no room, or too many chunks)."""

    kind = RejectionKind.BAD_CHUNK


def packet_bytes(topic: str, payload: bytes) -> int:
    """An upper bound of the PUBLISH packet's size for this topic and payload."""
    return len(payload) + len(topic.encode()) + PACKET_OVERHEAD


def needs_chunks(topic: str, payload: bytes, packet_limit: int | None) -> bool:
    """Whether the payload must go in chunks to stay under the broker's packet limit (None: no known limit)."""
    return packet_limit is not None and packet_bytes(topic, payload) > packet_limit


def transfer_id_of(digest: str, count: int) -> str:
    """A transfer's id: the same payload cut the same way always gets the same id, so a re-sent message (the
    device's outbox, a retained topic published again) joins whatever part of it a receiver already holds."""
    return hashlib.sha256(f"{digest}/{count}".encode()).hexdigest()[:32]


def chunk_size(total_bytes: int, count: int) -> int:
    """The data size of every chunk but possibly the last."""
    return math.ceil(total_bytes / count)


def split(topic: str, payload: bytes, packet_limit: int) -> list[tuple[str, bytes]]:
    """(chunk topic, encoded chunk) for every chunk of the payload, each packet under `packet_limit` bytes."""
    room = packet_limit - PACKET_OVERHEAD - ENVELOPE_OVERHEAD - len(CHUNKS.build(topic, MAX_CHUNKS).encode())
    if room < MIN_CHUNK_DATA:
        raise ChunkingError(f"the broker's limit of {packet_limit} bytes leaves no room for chunks of {topic}")
    count = math.ceil(len(payload) / room)
    if count > MAX_CHUNKS:
        raise ChunkingError(f"{len(payload)} bytes would need {count} chunks, more than {MAX_CHUNKS}")
    size = chunk_size(len(payload), count)
    digest = hashlib.sha256(payload).hexdigest()
    transfer_id = transfer_id_of(digest, count)
    view = memoryview(payload)
    return [
        (
            CHUNKS.build(topic, index),
            wire.encode(
                messages.Chunk(
                    transfer_id, index, count, len(payload), digest, bytes(view[index * size : (index + 1) * size])
                )
            ),
        )
        for index in range(count)
    ]


class Outgoing:
    """What a publisher sends for each message: the message, or its chunks when its packet would exceed the broker's
    limit (the smaller of the configured one and the one the broker announced; none known: never chunked), and for a
    retained message the clears of the retained copies it leaves behind (chunks beyond its count, or the whole
    message its chunks replace). It only knows the copies this publisher retained."""

    def __init__(self, configured: int | None = None) -> None:
        self.configured = configured
        self.announced: int | None = None
        self._chunks: dict[str, int] = {}
        self._whole: set[str] = set()

    @property
    def packet_limit(self) -> int | None:
        """The largest packet the broker takes, as far as this publisher knows."""
        known = [limit for limit in (self.configured, self.announced) if limit]
        return min(known) if known else None

    def plan(self, topic: str, payload: bytes, retain: bool) -> list[tuple[str, bytes, bool]]:
        """(topic, payload, retain) of every publish one message takes, clears last (ChunkingError if it cannot be
        cut under the limit)."""
        limit = self.packet_limit
        if limit is None or not payload or not needs_chunks(topic, payload, limit):
            pieces = [(topic, payload)]
        else:
            pieces = split(topic, payload, limit)
        stale = self._replaced(topic, payload, len(pieces) if pieces[0][0] != topic else 0) if retain else []
        return [(name, piece, retain) for name, piece in pieces] + [(name, b"", True) for name in stale]

    def _replaced(self, topic: str, payload: bytes, count: int) -> list[str]:
        """The retained copies to clear after retaining `payload` on `topic` in `count` chunks (0: whole)."""
        stale = [CHUNKS.build(topic, index) for index in range(count, self._chunks.pop(topic, 0))]
        if count:
            self._chunks[topic] = count
            if topic in self._whole:
                self._whole.discard(topic)
                stale.append(topic)
        elif payload:
            self._whole.add(topic)
        else:
            self._whole.discard(topic)
        return stale
