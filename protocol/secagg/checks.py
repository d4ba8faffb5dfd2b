# The checks both sides of secure aggregation make on a stage's message: its round, its addressee, its lists.
from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from protocol.messages import RejectionKind
from protocol.secagg.errors import SecAggRefusal
from protocol.wire import shown, shown_names


def check_round(expected: int, got: int) -> None:
    """A message of another round is stale (earlier: a replay of an old round's message) or from the future."""
    if got < expected:
        raise SecAggRefusal(RejectionKind.STALE_ROUND, f"message of round {shown(got)}, this is round {expected}")
    if got > expected:
        raise SecAggRefusal(RejectionKind.FUTURE_ROUND, f"message of round {shown(got)}, this is round {expected}")


def check_stage(stage: str, expected: str, what: str) -> None:
    """A message that belongs to another stage than the one the round is in."""
    if stage != expected:
        raise SecAggRefusal(RejectionKind.WRONG_STAGE, f"{what} arrived while the round is in stage {stage!r}")


def check_addressed(own_id: str, addressee: str) -> None:
    """A message addressed to another device than the one reading it."""
    if addressee != own_id:
        raise SecAggRefusal(RejectionKind.WRONG_RECIPIENT, f"message for {shown(addressee)} reached {shown(own_id)}")


def check_pairs(names: Sequence[str], values: Sequence[object], what: str) -> None:
    """Parallel lists of names and values: as long as each other, no name twice."""
    if len(names) != len(values):
        raise SecAggRefusal(RejectionKind.UNDECODABLE, f"{what}: {len(names)} names for {len(values)} values")
    check_unique(names, what)


def check_unique(names: Sequence[str], what: str) -> None:
    """No name twice in a list (a device's second share, a peer asked twice)."""
    repeated = sorted(name for name, count in Counter(names).items() if count > 1)
    if repeated:
        raise SecAggRefusal(RejectionKind.DUPLICATE, f"{what} names {shown_names(repeated)} more than once")


def check_within(names: Sequence[str], allowed: Sequence[str], kind: RejectionKind, what: str) -> None:
    """Every name is one of the allowed ones (a share for a non-neighbour, a request for a share not held)."""
    outside = sorted(set(names) - set(allowed))
    if outside:
        raise SecAggRefusal(kind, f"{what} {shown_names(outside)}")
