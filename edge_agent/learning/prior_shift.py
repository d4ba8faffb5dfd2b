# Label-shift adaptation: a device re-weighs the serving head's classes by how its labels differ from the fleet's.
"""A camera's pool holds its own class mix; the global head is fitted for the fleet's. Where the device's human labels
differ from the fleet's labels beyond chance (a G-test at SIGNIFICANCE), the device multiplies the head's posteriors
by w_c = (n_c + a) / (n f_c + a): its label count of the class against what the fleet's label shares f_c would give
its n labels, with `a` pseudo-labels per class (ALGORITHMS.md section 7.11). Both label mixes come from the same
sampler, so its preferences cancel in the ratio; a device whose labels do not differ serves the global head as it is.
Re-estimating the prior by EM over the pool's posteriors (Saerens et al. 2002) was measured and collapsed on the
first calibrated rounds (docs/benchmarks/pooled_head)."""

from __future__ import annotations

import math

import numpy as np

LABEL_SHARES_KEY = "fleet_label_shares"  # the journal's copy of the last announcement's label shares
SIGNIFICANCE = 0.001  # the G-test's level: below it the device's label mix is taken to differ from the fleet's
PSEUDO_LABELS = 1.0  # a, per class, in both counts of the ratio


def chi2_tail(statistic: float, freedom: int) -> float:
    """P(X >= statistic) for X ~ chi-squared with `freedom` degrees of freedom, by the Wilson-Hilferty cube-root
    normal approximation (a device has no scipy): within a fifth of the tables at the 0.001 level from one degree of
    freedom up."""
    if freedom <= 0:
        return 1.0
    scale = 2.0 / (9.0 * freedom)
    z = ((max(statistic, 0.0) / freedom) ** (1.0 / 3.0) - (1.0 - scale)) / math.sqrt(scale)
    return 0.5 * math.erfc(z / math.sqrt(2.0))


def differs_from_fleet(counts: np.ndarray, fleet_shares: np.ndarray, level: float = SIGNIFICANCE) -> bool:
    """Whether the device's label counts differ from the fleet's label shares beyond chance: the G-test statistic
    2 sum n_c ln(n_c / (n f_c)) over the classes the fleet holds, against chi-squared with (those classes - 1)."""
    counts = np.asarray(counts, np.float64)
    expected = fleet_shares * counts.sum()
    held = expected > 0
    present = held & (counts > 0)
    if counts.sum() <= 0 or np.any(counts[~held] > 0):
        return bool(counts.sum() > 0)
    statistic = 2.0 * float(np.sum(counts[present] * np.log(counts[present] / expected[present])))
    return chi2_tail(statistic, int(np.count_nonzero(held)) - 1) < level


def prior_weights(counts: np.ndarray, fleet_shares: np.ndarray, pseudo_labels: float = PSEUDO_LABELS) -> np.ndarray:
    """The class weights a device's posteriors are multiplied by: (n_c + a) / (n f_c + a) where its labels differ
    from the fleet's (differs_from_fleet), else all ones. `fleet_shares` that are unknown (empty, or not summing to
    a positive number) leave the head as it is."""
    counts = np.asarray(counts, np.float64)
    shares = np.asarray(fleet_shares, np.float64)
    if len(shares) != len(counts) or not shares.sum() > 0 or not np.all(shares >= 0):
        return np.ones(len(counts))
    shares = shares / shares.sum()
    if not differs_from_fleet(counts, shares):
        return np.ones(len(counts))
    weights = (counts + pseudo_labels) / (shares * counts.sum() + pseudo_labels)
    return weights / weights.mean()


def reweighted(probabilities: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """p(c | x) w_c renormalised per row: the head's posteriors under the device's class mix."""
    shifted = np.asarray(probabilities, np.float64) * weights
    return shifted / np.maximum(np.sum(shifted, axis=-1, keepdims=True), np.finfo(np.float64).tiny)
