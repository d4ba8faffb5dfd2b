# The central labelling queue on the wire: a device's query (its image and the model's guess), the queue's receipt of
# it, a person's answer and a correction of it, the device's receipts that each is stored, and an answer given on the
# device itself.
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from protocol.bounds import INT_RANGE, LABEL_RANGE, SCORE_RANGE, TIME_RANGE, UNIT_RANGE, within
from protocol.recipe_flags import OMITTED_KEY

# An answer's label when the person saw none of the spec's classes in the image.
NONE_OF_THESE = -1
# A query's guess when the device had no model's guess for it (another field, another meaning: never a label).
NO_GUESS = -1
# The image types a query may carry (what the device's camera folder holds, or a downscaled PNG).
QUERY_MEDIA_TYPES = ("image/png", "image/jpeg")
# Why a queue refuses a query (a QueryReceipt's `refusal`); a device sends one refused for a full queue again later.
QUERY_REFUSALS = ("too_large", "undecodable", "bad_query", "unknown_device", "device_full", "queue_full")
RETRIED_REFUSALS = ("device_full", "queue_full")


def signature_field() -> Any:
    """A secured fleet's signature on a labelling message (protocol.label_signing); left out of an open fleet's
    messages, which keep the bytes they had."""
    return field(default=b"", metadata={OMITTED_KEY: True})


# The largest query image a queue takes by default (a device does not send a larger one: it is downscaled instead).
DEFAULT_MAX_IMAGE_BYTES = 2 * 1024 * 1024


@dataclass(frozen=True)
class LabelQuery:
    """One image a device asks its fleet's people to label, on the device's queries topic (chunked like updates):
    the query's id on the device, the image as captured (or downscaled), and the model's current view of it: its
    guess (a class index, NO_GUESS when the device had none), that class's probability, the MC-dropout
    uncertainty and the sampler's score (what the queue orders by)."""

    KIND: ClassVar[str] = "label_query"
    device_id: str
    query_id: str
    image: bytes
    media_type: str
    asked_at: float = field(metadata=within(*TIME_RANGE))
    guess: int = field(default=NO_GUESS, metadata=within(*LABEL_RANGE))
    probability: float = field(default=0.0, metadata=within(*UNIT_RANGE))
    uncertainty: float = field(default=0.0, metadata=within(*UNIT_RANGE))
    score: float = field(default=0.0, metadata=within(*SCORE_RANGE))


@dataclass(frozen=True)
class QueryReceipt:
    """The queue's word to a device that a query is on disk (`queued`), or refused (`refusal`, one of
    QUERY_REFUSALS): for good, which settles the query's resends, or for now (RETRIED_REFUSALS: the queue is full),
    which leaves them running. `field_test`: the queue chose the query for the field's test set when it queued it,
    so it closes without a label for the device (its answer judges models and is never sent): the device stops
    waiting for it and never asks it again."""

    KIND: ClassVar[str] = "query_receipt"
    query_id: str
    queued: bool
    refusal: str = ""
    signature: bytes = signature_field()
    field_test: bool = field(default=False, metadata={OMITTED_KEY: True})


@dataclass(frozen=True)
class LabelAnswer:
    """A person's answer to one query, sent to its device (QoS 1, resent until the device's receipt): a class index,
    or NONE_OF_THESE; who answered and when."""

    KIND: ClassVar[str] = "label_answer"
    query_id: str
    label: int = field(metadata=within(*LABEL_RANGE))
    answered_by: str
    answered_at: float = field(metadata=within(*TIME_RANGE))
    signature: bytes = signature_field()


@dataclass(frozen=True)
class LabelCorrection:
    """A person's change of an answer the desk sent already, to its device (QoS 1, resent until the device's
    CorrectionReceipt): the query's new label (a class index, or NONE_OF_THESE), the correction's revision (1 for the
    first correction of the query, counting up, so a late copy of an older one changes nothing), who corrected it
    and when. The device's query store and its next training use the corrected label in place of the old one."""

    KIND: ClassVar[str] = "label_correction"
    query_id: str
    label: int = field(metadata=within(*LABEL_RANGE))
    revision: int = field(metadata=within(1, INT_RANGE[1]))
    corrected_by: str
    corrected_at: float = field(metadata=within(*TIME_RANGE))
    signature: bytes = signature_field()


@dataclass(frozen=True)
class CorrectionReceipt:
    """A device's word that a correction's revision is stored in its query store (or a newer one was: a stale
    revision is receipted all the same); `stored` is False when the device refused it (an unknown query)."""

    KIND: ClassVar[str] = "correction_receipt"
    device_id: str
    query_id: str
    revision: int = field(metadata=within(1, INT_RANGE[1]))
    stored: bool = True
    signature: bytes = signature_field()


@dataclass(frozen=True)
class AnswerReceipt:
    """A device's word that an answer is stored in its query store (sent only after the store is durable);
    `stored` is False when the device refused it (an unknown query), which settles it all the same."""

    KIND: ClassVar[str] = "answer_receipt"
    device_id: str
    query_id: str
    stored: bool = True
    signature: bytes = signature_field()


@dataclass(frozen=True)
class LocalAnswer:
    """A device's word that one of its queued queries was answered by another road (its own page, labels.csv): the
    queue closes the query with that answer, so nobody labels it twice."""

    KIND: ClassVar[str] = "local_answer"
    device_id: str
    query_id: str
    label: int = field(metadata=within(*LABEL_RANGE))
    road: str
    signature: bytes = signature_field()
