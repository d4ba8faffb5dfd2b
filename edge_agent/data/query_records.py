# A device's queries and answers as values: a query asked, the roads an answer comes by, what a delivery does
# (pure: `delivery_of`).
from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

from edge_agent.data.oracle import Guess

# An answer's label when the person saw none of the classes (the wire's protocol.label_messages.NONE_OF_THESE).
DECLINED = -1


@dataclass(frozen=True)
class Query:
    """One image shown to a person: its copy (`<round>/<name>` under queries/), round, pool index, origin, when it
    was asked and the model's guess then (None: the device had none, or the query predates guesses being kept)."""

    file: str
    round_id: int
    index: int
    sha256: str
    source: str
    asked_at: float
    guess: Guess | None = None

    @property
    def name(self) -> str:
        """The copy's file name, unique across rounds: what labels.csv refers to."""
        return Path(self.file).name

    @property
    def query_id(self) -> str:
        """The query's key in the store and on the wire: its copy's name without the suffix."""
        return Path(self.file).stem

    def row(self) -> tuple:
        """The query as the store's columns (QUERY_COLUMNS)."""
        guess = (None, None, None, None) if self.guess is None else tuple(vars(self.guess).values())
        return (self.file, self.round_id, self.index, self.sha256, self.source, self.asked_at, *guess)


def query_of(row: tuple) -> Query:
    """A Query from the store's columns (QUERY_COLUMNS)."""
    file, round_id, index, sha256, source, asked_at, *guess = row
    held = None if guess[0] is None else Guess(int(guess[0]), float(guess[1]), float(guess[2]), float(guess[3]))
    return Query(str(file), int(round_id), int(index), str(sha256), str(source), float(asked_at), held)


class Road(StrEnum):
    """The roads an answer reaches a device by; each only delivers to the query store."""

    PAGE = "page"  # the device's own label page
    LABELS_CSV = "labels.csv"  # a person's or a labelling tool's file in the oracle folder
    CENTRAL = "central"  # the coordinator's labelling queue


class LabelKind(StrEnum):
    """What a person's word on a query is: its first answer, or a correction of the answer it holds."""

    ANSWER = "answer"
    CORRECTION = "correction"


class Delivery(StrEnum):
    """What a delivery did: stored the first answer, found the same label held, found another answer held (the
    first answer stays: a second answer is never applied), corrected the label held, or found a newer correction
    held (a late copy of an older revision changes nothing)."""

    STORED = "stored"
    SAME = "same"
    CONFLICT = "conflict"
    CORRECTED = "corrected"
    STALE = "stale"


@dataclass(frozen=True)
class StoredAnswer:
    """One answer as the book keeps it."""

    query_id: str
    label: int
    road: str
    answered_by: str
    answered_at: float


def stored_answers(rows: list[tuple]) -> list[StoredAnswer]:
    """Rows of (query id, label, road, who, when) as StoredAnswers."""
    return [StoredAnswer(str(q), int(label), str(road), str(who), float(at)) for q, label, road, who, at in rows]


@dataclass(frozen=True)
class Held:
    """What the book holds of one query inside a delivery's transaction: its first answer's label and its latest
    correction's label and central revision (None where there is none)."""

    answer: int | None
    correction: int | None
    revision: int

    @property
    def current(self) -> int | None:
        """The label the query carries now (its correction's, else its answer's)."""
        return self.correction if self.correction is not None else self.answer


def delivery_of(held: Held, label: int, kind: LabelKind, road: Road, revision: int) -> Delivery:
    """What delivering `label` does to a query holding `held` (pure): the first answer is stored and stays; a
    correction replaces the label held unless it is a central revision no newer than one seen."""
    if held.current is None:
        return Delivery.STORED
    stale_revision = road is Road.CENTRAL and held.correction is not None and revision <= held.revision
    if held.current == label:
        return Delivery.SAME
    if kind is LabelKind.ANSWER or stale_revision:
        return Delivery.STALE if held.correction is not None else Delivery.CONFLICT
    return Delivery.CORRECTED
