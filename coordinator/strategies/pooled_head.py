# The pooled head: a linear classifier fitted from the fleet's summed class statistics (shrunk LDA), not averaged.
from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from coordinator.strategies.aggregate import ClientUpdate
from coordinator.strategies.contract import StreamingWeightedAverage
from coordinator.strategies.means import FedAvg
from protocol.head_statistics import SCALE, TEMPERATURES, HeadStatistics
from protocol.options import Option
from protocol.tensors import Weights
from protocol.trained_set import head_shape

CLASS_SHARES = "class_shares"  # the fit's report: the fleet's human labels per class as shares
POOL_LABELS = 400.0  # the pools' posterior sums weigh as much as 400 labels together (measured: section 7.10)
UNSEEN_BIAS = -1e4  # the bias of a class no label holds yet: its mean is unknown, so the head never predicts it


def pool_refinement(report: Mapping[str, Any]) -> float | None:
    """The weight the pools' posteriors refined a round's fit with, as its report records it; None for a round they
    did not refine (or a report of another strategy)."""
    return float(report["pool_weight"]) if report.get("pool_refined") else None


def class_means(statistics: HeadStatistics) -> tuple[np.ndarray, np.ndarray]:
    """(means (C, D) of the scaled features, a mask of the classes that hold a label); an unseen class's row is 0."""
    seen = statistics.class_counts > 0
    means = np.zeros_like(statistics.class_sums)
    means[seen] = statistics.class_sums[seen] / statistics.class_counts[seen, None]
    return means, seen


def pool_refined_means(statistics: HeadStatistics, pool_weight: float) -> np.ndarray:
    """The class means with the pools' posterior sums added at `pool_weight` times the labels' weight (the fleet's
    pool mean weighs pool_weight as much as all its labels): (sums_c + w P_c) / (counts_c + w M_c), one EM step of
    the shared-covariance Gaussian mixture from the head that gave the posteriors; a class no label holds stays 0."""
    seen = statistics.class_counts > 0
    sums = statistics.class_sums + pool_weight * statistics.pool_sums
    mass = statistics.class_counts + pool_weight * statistics.pool_mass
    means = np.zeros_like(statistics.class_sums)
    means[seen] = sums[seen] / mass[seen, None]
    return means


def shared_covariance(statistics: HeadStatistics, means: np.ndarray, shrinkage: float) -> np.ndarray:
    """The within-class covariance of the labelled rows, E[x x^T] - sum_c p_c mu_c mu_c^T, its eigenvalues floored at
    0 (noise from device DP can make it indefinite), shrunk towards its mean variance times the identity:
    (1 - shrinkage) S + shrinkage tr(S) / D I (Friedman's regularised discriminant analysis)."""
    weighted = means * statistics.class_counts[:, None]
    within = statistics.second_moment - means.T @ weighted
    values, vectors = np.linalg.eigh((within + within.T) / 2)
    values = np.maximum(values, 0.0)
    floor = shrinkage * float(np.mean(values))
    if not floor > 0.0:
        floor = 1e-6
    return (vectors * ((1.0 - shrinkage) * values + floor)) @ vectors.T


def lda_head(statistics: HeadStatistics, shrinkage: float, pool_weight: float = 0.0) -> tuple[np.ndarray, np.ndarray]:
    """Linear discriminant analysis over the statistics with equal class priors (the balanced head a logit-adjusted
    loss aims at): w_c = S^-1 mu_c and b_c = -mu_c^T S^-1 mu_c / 2, on unscaled features; a class no label holds
    gets a zero row and UNSEEN_BIAS. With a pool weight the means are pool_refined_means (the covariance stays the
    labels')."""
    means, seen = class_means(statistics)
    covariance = shared_covariance(statistics, means, shrinkage)
    if pool_weight > 0:
        means = pool_refined_means(statistics, pool_weight)
    projected = np.linalg.solve(covariance, means.T).T
    bias = -0.5 * np.sum(projected * means, axis=1)
    projected[~seen], bias[~seen] = 0.0, UNSEEN_BIAS
    return projected / SCALE, bias


def relative_temperature(calibration: np.ndarray) -> float | None:
    """How much hotter than the head the devices scored with the head fitted now should run: the temperature T of
    TEMPERATURES that gives the labels held out from the old head (each device's new labels) the lowest summed
    negative log-likelihood, damped to sqrt(T), times the square of the share of labels the old head was fitted
    on. A shrunk LDA head's overconfidence falls faster than 1 / labels at first and about as 1 / labels later; the
    damped, squared carry errs towards a head too sure of itself, which makes a device's prior adaptation weaker,
    never wrong-footed (measured: ALGORITHMS.md section 7.10). None when no label was held out."""
    losses, new_share = calibration[:-1], float(calibration[-1])
    if not 0.0 < new_share < 1.0 or not np.all(np.isfinite(losses)):
        return None
    return math.sqrt(float(TEMPERATURES[int(np.argmin(losses))])) * (1.0 - new_share) ** 2


def head_names(trained: Weights) -> tuple[str, str]:
    """(weight, bias) of a trained set that is one linear classifier; UsageError otherwise."""
    head_shape(trained)
    weight = next(name for name, array in trained.items() if array.ndim == 2)
    return weight, next(name for name in trained if name != weight)


class PooledHead(StreamingWeightedAverage):
    """The classifier the fleet's pooled labels give, fitted from summed statistics, whatever the labels' spread.

    Devices send their class counts, class feature sums and second moment (the class-statistics local rule); FedAvg
    of those means by label count is the fleet's pooled statistics, exactly (in plain, secure and device-DP rounds
    alike: they are sums). From them: shrunk LDA (lda_head), then a temperature chosen on the labels each device
    acquired this round, held out from the head that chose them (Fed3R and FedNCM's closed form, with LDA's shared
    covariance; ALGORITHMS.md section 7.10). The temperature is this strategy's state: each round's is relative to
    the head the devices scored with."""

    name = "pooled-head"
    summary = "fits the classifier from the fleet's summed class statistics (shrunk LDA); devices run class-statistics"
    weighs_by_samples = True
    statistics = True
    options = (
        Option("shrinkage", float, 0.8, "pooled-head: LDA covariance shrinkage towards the identity", 0.0, 1.0),
        Option(
            "pool_labels",
            float,
            POOL_LABELS,
            "pooled-head: how many labels the devices' pool posteriors (--pool-statistics 1) weigh as, together",
            0.0,
            100000.0,
        ),
    )

    def __init__(self, shrinkage: float = 0.8, pool_labels: float = POOL_LABELS) -> None:
        self.shrinkage = self.option("shrinkage").check(shrinkage)
        self.pool_labels = self.option("pool_labels").check(pool_labels)
        self.temperature: float | None = None
        self.server: tuple[HeadStatistics, float] | None = None

    def learn_server_labels(self, statistics: HeadStatistics, count: int) -> None:
        """The statistics of the server's `count` labelled images (W0's), folded into every fit from now on."""
        self.server = (statistics, float(count)) if count > 0 else None

    def with_server_labels(self, statistics: HeadStatistics, samples: float) -> HeadStatistics:
        """The round's statistics over the devices' `samples` labels with the server's labelled images summed in,
        each side weighed by its labels; the calibration sums are the devices' new labels' over all of them (what
        the head they were chosen with was fitted on), and the pools' sums stay the devices' (pool_weight weighs
        them against every label)."""
        if self.server is None or not samples > 0:
            return statistics
        server, count = self.server
        total = samples + count

        def mixed(fleet: np.ndarray, own: np.ndarray) -> np.ndarray:
            return (samples * fleet + count * own) / total

        return dataclasses.replace(
            statistics,
            class_sums=mixed(statistics.class_sums, server.class_sums),
            class_counts=mixed(statistics.class_counts, server.class_counts),
            second_moment=mixed(statistics.second_moment, server.second_moment),
            calibration=statistics.calibration * (samples / total),
        )

    def pool_weight(self, labels: float) -> float:
        """How many times the weight of the fit's `labels` labels (the devices' and the server's) the pools' posterior
        sums carry: pool_labels / labels, so a fixed number of labels' worth that the labels outgrow (each pool
        image weighs a fixed fraction of a label: Nigam et al.'s EM-lambda). Section 7.10 measured it."""
        return self.pool_labels / labels if labels > 0 else 0.0

    def refines(self, statistics: HeadStatistics) -> bool:
        """Whether this round's pool posteriors refine the class means: they arrived, they came from a head this
        strategy fitted (not the spec's fresh one), and no new label arrived with them (an acquiring round's
        posteriors are the previous labels' head's: a step behind, measured to lose; section 7.10)."""
        return (
            self.temperature is not None
            and float(statistics.calibration[-1]) == 0.0
            and bool(np.any(statistics.pool_mass > 0))
        )

    def update_weight(self, update: ClientUpdate) -> float:
        """a_i = n_i: each device's statistics are its sums over its n_i labels, so the weighted mean is the pool's."""
        return float(update.num_samples)

    def fitted(self, aggregate: Weights, head: Weights, samples: float = 0.0) -> tuple[Weights, dict[str, Any]]:
        """The classifier (in the layout of `head`, the round's model's trained set) fitted from the round's mean
        statistics over the devices' `samples` labels (and the server's labelled images, when it learned them), and
        the fit's report: the devices' label shares, the classes seen, the temperature and the relative one the
        held-out labels chose; the round's head unchanged when no device's label was summed."""
        devices = HeadStatistics.of_tensors(aggregate)
        if not np.any(devices.class_counts > 0):  # an abandoned secure round, or no device held a label
            return dict(head), {"classes_seen": 0, "temperature": self.temperature}
        statistics = self.with_server_labels(devices, samples)
        labels = samples + (self.server[1] if self.server is not None else 0.0)
        pools = self.pool_weight(labels) if self.refines(statistics) else 0.0
        weight, bias = lda_head(statistics, self.shrinkage, pools)
        relative = relative_temperature(statistics.calibration) if self.temperature is not None else None
        self.temperature = (self.temperature or 1.0) * (relative or 1.0)
        names = head_names(head)
        fitted = {names[0]: weight / self.temperature, names[1]: bias / self.temperature}
        shares = np.maximum(devices.class_counts, 0.0)  # the devices' labels: what a device compares its own with
        report = {
            CLASS_SHARES: (shares / shares.sum()).round(6).tolist(),
            "classes_seen": int(np.count_nonzero(statistics.class_counts > 0)),
            "temperature": self.temperature,
            "relative_temperature": relative,
            "pool_refined": pools > 0,
            "pool_weight": round(pools, 6),
        }
        return {name: fitted[name].astype(head[name].dtype) for name in names}, report

    def state(self) -> dict[str, Any] | None:
        """The temperature so far (None before the first fit)."""
        return {"temperature": self.temperature}

    def load_state(self, state: dict[str, Any], tensors: Weights) -> None:
        """Restores the temperature a restarted run had reached."""
        value = state.get("temperature")
        self.temperature = None if value is None or not math.isfinite(float(value)) else float(value)


class SiteStatistics(FedAvg):
    """A relay's site round under a central pooled head: the site devices' statistics averaged by label count, as
    PooledHead averages the fleet's, so the centre's mean over relays and direct devices (each weighed by its labels)
    is the fleet's pooled statistics exactly. The site's mean is this round's strategy tensors, committed with the
    round, for the relay to send upstream (a relay restarted between commit and send reads them back); the site's
    model stays the central one (the centre fits the head). A relay chooses it for a class-statistics recipe; it is
    never chosen by name."""

    name = "site-statistics"
    summary = "a relay's site round under the pooled head: the site's mean statistics, passed upstream"
    statistics = True

    def __init__(self) -> None:
        self.mean: Weights = {}

    def fitted(self, aggregate: Weights, head: Weights, samples: float = 0.0) -> tuple[Weights, dict[str, Any]]:
        """The round's head unchanged; the site's mean statistics kept to be committed as the round's tensors."""
        self.mean = dict(aggregate)
        return dict(head), {}

    def state(self) -> dict[str, Any] | None:
        """Nothing but the tensors (an empty state, so the round commits them)."""
        return {}

    def tensors(self) -> Weights:
        """The site's mean statistics of the round just fitted."""
        return self.mean

    def load_state(self, state: dict[str, Any], tensors: Weights) -> None:
        """Takes back the last committed round's mean (nothing carries to the next round)."""
        self.mean = dict(tensors)
