# The serving version's history in the run's SQLite: which committed round's model devices predict with, each change.
from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from coordinator.storage.database import Database

PROMOTED = "promoted"  # the round's model serves from now on
HELD = "held"  # a committed round that does not serve: it stays a training model (the reason says why)
ROLLED_BACK = "rolled_back"  # the version that served before the round's model serves again
GATE = "gate"  # decided by the coordinator's promotion gate after the round committed
PERSON = "person"  # asked for with `fl-coordinator promote` or `rollback`
MAX_REASON = 300  # a stored reason's characters at most


@dataclass(frozen=True)
class ServingDecision:
    """What is decided about one round: promoted, held or rolled back (`round_id`: the round rolled back from),
    why, and who decided (the gate or a person)."""

    round_id: int
    decision: str
    reason: str
    who: str


@dataclass(frozen=True)
class ServingEvent:
    """A stored decision with the version serving after it (`serving`: a round id, 0 for W0) and when it was made."""

    round_id: int
    decision: str
    serving: int
    reason: str
    who: str
    recorded_at: float


def serving_stack(decisions: Sequence[ServingDecision | ServingEvent]) -> list[int]:
    """The versions that served, oldest first, the one serving now last: W0 (0) at the bottom, each promotion of
    another round pushes it, each rollback pops the top (W0 is never popped)."""
    stack = [0]
    for each in decisions:
        if each.decision == PROMOTED and each.round_id != stack[-1]:
            stack.append(each.round_id)
        elif each.decision == ROLLED_BACK and len(stack) > 1:
            stack.pop()
    return stack


# What the history's writer asks of a decision maker: given the versions that served (serving_stack), the decision
# to store, or None for none; read and written in one transaction.
Decide = Callable[[list[int]], ServingDecision | None]


class ServingHistory:
    """The `serving` table of a run's store: every decision in the order it was made, the serving version derived
    from them. Written by the running coordinator (its gate) and by a person's command in another process."""

    def __init__(self, database: Database) -> None:
        self.database = database

    def present(self) -> bool:
        """Whether the store has the table (a store written before serving versions, opened read-only, has not)."""
        return bool(self.database.read("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'serving'"))

    def events(self) -> list[ServingEvent]:
        """Every decision, oldest first (none in a store without the table)."""
        if not self.present():
            return []
        rows = self.database.read(
            "SELECT round_id, decision, serving, reason, who, recorded_at FROM serving ORDER BY id"
        )
        return [ServingEvent(*row) for row in rows]

    def serving_version(self) -> int:
        """The round whose model serves now (0: W0)."""
        return serving_stack(self.events())[-1]

    def last_change(self) -> ServingEvent | None:
        """The latest decision that changed what serves (a promotion or a rollback), None while W0 serves unchanged."""
        return next((event for event in reversed(self.events()) if event.decision != HELD), None)

    def undecided_rounds(self) -> list[int]:
        """The committed rounds the gate has not decided on yet, in order (a restart after a round committed but
        before its decision was stored, or a store written before serving versions existed)."""
        rows = self.database.read(
            "SELECT round_id FROM rounds WHERE round_id NOT IN (SELECT round_id FROM serving WHERE who = ?) "
            "ORDER BY round_id",
            (GATE,),
        )
        return [int(row[0]) for row in rows]

    def record(self, decide: Decide) -> ServingEvent | None:
        """Stores what `decide` makes of the versions that served, read and written in one transaction (a person's
        command and the coordinator's gate cannot interleave); returns the stored event, None if it stored none.
        An exception `decide` raises (a person's bad request) stores nothing and propagates."""
        stored: list[ServingEvent] = []

        def statements(read: Callable[..., list[tuple]]) -> list[tuple[str, tuple]]:
            rows = read("SELECT round_id, decision, serving, reason, who, recorded_at FROM serving ORDER BY id")
            events = [ServingEvent(*row) for row in rows]
            decision = decide(serving_stack(events))
            if decision is None:
                return []
            serving = serving_stack([*events, decision])[-1]
            event = ServingEvent(
                int(decision.round_id),
                decision.decision,
                serving,
                decision.reason[:MAX_REASON],
                decision.who,
                time.time(),
            )
            stored.append(event)
            insert = (
                "INSERT INTO serving (round_id, decision, serving, reason, who, recorded_at) VALUES (?, ?, ?, ?, ?, ?)"
            )
            return [
                (insert, (event.round_id, event.decision, event.serving, event.reason, event.who, event.recorded_at))
            ]

        self.database.write_after_reading(statements)
        return stored[0] if stored else None
