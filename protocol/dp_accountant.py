# The privacy accountant: Google's dp_accounting (RDP) composing Poisson-sampled Gaussians (DP-FedAvg rounds, DP-SGD steps).
# dp_accounting is imported by the functions that compose, so a run that asks for no DP never loads it.
from __future__ import annotations

import logging
import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import dp_accounting
    from dp_accounting.rdp import RdpAccountant

# Integer orders (and a few below 2 for large budgets): the fractional defaults make the library log convergence
# warnings for small noise, and the bound they add is at most a few percent.
ORDERS = (1.25, 1.5, 1.75, *range(2, 129), 160, 192, 256, 384, 512, 1024)
logging.getLogger("absl").setLevel(logging.ERROR)


@dataclass(frozen=True)
class SampledGaussian:
    """One release as the accountant sees it: each unit (a device in a DP-FedAvg round, an example in a DP-SGD step)
    sampled independently with probability `sampling_rate`, then a Gaussian of `noise_multiplier` (the noise actually
    added, over the clip) on the sum."""

    sampling_rate: float
    noise_multiplier: float

    def dp_event(self) -> dp_accounting.DpEvent:
        """The release as dp_accounting's event: PoissonSampled(q, Gaussian(z)), or the Gaussian alone when q = 1."""
        import dp_accounting

        gaussian = dp_accounting.GaussianDpEvent(self.noise_multiplier)
        if self.sampling_rate >= 1.0:
            return gaussian
        return dp_accounting.PoissonSampledDpEvent(self.sampling_rate, gaussian)


def epsilon_of(events: Sequence[SampledGaussian], delta: float) -> float:
    """The epsilon at `delta` of all the releases composed (RDP); 0 for none, inf when one added no noise."""
    return epsilon_of_counts(Counter(events), delta)


def epsilon_of_counts(counts: Mapping[SampledGaussian, int], delta: float) -> float:
    """The epsilon at `delta` of each release composed as many times as counted (a device's DP-SGD ledger counts
    its steps); 0 for none, inf when one taken added no noise."""
    taken = {event: count for event, count in counts.items() if count > 0}
    if not taken:
        return 0.0
    if any(event.noise_multiplier <= 0.0 for event in taken):
        return math.inf
    accountant = rdp_accountant()
    for event, count in sorted(taken.items(), key=lambda item: (item[0].sampling_rate, item[0].noise_multiplier)):
        accountant.compose(event.dp_event(), count)
    return float(accountant.get_epsilon(delta))


def noise_for_epsilon(epsilon: float, delta: float, sampling_rate: float, rounds: int) -> float:
    """The smallest noise multiplier (to 0.1%) whose `rounds` rounds at `sampling_rate` spend at most `epsilon` at
    `delta` (dp_accounting's calibration, by bisection)."""
    import dp_accounting

    return float(
        dp_accounting.calibrate_dp_mechanism(
            rdp_accountant,
            lambda noise: dp_accounting.SelfComposedDpEvent(SampledGaussian(sampling_rate, noise).dp_event(), rounds),
            epsilon,
            delta,
            dp_accounting.LowerEndpointAndGuess(0.05, 1.0),
            tol=1e-3,
        )
    )


def rdp_accountant() -> RdpAccountant:
    """A fresh RDP accountant over ORDERS."""
    from dp_accounting import rdp

    return rdp.RdpAccountant(list(ORDERS))
