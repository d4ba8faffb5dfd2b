# Stream acquisition's budget: a token bucket, and a score threshold that spends it on the most uncertain arrivals.
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from protocol.errors import UsageError

SECONDS_PER_HOUR = 3600.0


@dataclass(frozen=True)
class BudgetSettings:
    """labels_per_hour: the long-run rate; burst: most labels asked at once; window: recent scores remembered.

    Until min_history scores have been seen the threshold is off and only the bucket limits asking.
    """

    labels_per_hour: float
    burst: float
    window: int = 200
    min_history: int = 10

    def __post_init__(self) -> None:
        if not (self.labels_per_hour > 0 and math.isfinite(self.labels_per_hour)):
            raise UsageError(f"labels per hour must be a positive number, got {self.labels_per_hour}")
        if not self.burst >= 1:
            raise UsageError(f"the label burst must be at least 1, got {self.burst}")
        if self.window < 2 or not 1 <= self.min_history <= self.window:
            raise ValueError(f"need window >= 2 and 1 <= min_history <= window, got {self.window}, {self.min_history}")


def default_burst(labels_per_hour: float) -> float:
    """A quarter of an hour's budget, at least one label."""
    return max(1.0, labels_per_hour / 4.0)


@dataclass(frozen=True)
class BudgetState:
    """The bucket's tokens at updated_at (wall-clock seconds) and the recent scores with their arrival times."""

    tokens: float
    updated_at: float
    scores: tuple[float, ...] = ()
    times: tuple[float, ...] = ()

    def to_json(self) -> dict[str, Any]:
        """A JSON-able form, for the agent's persisted state."""
        return {
            "tokens": self.tokens,
            "updated_at": self.updated_at,
            "scores": list(self.scores),
            "times": list(self.times),
        }

    @classmethod
    def from_json(cls, value: Any) -> BudgetState:
        """Reads to_json's form back; ValueError if it is not that."""
        try:
            state = cls(
                float(value["tokens"]),
                float(value["updated_at"]),
                tuple(float(s) for s in value["scores"]),
                tuple(float(t) for t in value["times"]),
            )
        # float() raises ValueError for a malformed saved budget: the journal's damage, named
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"not a stream budget state: {value!r} ({exc})") from exc
        if len(state.scores) != len(state.times):
            raise ValueError("stream budget state: scores and times differ in length")
        return state


def start_state(settings: BudgetSettings, now: float) -> BudgetState:
    """A full bucket and no history."""
    return BudgetState(settings.burst, now)


def refill(tokens: float, elapsed: float, settings: BudgetSettings) -> float:
    """Tokens after elapsed seconds at labels_per_hour, capped at the burst (time running backwards adds nothing)."""
    return min(settings.burst, tokens + max(0.0, elapsed) * settings.labels_per_hour / SECONDS_PER_HOUR)


def query_fraction(times: np.ndarray, labels_per_hour: float) -> float:
    """The share of arrivals the budget can label: budget rate over the recent arrival rate, within [0, 1]."""
    if len(times) < 2:
        return 1.0
    span = float(times[-1] - times[0])
    if span <= 0.0:
        return 0.0
    arrivals_per_hour = (len(times) - 1) / span * SECONDS_PER_HOUR
    return min(1.0, labels_per_hour / arrivals_per_hour)


def score_threshold(scores: np.ndarray, times: np.ndarray, settings: BudgetSettings) -> float:
    """The score an arrival needs: the (1 - fraction) quantile of recent scores; -inf while the history is short."""
    if len(scores) < settings.min_history:
        return -math.inf
    return float(np.quantile(scores, 1.0 - query_fraction(times, settings.labels_per_hour)))


def decide(state: BudgetState, score: float, now: float, settings: BudgetSettings) -> tuple[bool, BudgetState]:
    """Whether to ask for a label of an arrival with this score at time now, and the state after it."""
    tokens = refill(state.tokens, now - state.updated_at, settings)
    threshold = score_threshold(np.asarray(state.scores), np.asarray(state.times), settings)
    query = score >= threshold and tokens >= 1.0
    after = BudgetState(
        tokens - (1.0 if query else 0.0),
        max(now, state.updated_at),
        (state.scores + (float(score),))[-settings.window :],
        (state.times + (now,))[-settings.window :],
    )
    return query, after
