# Head-only training in pure numpy: the classifier (softmax regression) on frozen penultimate features, torch's SGD.
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from edge_agent.learning.lr_schedules import lr_factor


@dataclass(frozen=True)
class HeadSettings:
    """SGD as torch.optim.SGD does it (weight decay added to the gradient, momentum buffer v = mu*v + g), with
    dropout of rate `dropout` on the classifier's input, as the full model trains it, and the round's learning-rate
    schedule stepped per mini-batch as torch's LambdaLR does."""

    epochs: int
    batch_size: int
    learning_rate: float
    momentum: float = 0.0
    weight_decay: float = 0.0
    dropout: float = 0.0
    seed: int = 0
    lr_schedule: str = "constant"


def softmax(logits: np.ndarray) -> np.ndarray:
    """Row-wise softmax, shifted by each row's maximum so that it never overflows."""
    shifted = np.exp(logits - logits.max(axis=1, keepdims=True))
    return shifted / shifted.sum(axis=1, keepdims=True)


def example_errors(
    features: np.ndarray,
    labels: np.ndarray,
    weight: np.ndarray,
    bias: np.ndarray,
    logit_bias: np.ndarray | None = None,
    row_weights: np.ndarray | None = None,
) -> tuple[float, np.ndarray]:
    """(mean cross-entropy, 0 for no rows; p_i - y_i per row) of logits = features @ weight.T + bias, plus a fixed
    per-class logit_bias when given (the logit adjustment tau ln n_c; -inf for a class without labels): row i's
    gradient is (p_i - y_i) [x_i, 1]^T for the weight and bias together. With row_weights, row i's loss and error
    are scaled by its weight (a pseudo-label's confidence)."""
    logits = features @ weight.T + bias
    probabilities = softmax(logits if logit_bias is None else logits + logit_bias)
    rows = np.arange(len(labels))
    losses = -np.log(np.maximum(probabilities[rows, labels], 1e-12))
    probabilities[rows, labels] -= 1.0
    if row_weights is not None:
        losses, probabilities = losses * row_weights, probabilities * row_weights[:, None]
    return (float(np.mean(losses)) if len(labels) else 0.0), probabilities


def cross_entropy_gradients(
    features: np.ndarray,
    labels: np.ndarray,
    weight: np.ndarray,
    bias: np.ndarray,
    logit_bias: np.ndarray | None = None,
    row_weights: np.ndarray | None = None,
) -> tuple[float, np.ndarray, np.ndarray]:
    """(mean cross-entropy, d loss / d weight, d loss / d bias) of the batch (see example_errors)."""
    loss, delta = example_errors(features, labels, weight, bias, logit_bias, row_weights)
    delta /= len(labels)
    return loss, delta.T @ features, delta.sum(axis=0)


class SgdSteps:
    """How train_classifier draws an epoch's mini-batches and takes a batch's gradient: plain SGD shuffles the rows
    with the round's seed and takes the mean cross-entropy gradient; DP-SGD (edge_agent.learning.dp_sgd) overrides
    all three methods."""

    def batches(self, size: int, batch_size: int, rng: np.random.Generator) -> list[np.ndarray]:
        """One epoch's mini-batches: the rows shuffled by the seeded rng, cut into pieces of batch_size."""
        order = rng.permutation(size)
        return [order[start : start + batch_size] for start in range(0, size, batch_size)]

    def gradients(
        self,
        features: np.ndarray,
        labels: np.ndarray,
        parameters: list[np.ndarray],
        logit_bias: np.ndarray | None,
        row_weights: np.ndarray | None = None,
    ) -> tuple[float, np.ndarray, np.ndarray]:
        """(the batch's mean loss, the weight's gradient, the bias's gradient), each row's term scaled by its weight
        when row_weights are given."""
        return cross_entropy_gradients(features, labels, parameters[0], parameters[1], logit_bias, row_weights)

    def spent(self, size: int, settings: HeadSettings) -> dict[str, float]:
        """What the update reports about the privacy this training spent: nothing, for plain SGD."""
        return {}


def dropped(features: np.ndarray, rate: float, rng: np.random.Generator) -> np.ndarray:
    """Inverted dropout: each value kept with probability 1 - rate and scaled by 1 / (1 - rate)."""
    if rate == 0.0:
        return features
    keep = rng.random(features.shape) >= rate
    return features * keep / (1.0 - rate)


def train_classifier(
    features: np.ndarray,
    labels: np.ndarray,
    weight: np.ndarray,
    bias: np.ndarray,
    settings: HeadSettings,
    logit_bias: np.ndarray | None = None,
    steps: SgdSteps | None = None,
    row_weights: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray, float]:
    """(new weight, new bias, last epoch's mean loss): E seeded epochs of mini-batches of SGD, on the logit-adjusted
    loss when a logit_bias is given, each row's loss scaled by its weight when row_weights are given (pseudo-labels);
    `steps` draws the batches and takes the gradients (plain SGD by default)."""
    if len(features) != len(labels):
        raise ValueError(f"{len(features)} feature rows but {len(labels)} labels")
    steps = steps or SgdSteps()
    rng = np.random.default_rng(settings.seed)
    parameters = [weight.astype(np.float64), bias.astype(np.float64)]
    velocity = [np.zeros_like(parameter) for parameter in parameters]
    inputs, targets = features.astype(np.float64), np.asarray(labels, dtype=np.int64)
    epoch_loss, per_epoch = float("nan"), len(range(0, len(inputs), settings.batch_size))
    for epoch in range(settings.epochs):
        total, seen = 0.0, 0
        for step, batch in enumerate(steps.batches(len(inputs), settings.batch_size, rng), start=epoch * per_epoch):
            weights = None if row_weights is None else row_weights[batch]
            loss, *gradients = steps.gradients(
                dropped(inputs[batch], settings.dropout, rng), targets[batch], parameters, logit_bias, weights
            )
            rate = settings.learning_rate * lr_factor(settings.lr_schedule, step, settings.epochs * per_epoch)
            sgd_step(parameters, gradients, velocity, rate, settings)
            total, seen = total + loss * len(batch), seen + len(batch)
        epoch_loss = total / max(seen, 1)
    return parameters[0].astype(np.float32), parameters[1].astype(np.float32), epoch_loss


def sgd_step(
    parameters: list[np.ndarray],
    gradients: list[np.ndarray],
    velocity: list[np.ndarray],
    rate: float,
    settings: HeadSettings,
) -> None:
    """torch.optim.SGD's step, in place: weight decay added to the gradient, v = mu*v + g, p -= rate * v."""
    for parameter, gradient, buffer in zip(parameters, gradients, velocity):
        gradient = gradient + settings.weight_decay * parameter
        buffer *= settings.momentum
        buffer += gradient
        parameter -= rate * buffer
