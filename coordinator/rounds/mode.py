# The round loop's one seam to a run's mode: how a round is planned, whether it runs stages of its own, what its
# commit tells the mode. This module's RoundMode is the plain mode; the assembly chooses a private or secure one.
from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from coordinator.intake.round_aggregator import RoundAggregator, make_aggregator
from coordinator.intake.scratch import TensorScratch
from coordinator.intake.update_intake import RoundCollector
from coordinator.rounds.rules import RoundRules, sample_bounds
from coordinator.strategies.contract import Strategy
from protocol import messages
from protocol.model_spec import ModelSpec
from protocol.tensors import Weights

log = logging.getLogger(__name__)


class StagedRound(Protocol):
    """A round collected in stages of its own (a secure round's) instead of from plain updates: what the loop asks
    of it while the round is open."""

    def on_message(self, device_id: str, payload: bytes) -> None:
        """A device's stage message for this round."""

    def collect(self, handle_next: Callable[[], None], stage_timeout: float) -> Any:
        """Runs the stages (handling messages through `handle_next`) until done or abandoned; their result."""

    def conclude(self, result: Any, collector: RoundCollector, aggregator: RoundAggregator, spec: ModelSpec) -> None:
        """Hands the stages' result to the round's collector and aggregator."""

    def commit(self) -> None:
        """Makes the stages' state durable (with the spool's group commit)."""

    def metrics(self) -> dict[str, Any]:
        """The stages' figures for the round's record."""


@dataclass(frozen=True)
class Opening:
    """What the loop knows as a round opens: its id, what its updates carry at no change (`base`: the trained set of
    the round's `model`, or zero statistics), the scratch its updates' weights wait in until it closes, the devices
    online (sorted) and the model's trained set (`head`, which a statistics strategy fits; None: `base` is it)."""

    round_id: int
    base: Weights
    model: Weights
    scratch: TensorScratch
    online: list[str]
    head: Weights | None = None


@dataclass(frozen=True)
class RoundPlan:
    """How a round opens: its aggregator, its participants ([] = all online) and the recipe it announces."""

    aggregator: RoundAggregator
    participants: list[str]
    recipe: messages.Recipe


def choose_participants(online: Sequence[str], participation: float, seed: int, round_id: int) -> list[str]:
    """KAFAL's S_t: a seeded random ceil(R*K) of the K online devices, sorted; [] (everyone) when R = 1."""
    if participation >= 1.0 or not online:
        return []
    count = math.ceil(participation * len(online))
    rng = np.random.default_rng([seed, round_id])
    return sorted(rng.choice(sorted(online), size=count, replace=False).tolist())


class RoundMode:
    """A run's round mode as the round loop sees it. This base is the plain mode: the strategy's own aggregator, a
    seeded share of the online devices (or all), the run's recipe, no stages; the private and secure modes (in
    their rooms) override what they change, so the loop never imports them."""

    def exhausted(self, round_id: int) -> bool:
        """Whether the run stops before this round (a private run's budget); plain rounds never do."""
        return False

    def fewest_online(self, rules: RoundRules) -> int:
        """The devices a round waits for before it opens; plain rounds wait for none (no one online: everyone)."""
        return 0

    def plan(self, rules: RoundRules, strategy: Strategy, opening: Opening) -> RoundPlan:
        """The round's aggregator, participants and recipe; a claim's share of the weight is capped only where no
        per-device bound is known."""
        round_id = opening.round_id
        share = rules.max_sample_share if sample_bounds(rules, strategy, round_id)[1] is None else 1.0
        aggregator = make_aggregator(
            strategy, opening.base, rules.suspects, opening.scratch, share, model=opening.model, head=opening.head
        )
        participants = choose_participants(opening.online, rules.policy.participation, rules.recipe.seed, round_id)
        return RoundPlan(aggregator, participants, rules.recipe)

    def staged(
        self, rules: RoundRules, run_id: str, round_id: int, model: Weights, selected: list[str]
    ) -> StagedRound | None:
        """The round's own stages over the `selected` devices, or None: plain updates make the round."""
        return None

    def hold(self, device_id: str, payload: bytes) -> None:
        """A stage message that came while no round is open: plain rounds have no stages to hold it for."""
        log.warning("secure-round message outside a secure round device=%s", device_id)

    def committed(self, report: dict[str, Any]) -> None:
        """A round of this mode was committed with this report (plain rounds keep nothing of it)."""
