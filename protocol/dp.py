# Differential privacy's shared math (DP-FedAvg, adaptive clipping): clip a delta, Gaussian noise, the clip's update.
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from protocol.messages import RoundAnnouncement
from protocol.tensors import Weights

DP_OFF = "off"
DP_CENTRAL = "central"  # the coordinator clips each delta and noises the sum (a trusted coordinator)
DP_DEVICE = "device"  # each device clips its own delta and adds its share of the noise
DP_PLACEMENTS = (DP_OFF, DP_CENTRAL, DP_DEVICE)
WITHIN_CLIP_METRIC = "dp_within_clip"  # device placement: 1 if the delta was within the clip, plus its noise share
DP_SGD_EPSILON_METRIC = "dp_sgd_epsilon"  # a DP-SGD device: example-level epsilon of all its steps so far
COUNT_NOISE_DIVISOR = 20.0  # Andrew et al. 2021: the clipped count's noise std is the expected participants / 20
# Device placement: a delta (or a secure round's sum of them) that exceeds the clip by more than this many stds of its
# noise's norm (and the float32 and fp16 rounding of what was sent, ROUNDING_SLACK) was not clipped, and is refused.
NOISE_NORM_SLACK = 6.0
ROUNDING_SLACK = 1.01


def delta_of(weights: Weights, base: Weights) -> Weights:
    """The update minus the round's model (float64), over the tensors the update carries (never the whole model)."""
    return {name: np.subtract(array, base[name], dtype=np.float64) for name, array in weights.items()}


def l2_norm(tensors: Weights) -> float:
    """The L2 norm of all tensors taken together."""
    return math.sqrt(math.fsum(float(np.sum(np.square(array, dtype=np.float64))) for array in tensors.values()))


def clip_delta(delta: Weights, clip: float) -> tuple[Weights, float]:
    """(the delta scaled to L2 norm <= clip over all its tensors together, its norm before clipping)."""
    norm = l2_norm(delta)
    scale = min(1.0, clip / norm) if norm > 0.0 else 1.0
    return {name: np.multiply(array, scale) for name, array in delta.items()}, norm


def gaussian_noise(like: Weights, std: float, rng: np.random.Generator) -> Weights:
    """Independent N(0, std^2) float64 noise of each tensor's shape."""
    return {name: rng.normal(0.0, std, size=np.shape(array)) for name, array in like.items()}


def noised(tensors: Weights, std: float, rng: np.random.Generator) -> Weights:
    """The tensors plus N(0, std^2) noise on every entry (float64)."""
    noise = gaussian_noise(tensors, std, rng)
    return {name: np.add(array, noise[name], dtype=np.float64) for name, array in tensors.items()}


def count_noise_std(participants: float, noise_multiplier: float) -> float:
    """The std of the noise on the count of deltas within the clip: Andrew et al. 2021's n / 20, and at least z, so
    that the count never takes more than a seventh of the deltas' noise (z_D <= 1.155 z) in a small round."""
    return max(participants / COUNT_NOISE_DIVISOR, noise_multiplier)


def delta_noise_multiplier(noise_multiplier: float, count_std: float) -> float:
    """The deltas' noise multiplier z_D when the clipped count is noised with std count_std, so that both releases
    together cost what one Gaussian of multiplier z does: z_D = (z^-2 - (2 count_std)^-2)^(-1/2) (Andrew et al.
    2021, Thm. 1); ValueError when the count's noise is too small to leave any budget for the deltas."""
    remaining = noise_multiplier**-2 - (2.0 * count_std) ** -2
    if remaining <= 0.0:
        raise ValueError(
            f"noise multiplier {noise_multiplier:g} is too small for adaptive clipping with a count noise of "
            f"{count_std:g}; raise --dp-noise-multiplier or sample more devices per round"
        )
    return remaining**-0.5


def next_clip(clip: float, within_fraction: float, quantile: float, learning_rate: float) -> float:
    """Andrew et al. 2021's geometric step towards the target quantile of the norms:
    C <- C * exp(-eta * (b - gamma)), b the (noised) fraction of deltas within the clip."""
    return clip * math.exp(-learning_rate * (within_fraction - quantile))


@dataclass(frozen=True)
class DpRound:
    """One round's DP parameters as both sides compute them: the clip, the noise multiplier z, the target quantile
    (0: a fixed clip) and how many participants share the noise (`participants`)."""

    clip: float
    noise_multiplier: float
    quantile: float
    participants: float

    @classmethod
    def announced(cls, announcement: RoundAnnouncement) -> DpRound:
        """The round's parameters as a device reads them from its announcement (the participants share the noise)."""
        recipe = announcement.recipe
        return cls(recipe.dp_clip, recipe.dp_noise_multiplier, recipe.dp_clip_quantile, len(announcement.participants))

    @property
    def adaptive(self) -> bool:
        """Whether the clip follows a quantile of the norms (which spends part of the noise on the count)."""
        return self.quantile > 0.0

    @property
    def count_std(self) -> float:
        """The std of the noise on the count of deltas within the clip (0 for a fixed clip)."""
        return count_noise_std(self.participants, self.noise_multiplier) if self.adaptive else 0.0

    @property
    def delta_multiplier(self) -> float:
        """The deltas' noise multiplier: z, or less what the clipped count spends of it (adaptive clipping)."""
        if not self.adaptive or self.noise_multiplier == 0.0:
            return self.noise_multiplier
        return delta_noise_multiplier(self.noise_multiplier, self.count_std)

    @property
    def sum_std(self) -> float:
        """The std of the Gaussian noise on the sum of clipped deltas: z_D * C."""
        return self.delta_multiplier * self.clip


def device_share(std: float, participants: int) -> float:
    """One device's share of noise of std `std` on a sum of `participants` devices: std / sqrt(n), so that n shares
    add up to N(0, std^2)."""
    return std / math.sqrt(max(participants, 1))


def privatised(weights: Weights, base: Weights, round_dp: DpRound, rng: np.random.Generator) -> tuple[Weights, float]:
    """The device placement: (the round's model plus the device's clipped delta and its share of the noise, in the
    weights' dtypes; the within-clip bit plus its share of the count's noise). Nothing un-noised leaves the device
    when the noise multiplier is positive."""
    clipped, norm = clip_delta(delta_of(weights, base), round_dp.clip)
    share = int(round_dp.participants)
    delta = noised(clipped, device_share(round_dp.sum_std, share), rng)
    private = {name: (base[name] + delta[name]).astype(np.asarray(array).dtype) for name, array in weights.items()}
    within = float(norm <= round_dp.clip) + float(rng.normal(0.0, device_share(round_dp.count_std, share)))
    return private, within
