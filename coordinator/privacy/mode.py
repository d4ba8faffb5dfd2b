# The private round mode: each round's Poisson sample, its DP aggregator and clip, the budget that ends the run.
from __future__ import annotations

from typing import Any

from coordinator.privacy.rounds import DpSettings, PrivateRounds
from coordinator.rounds.mode import Opening, RoundMode, RoundPlan
from coordinator.rounds.rules import RoundRules
from coordinator.storage.store import RunStore
from coordinator.strategies.contract import Strategy
from protocol import messages


class PrivateMode(RoundMode):
    """Rounds of a private run (DP-FedAvg): the loop's plan is PrivateRounds' (its sample, its aggregator, the clip
    as adapted so far), the run stops before the round that would exceed the budget, and a private round waits for
    one device online (its sample and noise shares are drawn from them: an empty fleet cannot mean everyone)."""

    def __init__(self, privacy: PrivateRounds) -> None:
        self.privacy = privacy

    @classmethod
    def of_store(cls, store: RunStore, recipe: messages.Recipe, rate: float, settings: DpSettings) -> PrivateMode:
        """The private mode as the run's committed rounds left it."""
        return cls(PrivateRounds.of_store(store, recipe, rate, settings))

    def exhausted(self, round_id: int) -> bool:
        """Whether running round_id would spend more than the budget."""
        return self.privacy.exhausted(round_id)

    def fewest_online(self, rules: RoundRules) -> int:
        """One: the sample is drawn from the devices online."""
        return 1

    def plan(self, rules: RoundRules, strategy: Strategy, opening: Opening) -> RoundPlan:
        """The round's Poisson sample, its DP aggregator and the recipe with the clip as adapted so far."""
        participants = self.privacy.participants(opening.online, rules.recipe.seed, opening.round_id)
        sampled = (len(opening.online), len(participants))
        base, scratch = opening.base, opening.scratch
        aggregator = self.privacy.aggregator(
            strategy, base, rules.suspects, scratch, sampled, model=opening.model, head=opening.head
        )
        return RoundPlan(aggregator, participants, self.privacy.round_recipe(rules.recipe))

    def committed(self, report: dict[str, Any]) -> None:
        """Takes in the committed round's DP report (the accountant's event, the next clip)."""
        self.privacy.committed(report["dp"])
