# What the labelling queue hands out and takes in: its refusals, a queued query, decisions, corrections, votes'
# outcomes, the undo window, a person's day; a query's kind and an image's check (pure).
from __future__ import annotations

import hashlib
import io
from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum

from PIL import Image

from coordinator.labelling.queue_schema import FIELD_TEST, FORMATS, LABEL, MAX_PIXELS
from protocol.errors import FalError
from protocol.label_messages import DEFAULT_MAX_IMAGE_BYTES, QUERY_MEDIA_TYPES


class QueueRefusal(StrEnum):
    """Why a device's query was not queued (a stable label for logs and counters)."""

    TOO_LARGE = "too_large"
    UNDECODABLE = "undecodable"
    BAD_QUERY = "bad_query"
    UNKNOWN_DEVICE = "unknown_device"  # a secured fleet's desk holds no key of the device
    DEVICE_FULL = "device_full"
    QUEUE_FULL = "queue_full"


class AnswerError(FalError):
    """A person's answer the queue refuses, with the HTTP status that says why (404 unknown query, 409 answered
    already or voted already, 400 a label not in the spec)."""

    def __init__(self, status: int, reason: str) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason


@dataclass(frozen=True)
class QueueLimits:
    """How much the queue keeps: open queries per device and in all, the largest image accepted, and how many
    answered queries its devices have stored stay on disk (the newest; older ones' rows and images are removed)."""

    per_device: int = 500
    total: int = 10000
    image_bytes: int = DEFAULT_MAX_IMAGE_BYTES
    kept_answered: int = 10000


@dataclass(frozen=True)
class QueuedQuery:
    """One query as the labelling page shows it."""

    device: str
    query_id: str
    media_type: str
    image_bytes: int
    guess: int
    probability: float
    uncertainty: float
    score: float
    asked_at: float
    label: int | None
    answered_by: str | None


@dataclass(frozen=True)
class Decided:
    """An answer decided by a vote: the query, its label and who gave it (the majority's voters); a field test
    query's answer is kept by the coordinator and never sent."""

    device: str
    query_id: str
    label: int
    answered_by: str
    answered_at: float
    field_test: bool = False


@dataclass(frozen=True)
class Correction:
    """A change of an answer after it was sent, to be delivered to its device: the query, its new label, the
    correction's revision (counting the query's corrections), who made it and when."""

    device: str
    query_id: str
    label: int
    revision: int
    corrected_by: str
    corrected_at: float


class Outcome(StrEnum):
    """What recording a person's word did to a query."""

    VOTED = "voted"  # a vote that decides nothing yet (more people are asked)
    DECIDED = "decided"  # decided the query: the answer goes to its device (after its hold, if held)
    REPLACED = "replaced"  # changed an answer not sent yet: nothing goes out but the new answer, later
    CORRECTED = "corrected"  # changed an answer sent already: a correction goes to the device
    UNCHANGED = "unchanged"  # the query holds this label already


@dataclass(frozen=True)
class Recorded:
    """What `record` did, with the decision or correction it made (the desk sends them)."""

    outcome: Outcome
    decided: Decided | None = None
    correction: Correction | None = None
    held: bool = False


@dataclass(frozen=True)
class Recording:
    """What `record_all` did: each query's outcome, and the held answers it pushed out of the undo window (they go
    to their devices now)."""

    recorded: list[Recorded]
    released: list[Decided]


@dataclass(frozen=True)
class UndoWindow:
    """How long a page's answer waits before it goes to its device, so its person can take it back: while it is
    among the person's `answers` newest held answers, for at most `seconds`."""

    seconds: float = 30.0
    answers: int = 10


class Undone(StrEnum):
    """What an undo found: the person's latest answer taken back (the query is open again), or sent already (it can
    only be corrected now)."""

    WITHDRAWN = "withdrawn"
    SENT = "sent"


@dataclass(frozen=True)
class Given:
    """One answer of a person as their history shows it: the query, the label the person gave and the one the query
    holds now, and where it stands (`waiting` for more votes, `held` for an undo, `sent`, `delivered`, and for a
    corrected query `correction sent` or `corrected`)."""

    device: str
    query_id: str
    given: int
    label: int | None
    state: str
    voted_at: float


def image_refusal(image: bytes, media_type: str, limits: QueueLimits) -> QueueRefusal | None:
    """Why an image cannot be queued (too large, or not a decodable image of its declared type), or None."""
    if len(image) > limits.image_bytes:
        return QueueRefusal.TOO_LARGE
    if media_type not in QUERY_MEDIA_TYPES:
        return QueueRefusal.UNDECODABLE
    try:
        with Image.open(io.BytesIO(image)) as opened:
            width, height = opened.size
            if opened.format != FORMATS[media_type] or width * height > MAX_PIXELS:
                return QueueRefusal.UNDECODABLE
            opened.load()
    # PIL raises OSError (and ValueError, DecompressionBombError) for bytes it cannot decode: the sender's image
    except (OSError, ValueError, Image.DecompressionBombError):
        return QueueRefusal.UNDECODABLE
    return None


@dataclass(frozen=True)
class QueueStatus:
    """The queue at a glance: per device its open queries and the oldest one's age (seconds since the queue received
    it), per person the answers they gave in the last hour (the fleet's labelling rate) and today (since local
    midnight), how many answers are held for an undo, and how many corrections were made (and how many of them wait
    for their device)."""

    open_by_device: dict[str, tuple[int, float]]
    answers_last_hour: dict[str, int]
    answers_today: dict[str, int]
    held: int
    corrections: int
    corrections_undelivered: int


@dataclass(frozen=True)
class Tally:
    """What the page counts for its person: their answers today, and the corrections made in all."""

    today: int
    corrections: int


def query_kind(device: str, query_id: str, field_test_share: float) -> str:
    """A query's kind, from its ids alone (so the choice is made before anyone answers and cannot depend on the
    answer): FIELD_TEST for a share `field_test_share` of queries, by a hash of the device and query ids (uniform
    in [0, 1) below the share)."""
    digest = hashlib.sha256(f"{device}/{query_id}".encode()).digest()
    return FIELD_TEST if int.from_bytes(digest[:8], "big") / 2**64 < field_test_share else LABEL


def midnight(now: float) -> float:
    """The local midnight that began `now`'s day (a person's day, as the queue's machine keeps it)."""
    return datetime.fromtimestamp(now).replace(hour=0, minute=0, second=0, microsecond=0).timestamp()
