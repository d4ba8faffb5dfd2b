# DP-FedAvg's round: the sum of clipped deltas (clipped here, or by the devices), Gaussian noise, the adaptive clip.
from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from coordinator.intake.round_aggregator import StreamingAggregator, SuspectPolicy
from coordinator.intake.scratch import TensorScratch
from coordinator.strategies.aggregate import ClientUpdate, OutOfRange
from coordinator.strategies.contract import Evaluate, StreamingWeightedAverage
from protocol.dp import (
    DP_CENTRAL,
    NOISE_NORM_SLACK,
    ROUNDING_SLACK,
    WITHIN_CLIP_METRIC,
    DpRound,
    clip_delta,
    delta_of,
    l2_norm,
    next_clip,
)
from protocol.dp_accountant import SampledGaussian
from protocol.tensors import Weights


@dataclass(frozen=True)
class DpPlan:
    """What a private round needs beyond the strategy: where the clipping and noise happen, the round's parameters
    (shared with the devices), the devices expected to contribute (q * online: the fixed denominator), the sampling
    rate, the adaptive clip's learning rate, the noise's source, the accountant's epsilon after a round event, and
    whether the round is secure (its one update is the survivors' unmasked mean, checked by secagg_bounds)."""

    placement: str
    round_dp: DpRound
    expected: float
    sampling_rate: float
    clip_lr: float
    rng: np.random.Generator
    epsilon_after: Callable[[SampledGaussian], float]
    secure: bool = False


class DpAggregator(StreamingAggregator):
    """Sums each update's clipped delta from the round's model (uniform weights) and keeps no tensor in memory; at
    the close adds the Gaussian noise (central placement; the devices added theirs otherwise), divides by the
    expected participants and steps the clip towards its quantile. The report's `dp` is the accountant's input."""

    def __init__(
        self,
        strategy: StreamingWeightedAverage,
        base: Weights,
        policy: SuspectPolicy,
        scratch: TensorScratch,
        plan: DpPlan,
        *,
        model: Weights,
        head: Weights | None = None,
    ) -> None:
        super().__init__(strategy, base, policy, scratch, model=model, head=head)
        self.plan = plan
        self.within: dict[str, float] = {}
        self.reported = 0

    def keep(self, update: ClientUpdate) -> None:
        """Adds the update's delta, clipped here (central) or checked as clipped and noised (device), to the sum; a
        secure round's one update is its survivors' mean, so their sum is its delta times their summed weight (each
        device weighs 1), and no device's within-clip bit is known (an abandoned one's is the round's own model: it
        released nothing and reports no device)."""
        delta = delta_of(update.weights, self.base)
        if self.plan.secure:
            delta = {name: np.multiply(array, update.num_samples) for name, array in delta.items()}
            self.reported += update.devices if any(np.any(array) for array in delta.values()) else 0
        else:
            delta = self.private_delta(update, delta)
            self.reported += 1
        self.running.add(update.device_id, delta, 1.0)
        self.scratch.put(update.device_id, update.weights)
        self.kept[update.device_id] = dataclasses.replace(update, weights={})

    def private_delta(self, update: ClientUpdate, delta: Weights) -> Weights:
        """One device's delta: clipped here with its within-clip bit noted (central), or checked as clipped and
        noised by the device, its bit read (device)."""
        round_dp = self.plan.round_dp
        if self.plan.placement == DP_CENTRAL:
            delta, norm = clip_delta(delta, round_dp.clip)
            self.within[update.device_id] = float(norm <= round_dp.clip)
        else:
            self.within[update.device_id] = self.device_within(update, delta)
        return delta

    def device_within(self, update: ClientUpdate, delta: Weights) -> float:
        """A device-noised update's within-clip bit; OutOfRange when its delta is too long to have been clipped to
        the round's clip, or its bit too far from {0, 1} for its share of the count's noise."""
        round_dp = self.plan.round_dp
        share = math.sqrt(max(round_dp.participants, 1.0))
        size = sum(int(np.size(array)) for array in delta.values())
        allowed = ROUNDING_SLACK * (round_dp.clip + round_dp.sum_std / share * (math.sqrt(size) + NOISE_NORM_SLACK))
        norm = l2_norm(delta)
        if norm > allowed:
            raise OutOfRange(f"the delta's norm {norm:.4g} exceeds the clip {round_dp.clip:.4g} and its noise")
        within = float(update.metrics.get(WITHIN_CLIP_METRIC, math.nan))
        if not abs(within - 0.5) <= 0.5 + NOISE_NORM_SLACK * round_dp.count_std / share:
            raise OutOfRange(f"metric {WITHIN_CLIP_METRIC!r} = {within:.4g} is not a noised 0 or 1")
        return within

    def combine(self, suspects: dict[str, list[str]], evaluate: Evaluate | None) -> tuple[Weights, dict[str, Any]]:
        """The round's model plus the noised sum of clipped deltas over the expected participants."""
        plan, round_dp = self.plan, self.plan.round_dp
        central = plan.placement == DP_CENTRAL
        sums = {name: summed.total() for name, summed in self.running.sums.items()}
        std = round_dp.sum_std if central else 0.0
        weights = dict(self.base)
        for name, total in sums.items():
            noise = plan.rng.normal(0.0, std, size=total.shape) if std > 0.0 else 0.0
            weights[name] = (self.base[name] + (total + noise) / plan.expected).astype(self.base[name].dtype)
        return weights, {"dp": self.dp_report(central), "streamed": True}

    def dp_report(self, central: bool) -> dict[str, Any]:
        """The round's privacy: its parameters, the noise multiplier actually achieved (device placement: the noise
        shares of the devices that reported; none in an abandoned secure round, which released nothing and is
        counted at full noise), the spent epsilon after it, the noised fraction within the clip (None in a secure
        round, which hides each bit) and the next round's clip."""
        plan, round_dp = self.plan, self.plan.round_dp
        reported = self.reported
        count_noise = float(plan.rng.normal(0.0, round_dp.count_std)) if central and round_dp.adaptive else 0.0
        fraction = None if plan.secure else (math.fsum(self.within.values()) + count_noise) / plan.expected
        released = reported if reported > 0 or not plan.secure else round_dp.participants
        shared = 1.0 if central else min(1.0, released / max(round_dp.participants, 1.0))
        event = SampledGaussian(plan.sampling_rate, round_dp.noise_multiplier * math.sqrt(shared))
        following = None
        if round_dp.adaptive and fraction is not None:
            following = next_clip(round_dp.clip, fraction, round_dp.quantile, plan.clip_lr)
        return {
            "placement": plan.placement,
            "clip": round_dp.clip,
            "noise_multiplier": round_dp.noise_multiplier,
            "delta_noise_multiplier": round_dp.delta_multiplier,
            "effective_noise_multiplier": event.noise_multiplier,
            "sampling_rate": plan.sampling_rate,
            "expected_participants": plan.expected,
            "reported": reported,
            "within_clip_fraction": fraction,
            "next_clip": round_dp.clip if following is None else following,
            "epsilon": plan.epsilon_after(event),
        }
