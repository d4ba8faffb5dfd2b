# Asynchronous intake: updates trained from any of the last S+1 global versions, buffered until K are in.
from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from coordinator.intake.scratch import TensorScratch
from coordinator.intake.update_intake import RoundCollector
from coordinator.intake.validation import Expectation, Incoming, Rejection, check_sender, validated
from coordinator.strategies.aggregate import OutOfRange, check_magnitude
from protocol import messages
from protocol.errors import UsageError
from protocol.messages import RejectionKind
from protocol.tensors import Weights, weights_hash


@dataclass(frozen=True)
class AsyncPolicy:
    """FedBuff's settings: fold every `buffer` (K) accepted updates into a new version; accept updates trained from
    a version at most `max_staleness` (S) versions old; step the global model by `server_lr` (eta_g)."""

    buffer: int
    max_staleness: int
    server_lr: float = 1.0

    def __post_init__(self) -> None:
        if self.buffer < 1:
            raise UsageError(f"--buffer must be at least 1, got {self.buffer}")
        if self.max_staleness < 0:
            raise UsageError(f"--max-staleness must be at least 0, got {self.max_staleness}")
        if not 0.0 < self.server_lr <= 10.0:
            raise UsageError(f"--async-server-lr must lie in (0, 10], got {self.server_lr}")


@dataclass(frozen=True)
class Buffered:
    """An accepted update waiting to be folded: its metadata (no tensors), digest and size."""

    update: messages.Update
    digest: str
    size: int

    @property
    def base(self) -> int:
        """The global version the device trained from: round r is trained from version r - 1."""
        return self.update.round_id - 1


@dataclass(frozen=True)
class Taken:
    """An update already accepted from a (device, base version): its id, digest and the version it goes into."""

    update_id: str
    digest: str
    version: int


def check_staleness(base: int, current: int, max_staleness: int) -> None:
    """Rejection unless `base` lies within the last max_staleness versions up to `current` (stale: too old)."""
    if base > current:
        raise Rejection(
            RejectionKind.FUTURE_ROUND, f"future version: update trained from {base}, the newest is {current}"
        )
    if current - base > max_staleness:
        raise Rejection(
            RejectionKind.STALE,
            f"stale: update trained from version {base}, {current - base} behind {current} (at most {max_staleness})",
        )


class VersionCollector(RoundCollector):
    """Collects asynchronous updates across versions (an update of round r is trained from version r - 1, the
    announcement of round v + 1 carries version v): each is validated against the version it was trained from
    (decoded against that model), once per (device, base version). A device's first waiting update goes into the
    buffer of the version being built; one that comes while that is still waiting goes into the next buffer (it
    was trained from the current version, so it is exactly one version old when folded). Each buffer's decoded
    weights wait in a scratch file in `folder` (`tensors`, `next_tensors`) until the fold views them."""

    def __init__(self, template: Expectation, policy: AsyncPolicy, version: int, model: Weights, folder: Path) -> None:
        super().__init__(template)
        self.policy = policy
        self.version = version
        self.models: dict[int, tuple[str, Weights]] = {version: (weights_hash(model), model)}
        self.buffer: dict[str, Buffered] = {}
        self.next_buffer: dict[str, Buffered] = {}
        self.folder = folder
        self.tensors, self.next_tensors = TensorScratch(folder), TensorScratch(folder)
        self.folded: dict[tuple[str, int], Taken] = {}
        self.advance_expectation()

    def remember(self, version: int, model: Weights) -> None:
        """Keeps an older version's model (a resumed run reloads the window from its checkpoints)."""
        if self.version - version <= self.policy.max_staleness:
            self.models[version] = (weights_hash(model), model)

    def advance_expectation(self) -> None:
        """The collector's own expectation names the version being built (round id of rejections and acks)."""
        self.expectation = self.expectation_of(self.version)

    def expectation_of(self, base: int) -> Expectation:
        """What an update trained from version `base` must look like (its hash, its trained set to decode against)."""
        return self.expectation.for_model(base + 1, *self.models[base])

    def offer(self, incoming: Incoming) -> tuple[messages.Update, bool]:
        """(update, is_new) as RoundCollector.offer, except that the update may come from any version in the window;
        the returned update's round id is the version it will be folded into (what its ack and spool name)."""
        device_id, base = incoming.device_id, check_sender(incoming).round_id - 1
        check_staleness(base, self.version, self.policy.max_staleness)
        if base not in self.models:
            raise Rejection(RejectionKind.STALE, f"stale: version {base} is not one this run can take updates from")
        update = validated(incoming, self.expectation_of(base))
        try:
            check_magnitude(update.tensors)
        except OutOfRange as error:
            raise Rejection(error.kind, f"out of range: {error}") from None
        digest = hashlib.sha256(incoming.payload).hexdigest()
        previous = self.taken(device_id, base)
        if previous is not None:
            if previous.update_id == update.update_id and previous.digest == digest:
                return dataclasses.replace(update, tensors={}, round_id=previous.version), False
            raise Rejection(RejectionKind.DUPLICATE, duplicate_reason(device_id, update, previous.update_id, base))
        into, tensors = (
            (self.next_buffer, self.next_tensors) if device_id in self.buffer else (self.buffer, self.tensors)
        )
        tensors.put(device_id, update.tensors)
        into[device_id] = Buffered(dataclasses.replace(update, tensors={}), digest, len(incoming.payload))
        version = self.version + (2 if into is self.next_buffer else 1)
        return dataclasses.replace(update, tensors={}, round_id=version), True

    def taken(self, device_id: str, base: int) -> Taken | None:
        """What the device already sent from `base` (buffered, or folded into a recent version), or None."""
        for version, buffer in ((self.version + 1, self.buffer), (self.version + 2, self.next_buffer)):
            entry = buffer.get(device_id)
            if entry is not None and entry.base == base:
                return Taken(entry.update.update_id, entry.digest, version)
        return self.folded.get((device_id, base))

    def full(self) -> bool:
        """True once the buffer holds K updates."""
        return len(self.buffer) >= self.policy.buffer

    def fold_next(self, model: Weights) -> list[Buffered]:
        """Moves on to the next version (its model given): the buffer is folded, the next buffer becomes the buffer,
        models older than the window are dropped; returns the folded entries."""
        folded = sorted(self.buffer.values(), key=lambda entry: entry.update.device_id)
        self.version += 1
        self.models[self.version] = (weights_hash(model), model)
        self.note_folded(folded, self.version)
        self.forget_older_than(self.version - self.policy.max_staleness)
        self.buffer, self.next_buffer = self.next_buffer, {}
        self.tensors.close()
        self.tensors, self.next_tensors = self.next_tensors, TensorScratch(self.folder)
        self.advance_expectation()
        self.rejected, self.rejection_count = {}, 0
        return folded

    def note_folded(self, entries: Iterable[Buffered], version: int) -> None:
        """Remembers folded updates (per device and base) so a redelivery is re-acked, not folded twice."""
        for entry in entries:
            taken = Taken(entry.update.update_id, entry.digest, version)
            self.folded[(entry.update.device_id, entry.base)] = taken

    def forget_older_than(self, oldest: int) -> None:
        """Drops models and folded records of versions before `oldest` (their updates are stale now)."""
        self.models = {version: model for version, model in self.models.items() if version >= oldest}
        self.folded = {key: taken for key, taken in self.folded.items() if key[1] >= oldest}


def duplicate_reason(device_id: str, update: messages.Update, previous_id: str, base: int) -> str:
    """Why a second update of a device from the same version is refused."""
    if previous_id == update.update_id:
        return f"duplicate: update {update.update_id[:64]!r} was already accepted with different content"
    return f"duplicate: {device_id} already sent an update trained from version {base}"
