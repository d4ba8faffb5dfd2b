# DP-SGD on the classifier alone (Abadi et al. 2016): per-example clipped gradients, Gaussian noise, Poisson batches.
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from edge_agent.data.journal import Journal
from edge_agent.learning.head_training import HeadSettings, SgdSteps, example_errors
from protocol.dp import DP_SGD_EPSILON_METRIC

LEDGER_FILE = "dp_sgd_ledger.json"  # in the device's state directory: every step this device has taken under DP-SGD
LEDGER_KEY = "steps"  # [[sampling rate, noise multiplier, steps], ...], one entry per distinct (q, z)


@dataclass(frozen=True)
class PrivateSteps(SgdSteps):
    """DP-SGD's batches and gradients for train_classifier. Each step includes every row independently with
    probability q = expected_batch / n (Poisson sampling), clips each row's gradient (p_i - y_i) [x_i, 1]^T (weight
    and bias together) to L2 norm `clip`, sums them, adds N(0, (z clip)^2) to every entry and divides by
    expected_batch, a fixed denominator (the realised batch size would depend on who was sampled). `rng` draws the
    batches and the noise from fresh entropy, never the round's public seed; dropout keeps the seeded one."""

    clip: float
    noise_multiplier: float
    expected_batch: int
    delta: float
    ledger: Path
    rng: np.random.Generator

    def batches(self, size: int, batch_size: int, rng: np.random.Generator) -> list[np.ndarray]:
        """One epoch's ceil(n / batch_size) Poisson-sampled batches (some may be empty), drawn from `self.rng`."""
        rate = self.sampling_rate(size)
        return [np.flatnonzero(self.rng.random(size) < rate) for _ in range(0, size, batch_size)]

    def sampling_rate(self, size: int) -> float:
        """q = expected_batch / n, at most 1."""
        return min(1.0, self.expected_batch / size) if size else 1.0

    def gradients(
        self,
        features: np.ndarray,
        labels: np.ndarray,
        parameters: list[np.ndarray],
        logit_bias: np.ndarray | None,
        row_weights: np.ndarray | None = None,
    ) -> tuple[float, np.ndarray, np.ndarray]:
        """(the batch's mean loss, the noised weight gradient, the noised bias gradient): the per-example gradients'
        norms are ||p_i - y_i|| sqrt(||x_i||^2 + 1) (an outer product's), so no per-example gradient is built; a
        row's weight scales its gradient before the clip."""
        loss, errors = example_errors(features, labels, parameters[0], parameters[1], logit_bias, row_weights)
        norms = np.linalg.norm(errors, axis=1) * np.sqrt(np.sum(np.square(features), axis=1) + 1.0)
        errors /= self.expected_batch
        errors *= np.minimum(1.0, self.clip / np.maximum(norms, np.finfo(np.float64).tiny))[:, None]
        weight, bias = errors.T @ features, errors.sum(axis=0)
        if self.noise_multiplier > 0.0:
            std = self.noise_multiplier * self.clip / self.expected_batch
            weight = weight + self.rng.normal(0.0, std, size=weight.shape)
            bias = bias + self.rng.normal(0.0, std, size=bias.shape)
        return loss, weight, bias

    def spent(self, size: int, settings: HeadSettings) -> dict[str, float]:
        """Journals this training's steps in the device's ledger and reports the example-level epsilon at `delta` of
        every step the device has taken so far (`dp_sgd_epsilon`)."""
        steps = settings.epochs * len(range(0, size, settings.batch_size))
        history = record_steps(self.ledger, self.sampling_rate(size), self.noise_multiplier, steps)
        return {DP_SGD_EPSILON_METRIC: ledger_epsilon(history, self.delta)}


def record_steps(ledger: Path, rate: float, noise_multiplier: float, steps: int) -> list[list[float]]:
    """Adds `steps` steps at (rate, noise_multiplier) to the ledger (written atomically before the update leaves, so
    a restart never forgets them) and returns its entries [q, z, steps]."""
    journal = Journal(ledger)
    entries: list[list[float]] = [list(entry) for entry in journal.get(LEDGER_KEY, [])]
    for entry in entries:
        if entry[0] == rate and entry[1] == noise_multiplier:
            entry[2] += steps
            break
    else:
        entries.append([rate, noise_multiplier, steps])
    journal.set(LEDGER_KEY, entries)
    return entries


def ledger_epsilon(entries: list[list[float]], delta: float) -> float:
    """The epsilon at `delta` of every step in the ledger: dp_accounting's RDP accountant composing
    PoissonSampled(q, Gaussian(z)) once per step (imported here: a device without DP-SGD needs no dp_accounting)."""
    from protocol.dp_accountant import SampledGaussian, epsilon_of_counts

    return epsilon_of_counts({SampledGaussian(q, z): int(steps) for q, z, steps in entries}, delta)
