# Chunked transfer, receiving side: chunks arriving on <topic>/chunk/<i> put back together into their message within
# bounded memory, every chunk checked first. Pure: no paho, the clock is passed in.
from __future__ import annotations

import hashlib
import re
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from protocol import messages, wire
from protocol.chunks import MAX_CHUNKS, chunk_size
from protocol.messages import RejectionKind
from protocol.topics import CHUNKS
from protocol.wire import shown_names

# What a held chunk costs beyond its data (its bytes object and index entry): charged against the caps.
CHUNK_BOOKKEEPING = 256
DIGEST = re.compile(r"^[0-9a-f]{64}$")
MIB = 1024 * 1024


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
        parsed = CHUNKS.match(topic)
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
        return bad, f"bad chunk: transfer id {wire.shown(chunk.transfer_id)} must be {wire.IDENTIFIER_RULE}"
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
