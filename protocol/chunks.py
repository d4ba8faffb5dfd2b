# Chunked transfer: a message too large for the broker travels as numbered chunks on <topic>/chunk/<i>, and the
# receiving session puts it back together within bounded memory. Pure: no paho, the clock is passed in.
from __future__ import annotations

import hashlib
import math
import re
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from protocol import messages, wire
from protocol.messages import RejectionKind
from protocol.wire import shown_names

CHUNK_LEVEL = "chunk"
# The PUBLISH packet around a payload: fixed header (5), topic length (2), packet id (2), properties (1); generous.
PACKET_OVERHEAD = 64
# The chunk's msgpack envelope around its data (measured at about 180 bytes; tests/test_chunks.py checks the sum).
ENVELOPE_OVERHEAD = 256
MIN_CHUNK_DATA = 1024
# The smallest broker packet limit this side accepts to be told: room for a topic, the envelope and MIN_CHUNK_DATA.
MIN_PACKET_BYTES = 4096
MAX_CHUNKS = 1 << 16
# What a held chunk costs beyond its data (its bytes object and index entry): charged against the caps.
CHUNK_BOOKKEEPING = 256
DIGEST = re.compile(r"^[0-9a-f]{64}$")
INDEX = re.compile(r"^(0|[1-9][0-9]{0,5})$")
MIB = 1024 * 1024


class ChunkingError(ValueError):
    """A payload that cannot be cut under the broker's limit (the limit leaves no room, or too many chunks)."""


def chunk_topic(topic: str, index: int) -> str:
    """Where chunk `index` of a message for `topic` is published."""
    return f"{topic}/{CHUNK_LEVEL}/{index}"


def chunk_filter(topic_filter: str) -> str | None:
    """The subscription that also brings the chunks of messages matching `topic_filter` (None: it already does)."""
    return None if topic_filter.endswith("#") else f"{topic_filter}/{CHUNK_LEVEL}/+"


def parse_chunk_topic(topic: str) -> tuple[str, int | None] | None:
    """(the message's own topic, the chunk index or None if the level is not one) for a chunk topic; None for any
    other topic."""
    base, separator, index = topic.rpartition(f"/{CHUNK_LEVEL}/")
    if not separator or not base or "/" in index:
        return None
    return base, int(index) if INDEX.fullmatch(index) else None


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
    room = packet_limit - PACKET_OVERHEAD - ENVELOPE_OVERHEAD - len(chunk_topic(topic, MAX_CHUNKS).encode())
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
            chunk_topic(topic, index),
            wire.encode(
                messages.Chunk(
                    transfer_id, index, count, len(payload), digest, bytes(view[index * size : (index + 1) * size])
                )
            ),
        )
        for index in range(count)
    ]


def subscription_filters(topic_filter: str) -> list[str]:
    """The filters a subscription to `topic_filter` needs: itself and, unless it already covers them, its chunks."""
    extra = chunk_filter(topic_filter)
    return [topic_filter] if extra is None else [topic_filter, extra]


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
        stale = [chunk_topic(topic, index) for index in range(count, self._chunks.pop(topic, 0))]
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


@dataclass(frozen=True)
class ChunkLimits:
    """What a receiver holds of unfinished transfers. A transfer reserves its claimed size (plus CHUNK_BOOKKEEPING
    per chunk) when its first chunk arrives, so what is held never exceeds what was reserved; a 'sender' is the
    message's topic (a device's update topic, one retained model topic)."""

    max_message_bytes: int = wire.DEFAULT_MAX_MESSAGE_BYTES
    sender_bytes: int = 2 * wire.DEFAULT_MAX_MESSAGE_BYTES
    sender_transfers: int = 2
    total_bytes: int = 128 * MIB
    total_transfers: int = 256
    timeout: float = 120.0
    quiet: float = 10.0
    remembered: int = 4096

    def __post_init__(self) -> None:
        if min(self.max_message_bytes, self.sender_bytes, self.sender_transfers, self.total_bytes) < 1:
            raise ValueError("chunk limits must be positive")
        if min(self.total_transfers, self.remembered) < 1 or self.timeout <= 0 or self.quiet < 0:
            raise ValueError("chunk limits must be positive")


@dataclass(frozen=True)
class Completed:
    """A reassembled message: its own topic and the whole payload, digest checked."""

    topic: str
    payload: bytes


@dataclass(frozen=True)
class Dropped:
    """A transfer that was refused or dropped: its topic, its id ('' if unreadable), why (a stable kind and a short
    reason) and the size it claimed."""

    topic: str
    transfer_id: str
    kind: RejectionKind
    reason: str
    total_bytes: int = 0


@dataclass
class Transfer:
    """One message being put together."""

    topic: str
    transfer_id: str
    count: int
    total_bytes: int
    digest: str
    reserved: int
    last_seen: float
    chunks: dict[int, bytes] = field(default_factory=dict)

    def dropped(self, reason: str) -> Dropped:
        """This transfer dropped as a bad chunk, for `reason`."""
        return Dropped(self.topic, self.transfer_id, RejectionKind.BAD_CHUNK, reason, self.total_bytes)

    def missing(self, shown: int = 8) -> str:
        """The first few missing indices."""
        return shown_names([index for index in range(self.count) if index not in self.chunks], shown, str)


@dataclass
class ReassemblyStats:
    """Counters for logs and tests: transfers completed and dropped, chunks ignored, the peak reserved and held."""

    completed: int = 0
    dropped: int = 0
    duplicates: int = 0
    ignored: int = 0
    suppressed: int = 0
    peak_reserved: int = 0
    peak_held: int = 0


class Recent:
    """Keys seen lately, at most `size` of them, each forgotten `quiet` seconds after it was last noted."""

    def __init__(self, size: int, quiet: float) -> None:
        self.size = size
        self.quiet = quiet
        self._seen: OrderedDict[object, float] = OrderedDict()

    def __contains__(self, key: object) -> bool:
        return key in self._seen

    def note(self, key: object, now: float) -> None:
        """Marks `key` as seen now (the oldest key goes when there are too many)."""
        self._seen[key] = now
        self._seen.move_to_end(key)
        while len(self._seen) > self.size:
            self._seen.popitem(last=False)

    def forget_quiet(self, now: float) -> None:
        """Forgets every key not noted for `quiet` seconds."""
        while self._seen and now - next(iter(self._seen.values())) >= self.quiet:
            self._seen.popitem(last=False)


class Transfers:
    """The unfinished transfers and what they reserve and hold, with the caps a new one must fit under."""

    def __init__(self, limits: ChunkLimits) -> None:
        self.limits = limits
        self.table: dict[tuple[str, str], Transfer] = {}
        self.reserved = 0
        self.held = 0

    def start(self, topic: str, chunk: messages.Chunk, now: float) -> Transfer:
        """A new transfer from its first chunk, reserving its claimed size."""
        reserved = chunk.total_bytes + chunk.count * CHUNK_BOOKKEEPING
        transfer = Transfer(topic, chunk.transfer_id, chunk.count, chunk.total_bytes, chunk.digest, reserved, now)
        self.table[(topic, chunk.transfer_id)] = transfer
        self.reserved += reserved
        return transfer

    def hold(self, transfer: Transfer, chunk: messages.Chunk, now: float) -> None:
        """Keeps one checked chunk of a transfer."""
        transfer.chunks[chunk.index] = chunk.data
        transfer.last_seen = now
        self.held += len(chunk.data)

    def end(self, transfer: Transfer) -> None:
        """Lets go of a transfer and what it reserved and held."""
        del self.table[(transfer.topic, transfer.transfer_id)]
        self.reserved -= transfer.reserved
        self.held -= sum(len(data) for data in transfer.chunks.values())
        transfer.chunks = {}

    def refusal(self, topic: str, chunk: messages.Chunk) -> str | None:
        """Why a transfer starting with this chunk may not start (its sender's or everyone's caps), or None."""
        limits = self.limits
        need = chunk.total_bytes + chunk.count * CHUNK_BOOKKEEPING
        own = [transfer for transfer in self.table.values() if transfer.topic == topic]
        held = sum(transfer.reserved for transfer in own)
        if len(own) >= limits.sender_transfers:
            return f"transfer limit: {len(own)} transfers already in progress on this topic (cap {limits.sender_transfers})"
        if held + need > limits.sender_bytes:
            return f"transfer limit: {held + need} bytes would be held for this topic (cap {limits.sender_bytes})"
        if len(self.table) >= limits.total_transfers:
            return f"transfer limit: {len(self.table)} transfers already in progress (cap {limits.total_transfers})"
        if self.reserved + need > limits.total_bytes:
            return f"transfer limit: {self.reserved + need} bytes would be held in all (cap {limits.total_bytes})"
        return None


class Reassembler:
    """Puts chunked messages back together within ChunkLimits: `add` answers Completed (the whole message), Dropped
    (refused or abandoned, with its kind and reason) or None (held or ignored); `expire` drops idle transfers.
    A chunk is checked before it is kept (chunk_problem, mismatch; a copy must equal what is held, and is ignored),
    a first chunk must fit the caps (transfer_limit), the whole must hash to its digest. Chunks of a transfer dropped
    or completed lately are ignored while they keep coming, and a sender refused for its caps is told once per
    `quiet` seconds however many first chunks it sends, so reports stay bounded too."""

    def __init__(self, limits: ChunkLimits | None = None) -> None:
        self.limits = limits or ChunkLimits()
        self.stats = ReassemblyStats()
        self.transfers = Transfers(self.limits)
        self._dropped = Recent(self.limits.remembered, self.limits.quiet)
        self._finished = Recent(self.limits.remembered, self.limits.quiet)
        self._refused = Recent(self.limits.remembered, self.limits.quiet)

    @property
    def pending(self) -> int:
        """Unfinished transfers."""
        return len(self.transfers.table)

    @property
    def reserved_bytes(self) -> int:
        """Bytes reserved by unfinished transfers (an upper bound of what they hold)."""
        return self.transfers.reserved

    @property
    def held_bytes(self) -> int:
        """Data bytes held in unfinished transfers."""
        return self.transfers.held

    def add(self, topic: str, payload: bytes, now: float) -> Completed | Dropped | None:
        """Takes one chunk as it arrived on `topic` (a chunk topic); an empty payload (a cleared retained chunk) is
        ignored."""
        parsed = parse_chunk_topic(topic)
        if parsed is None:
            raise ValueError(f"{wire.shown(topic)} is not a chunk topic")
        base, topic_index = parsed
        if not payload:
            return None
        try:
            chunk = wire.decode(payload, messages.Chunk, max_bytes=self.limits.max_message_bytes + 4 * 1024)
        except wire.WireError as error:
            return self._drop(Dropped(base, "", RejectionKind.BAD_CHUNK, f"bad chunk: {error}"), now)
        key = (base, chunk.transfer_id)
        if self._seen_before(key, now):
            return None
        transfer = self.transfers.table.get(key)
        problem = chunk_problem(chunk, topic_index, self.limits.max_message_bytes)
        if problem is None and transfer is not None:
            problem = mismatch(transfer, chunk)
        if problem is not None:
            return self._drop(Dropped(base, chunk.transfer_id, *problem, chunk.total_bytes), now)
        if transfer is None:
            refusal = self.transfers.refusal(base, chunk)
            if refusal is not None:
                return self._refuse(Dropped(base, chunk.transfer_id, RejectionKind.TRANSFER_LIMIT, refusal), now)
            transfer = self.transfers.start(base, chunk, now)
            self.stats.peak_reserved = max(self.stats.peak_reserved, self.transfers.reserved)
        return self._keep(transfer, chunk, now)

    def _seen_before(self, key: tuple[str, str], now: float) -> bool:
        """Whether a chunk belongs to a transfer dropped or completed lately (it is then ignored, and counted)."""
        if key in self._finished:
            self._finished.note(key, now)
            self.stats.duplicates += 1
            return True
        if key in self._dropped:
            self._dropped.note(key, now)
            self.stats.ignored += 1
            return True
        return False

    def _keep(self, transfer: Transfer, chunk: messages.Chunk, now: float) -> Completed | Dropped | None:
        """Holds a checked chunk (or ignores its identical copy); the whole message once the last one is in."""
        held = transfer.chunks.get(chunk.index)
        if held is not None:
            if held != chunk.data:
                reason = f"bad chunk: chunk {chunk.index} of transfer {chunk.transfer_id} came twice with other bytes"
                return self._drop(transfer.dropped(reason), now)
            self.stats.duplicates += 1
            return None
        self.transfers.hold(transfer, chunk, now)
        self.stats.peak_held = max(self.stats.peak_held, self.transfers.held)
        if len(transfer.chunks) < transfer.count:
            return None
        payload = b"".join(transfer.chunks[index] for index in range(transfer.count))
        self.transfers.end(transfer)
        actual = hashlib.sha256(payload).hexdigest()
        if actual != transfer.digest:
            reason = (
                f"bad chunk: the {len(payload)} bytes of transfer {transfer.transfer_id} hash to {actual[:16]}..., "
                f"its chunks claimed {transfer.digest[:16]}..."
            )
            return self._drop(transfer.dropped(reason), now)
        self.stats.completed += 1
        self._finished.note((transfer.topic, transfer.transfer_id), now)
        return Completed(transfer.topic, payload)

    def expire(self, now: float) -> list[Dropped]:
        """Drops every transfer that saw no chunk for `timeout` seconds (a later chunk of one starts it afresh, so a
        re-sent message can still complete), and forgets quiet dropped or completed transfers and refused senders."""
        timeout = self.limits.timeout
        stale = [transfer for transfer in self.transfers.table.values() if now - transfer.last_seen >= timeout]
        drops = []
        for transfer in stale:
            reason = (
                f"bad chunk: transfer {transfer.transfer_id} timed out after {timeout:g}s with "
                f"{len(transfer.chunks)} of {transfer.count} chunks (missing {transfer.missing()})"
            )
            drops.append(transfer.dropped(reason))
            self.transfers.end(transfer)
        self.stats.dropped += len(drops)
        for recent in (self._dropped, self._finished, self._refused):
            recent.forget_quiet(now)
        return drops

    def forget(self, matches: Callable[[str], bool]) -> None:
        """Drops, without a report, every unfinished transfer whose topic matches (its subscription ended)."""
        for transfer in [transfer for transfer in self.transfers.table.values() if matches(transfer.topic)]:
            self.transfers.end(transfer)

    def _refuse(self, dropped: Dropped, now: float) -> Dropped | None:
        """A cap refusal: reported once per `quiet` seconds and sender, counted otherwise."""
        self._dropped.note((dropped.topic, dropped.transfer_id), now)
        self.stats.dropped += 1
        if dropped.topic in self._refused:
            self.stats.suppressed += 1
            return None
        self._refused.note(dropped.topic, now)
        return dropped

    def _drop(self, dropped: Dropped, now: float) -> Dropped:
        """Ends a transfer (if it had started) and ignores its further chunks while they keep coming."""
        key = (dropped.topic, dropped.transfer_id)
        transfer = self.transfers.table.get(key)
        if transfer is not None:
            self.transfers.end(transfer)
        if dropped.transfer_id:
            self._dropped.note(key, now)
        self.stats.dropped += 1
        return dropped


def chunk_problem(chunk: messages.Chunk, topic_index: int | None, max_bytes: int) -> tuple[RejectionKind, str] | None:
    """What is wrong with a chunk on its own (kind, reason), or None."""
    bad = RejectionKind.BAD_CHUNK
    if not wire.IDENTIFIER.fullmatch(chunk.transfer_id):
        return bad, f"bad chunk: transfer id {wire.shown(chunk.transfer_id)} must match {wire.IDENTIFIER.pattern}"
    if not DIGEST.fullmatch(chunk.digest):
        return bad, f"bad chunk: digest {wire.shown(chunk.digest)} is not a sha256 in lowercase hex"
    if chunk.total_bytes > max_bytes:
        return RejectionKind.TOO_LARGE, (
            f"too large: transfer {chunk.transfer_id} claims {chunk.total_bytes} bytes, above the limit of {max_bytes}"
        )
    if not 1 <= chunk.count <= MAX_CHUNKS or not chunk.count <= chunk.total_bytes:
        return bad, f"bad chunk: {chunk.count} chunks cannot carry {chunk.total_bytes} bytes (at most {MAX_CHUNKS})"
    if chunk.total_bytes - (chunk.count - 1) * chunk_size(chunk.total_bytes, chunk.count) <= 0:
        return bad, f"bad chunk: {chunk.total_bytes} bytes do not make {chunk.count} chunks"
    if not 0 <= chunk.index < chunk.count or chunk.index != topic_index:
        return bad, f"bad chunk: index {chunk.index} (topic level {topic_index}) is not one of {chunk.count} chunks"
    size = chunk_size(chunk.total_bytes, chunk.count)
    expected = min(size, chunk.total_bytes - chunk.index * size)
    if len(chunk.data) != expected:
        return bad, f"bad chunk: chunk {chunk.index} holds {len(chunk.data)} bytes, its share is {expected}"
    return None


def mismatch(transfer: Transfer, chunk: messages.Chunk) -> tuple[RejectionKind, str] | None:
    """Why a later chunk does not belong with its transfer's first one (inconsistent totals), or None."""
    if (chunk.count, chunk.total_bytes, chunk.digest) == (transfer.count, transfer.total_bytes, transfer.digest):
        return None
    return RejectionKind.BAD_CHUNK, (
        f"bad chunk: chunk {chunk.index} of transfer {chunk.transfer_id} claims {chunk.count} chunks, "
        f"{chunk.total_bytes} bytes, digest {chunk.digest[:12]}; its first chunk claimed {transfer.count}, "
        f"{transfer.total_bytes}, {transfer.digest[:12]}"
    )
