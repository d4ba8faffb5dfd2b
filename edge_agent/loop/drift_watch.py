# A device's drift watch: at each acquisition, the images that arrived since the last one against the older pool.
"""With the recipe's drift_acquisitions at N > 0, each acquisition compares the pool images that arrived since the
previous acquisition with the older pool, as the round's model scores them (edge_agent.learning.drift). On drift the
device asks only about images that arrived since the drift began, for N acquisitions, while at least a budget's
worth of them are unlabelled: the same number of labels, asked about the world the camera now sees (where the model
serves) before the older backlog. The watch lives in the device's journal, so a restart keeps it."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from edge_agent.data.device_data import DeviceData
from edge_agent.learning.drift import Seen, drift_reason
from edge_agent.learning.predict import Verdicts

log = logging.getLogger(__name__)

WATCH_KEY = "drift_watch"


@dataclass(frozen=True)
class FocusRule:
    """How many acquisitions after a drift ask only about the new images, and how many labels an acquisition asks."""

    acquisitions: int
    budget: int


@dataclass(frozen=True)
class Watch:
    """The journal's drift watch: how many images the device held at its last acquisition (-1: none yet), the
    first index of the drifted arrivals, and how many acquisitions still ask only about them."""

    seen_upto: int = -1
    since: int = 0
    left: int = 0

    @classmethod
    def from_json(cls, value: object) -> Watch:
        """The watch a journal kept (a fresh one where it kept none or something else: the watch only steers)."""
        if not isinstance(value, dict):
            return cls()
        seen_upto, since, left = (value.get(name) for name in ("seen_upto", "since", "left"))
        if type(seen_upto) is int and type(since) is int and type(left) is int:
            return cls(seen_upto, since, left)
        return cls()

    def to_json(self) -> dict[str, int]:
        """The watch as the journal keeps it."""
        return {"seen_upto": self.seen_upto, "since": self.since, "left": self.left}


def focus_of(
    watch: Watch, pool: np.ndarray, held: int, verdicts: Callable[[], Verdicts], num_classes: int, rule: FocusRule
) -> tuple[Watch, np.ndarray | None, str | None]:
    """This acquisition's step of the watch over `pool` (pool indices, ascending) on a device holding `held` images:
    the next watch, the positions in the pool the sampler may choose from (None: all of it), and the drift's reason
    where this acquisition found one. `verdicts` (the round's model over the pool) is called only where there is
    something to compare."""
    seen_upto, budget = held, rule.budget
    if watch.left > 0:
        focus = np.flatnonzero(pool >= watch.since)
        if len(focus) > budget:
            return Watch(seen_upto, watch.since, watch.left - 1), focus, None
        return Watch(seen_upto), None, None
    if watch.seen_upto < 0:
        return Watch(seen_upto), None, None
    recent, older = np.flatnonzero(pool >= watch.seen_upto), np.flatnonzero(pool < watch.seen_upto)
    if not len(recent) or not len(older):
        return Watch(seen_upto), None, None
    said = verdicts()
    reason = drift_reason(Seen.of(said, recent, num_classes), Seen.of(said, older, num_classes))
    if reason is None or len(recent) <= budget:
        return Watch(seen_upto), None, reason
    return Watch(seen_upto, watch.seen_upto, rule.acquisitions - 1), recent, reason


class DriftWatch:
    """The watch over one device's pool, kept in its journal between acquisitions and restarts."""

    def __init__(self, data: DeviceData, device_id: str) -> None:
        self.data = data
        self.device_id = device_id

    def focus(self, pool: np.ndarray, verdicts: Callable[[], Verdicts], rule: FocusRule) -> np.ndarray | None:
        """The positions of `pool` this acquisition chooses from (None: the whole pool); a found drift is logged.
        With the rule's acquisitions 0 the watch is off and the journal untouched."""
        if rule.acquisitions <= 0:
            return None
        watch = Watch.from_json(self.data.get_state(WATCH_KEY))
        held = self.data.num_samples
        after, focus, reason = focus_of(watch, pool, held, verdicts, self.data.num_classes, rule)
        if reason is not None:
            asked = "the new images" if focus is not None else "the whole pool (too few new images for the budget)"
            log.info("drift device=%s %s; asking about %s", self.device_id, reason, asked)
        self.data.set_state(WATCH_KEY, after.to_json())
        return focus
