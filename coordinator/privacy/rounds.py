# A private run's rounds: what DP refuses at start-up, Poisson sampling, each round's DP plan, the spent budget.
from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from coordinator.intake.round_aggregator import SuspectPolicy
from coordinator.intake.scratch import TensorScratch
from coordinator.privacy.dp_aggregator import DpAggregator, DpPlan
from coordinator.storage.store import RunStore
from coordinator.strategies.contract import Strategy, streams
from coordinator.strategies.registry import STRATEGIES
from protocol import messages
from protocol.dp import DP_CENTRAL, DP_DEVICE, DP_OFF, DpRound
from protocol.dp_accountant import SampledGaussian, epsilon_of
from protocol.errors import UsageError
from protocol.tensors import Weights

log = logging.getLogger(__name__)

DP_STRATEGY = "avefl"  # DP-FedAvg's uniform mean of clipped deltas; besides statistics strategies (the uniform mean of
# clipped statistics, then their fit), every other strategy is refused (docs say why)
POISSON_STREAM = 0xD9  # the sampling draw's own stream of the run seed, apart from choose_participants'


@dataclass(frozen=True)
class DpSettings:
    """The run's privacy beyond what the recipe tells devices: the delta epsilon is reported at, and the epsilon
    budget a run stops before exceeding (None: no budget, the epsilon is only reported)."""

    delta: float = 1e-5
    epsilon_budget: float | None = None


def check_dp_settings(
    recipe: messages.Recipe, strategy: str, suspects: SuspectPolicy, asynchronous: bool, dp: DpSettings
) -> None:
    """One-line UsageError, naming the conflict, for what a private run cannot run with."""
    if recipe.dp == DP_OFF:
        if dp.epsilon_budget is not None:
            raise UsageError("--dp-epsilon-budget needs --dp central or --dp device")
        return
    where = f"--dp {recipe.dp}"
    if strategy != DP_STRATEGY and not (strategy in STRATEGIES and STRATEGIES.get(strategy).statistics):
        raise UsageError(
            f"{where} cannot run with --strategy {strategy}: DP-FedAvg is the uniform mean of clipped deltas "
            f"(--strategy {DP_STRATEGY}, or pooled-head over clipped statistics); a strategy that picks, weighs, ranks "
            "or steps on single updates breaks it"
        )
    if suspects.exclude:
        raise UsageError(f"{where} cannot run with --exclude-suspects: leaving one device out depends on the others")
    if asynchronous:
        raise UsageError(f"{where} cannot run with --mode async: the accountant needs sampled synchronous rounds")
    if recipe.dp_clip <= 0.0:
        raise UsageError(f"--dp-clip must be positive, got {recipe.dp_clip:g}")
    if not 0.0 < dp.delta < 1.0 or (dp.epsilon_budget is not None and dp.epsilon_budget <= 0.0):
        raise UsageError(f"--dp-delta must lie in (0, 1) and --dp-epsilon-budget be positive, got {dp.delta:g}")
    if recipe.dp == DP_DEVICE and (recipe.update_encoding == "int8-delta" or recipe.update_top_k > 0.0):
        raise UsageError("--dp device cannot send int8 or top-k deltas (their rounding can pass the clip); use fp16")


def poisson_sample(online: Sequence[str], rate: float, seed: int, round_id: int) -> list[str]:
    """Each online device independently with probability `rate` (seeded by the run and round), sorted; an empty
    draw is drawn again (probability (1 - q)^N, negligible in a fleet, conditioned away here)."""
    devices = sorted(online)
    if rate >= 1.0 or not devices:
        return devices
    for attempt in range(1000):
        rng = np.random.default_rng([seed, round_id, POISSON_STREAM, attempt])
        chosen = [device for device, draw in zip(devices, rng.random(len(devices))) if draw < rate]
        if chosen:
            return chosen
    return devices[:1]


class PrivateRounds:
    """A private run across its rounds: the clip (adapted after each round), the events the accountant composes
    (rebuilt from the committed rounds' reports, so a restart continues them) and the budget."""

    def __init__(self, recipe: messages.Recipe, rate: float, settings: DpSettings, history: Sequence[dict]) -> None:
        self.recipe = recipe
        self.rate = rate
        self.settings = settings
        self.events = [
            SampledGaussian(entry["sampling_rate"], entry["effective_noise_multiplier"]) for entry in history
        ]
        self.clip = float(history[-1]["next_clip"]) if history else recipe.dp_clip
        self.rng = np.random.default_rng()  # fresh entropy: noise nobody predicts from the recipe's public seed

    @classmethod
    def of_store(cls, store: RunStore, recipe: messages.Recipe, rate: float, settings: DpSettings) -> PrivateRounds:
        """The run's privacy as its committed rounds left it."""
        return cls(recipe, rate, settings, [record.report["dp"] for record in store.rounds() if "dp" in record.report])

    def spent(self) -> float:
        """The epsilon (at the run's delta) of every committed round."""
        return epsilon_of(self.events, self.settings.delta)

    def epsilon_after(self, event: SampledGaussian) -> float:
        """The epsilon once one more round, `event`, is composed."""
        return epsilon_of([*self.events, event], self.settings.delta)

    def exhausted(self, round_id: int) -> bool:
        """Whether running round_id at full noise would spend more than the budget (logged when it would)."""
        budget = self.settings.epsilon_budget
        if budget is None:
            return False
        following = self.epsilon_after(SampledGaussian(self.rate, self.recipe.dp_noise_multiplier))
        if following <= budget:
            return False
        log.warning(
            "privacy budget reached: stopping before round %d, which would spend epsilon %.4g > budget %.4g "
            "(spent %.4g at delta %g)",
            *(round_id, following, budget, self.spent(), self.settings.delta),
        )
        return True

    def round_recipe(self, recipe: messages.Recipe) -> messages.Recipe:
        """The recipe devices get this round: the run's, with the clip as adapted so far."""
        return dataclasses.replace(recipe, dp_clip=self.clip)

    def participants(self, online: Sequence[str], seed: int, round_id: int) -> list[str]:
        """This round's Poisson sample of the online devices (always named, so devices know how many share the
        noise)."""
        return poisson_sample(online, self.rate, seed, round_id)

    def aggregator(
        self,
        strategy: Strategy,
        base: Weights,
        policy: SuspectPolicy,
        scratch: TensorScratch,
        sampled: tuple[int, int],
        *,
        model: Weights,
        head: Weights | None = None,
    ) -> DpAggregator:
        """The round's DP aggregator over the trained set `base` of the round's `model`: `sampled` = (online devices
        sampled at the run's rate, devices drawn)."""
        online, chosen = sampled
        if not streams(strategy):
            raise ValueError(f"strategy {strategy.name!r} does not fold updates as they arrive")
        central = self.recipe.dp == DP_CENTRAL
        expected = max(self.rate * online, 1.0)
        round_dp = DpRound(
            self.clip, self.recipe.dp_noise_multiplier, self.recipe.dp_clip_quantile, expected if central else chosen
        )
        secure = self.recipe.secure_aggregation != "off"
        plan = DpPlan(
            self.recipe.dp, round_dp, expected, self.rate, self.recipe.dp_clip_lr, self.rng, self.epsilon_after, secure
        )
        return DpAggregator(strategy, base, policy, scratch, plan, model=model, head=head)

    def committed(self, report: dict[str, Any]) -> None:
        """Takes in a committed round's DP report: its event for the accountant, the next round's clip."""
        self.events.append(SampledGaussian(report["sampling_rate"], report["effective_noise_multiplier"]))
        self.clip = float(report["next_clip"])
        if not math.isfinite(self.clip) or self.clip <= 0.0:
            raise ValueError(f"the adaptive clip left the positive numbers: {self.clip!r}")
