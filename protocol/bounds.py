# What a number on the wire may hold beyond its type: the ranges declared on message fields, which wire checks once.
from __future__ import annotations

import dataclasses
import math

from protocol.recipe_flags import FLAG_KEY

BOUNDS_KEY = "wire_bounds"  # the field metadata key protocol.wire reads
# Every integer field fits SQLite's INTEGER and numpy's int64 (msgpack also carries uint64).
INT_RANGE = (-(2**63), 2**63 - 1)
# A wall-clock time in seconds since the epoch: 0 up to the year 2242 (a clock before 1970 is a broken clock).
TIME_RANGE = (0.0, float(2**33))
# A probability, or an uncertainty normalised by log(classes).
UNIT_RANGE = (0.0, 1.0)
# A sampler's score, as a device claims it (every sampler's score is far inside this).
SCORE_RANGE = (-1e9, 1e9)
# A class index, or -1 (no guess, none of these); a spec holds far fewer classes.
LABEL_RANGE = (-1, 1 << 16)


def within(low: float, high: float) -> dict[str, tuple[float, float]]:
    """A message dataclass field's metadata (`field(metadata=within(...))`): the wire refuses its value outside
    [low, high]."""
    return {BOUNDS_KEY: (low, high)}


def bounds_of(field: dataclasses.Field) -> tuple[float, float] | None:
    """The range a field declares (`within`, or a recipe field's flag range, both ends taken as included), or None."""
    within = field.metadata.get(BOUNDS_KEY)
    if within is not None:
        return within[0], within[1]
    flag = field.metadata.get(FLAG_KEY)
    if flag is None or (flag.low is None and flag.high is None):
        return None
    return (-math.inf if flag.low is None else flag.low), (math.inf if flag.high is None else flag.high)


def clamped(value: float, within: tuple[float, float], fallback: float = 0.0) -> float:
    """An honest sender's number brought inside the range the wire checks (rounding can put an entropy a hair above
    1); `fallback` for a value that is not finite."""
    if value != value or value in (float("inf"), float("-inf")):
        return fallback
    return min(max(float(value), within[0]), within[1])
