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


def cross_entropy_gradients(
    features: np.ndarray, labels: np.ndarray, weight: np.ndarray, bias: np.ndarray, logit_bias: np.ndarray | None = None
) -> tuple[float, np.ndarray, np.ndarray]:
    """(mean cross-entropy, d loss / d weight, d loss / d bias) of logits = features @ weight.T + bias, plus a fixed
    per-class logit_bias when given (the logit adjustment tau ln n_c; -inf for a class without labels)."""
    logits = features @ weight.T + bias
    probabilities = softmax(logits if logit_bias is None else logits + logit_bias)
    rows = np.arange(len(labels))
    loss = float(-np.mean(np.log(np.maximum(probabilities[rows, labels], 1e-12))))
    delta = probabilities
    delta[rows, labels] -= 1.0
    delta /= len(labels)
    return loss, delta.T @ features, delta.sum(axis=0)


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
) -> tuple[np.ndarray, np.ndarray, float]:
    """(new weight, new bias, last epoch's mean loss): E seeded epochs of shuffled mini-batches of SGD, on the
    logit-adjusted loss when a logit_bias is given."""
    if len(features) != len(labels):
        raise ValueError(f"{len(features)} feature rows but {len(labels)} labels")
    rng = np.random.default_rng(settings.seed)
    parameters = [weight.astype(np.float64), bias.astype(np.float64)]
    velocity = [np.zeros_like(parameter) for parameter in parameters]
    inputs, targets = features.astype(np.float64), np.asarray(labels, dtype=np.int64)
    epoch_loss, starts = float("nan"), range(0, len(inputs), settings.batch_size)
    for epoch in range(settings.epochs):
        order, total = rng.permutation(len(inputs)), 0.0
        for step, start in enumerate(starts, start=epoch * len(starts)):
            batch = order[start : start + settings.batch_size]
            loss, *gradients = cross_entropy_gradients(
                dropped(inputs[batch], settings.dropout, rng), targets[batch], parameters[0], parameters[1], logit_bias
            )
            rate = settings.learning_rate * lr_factor(settings.lr_schedule, step, settings.epochs * len(starts))
            for parameter, gradient, buffer in zip(parameters, gradients, velocity):
                gradient = gradient + settings.weight_decay * parameter
                buffer *= settings.momentum
                buffer += gradient
                parameter -= rate * buffer
            total += loss * len(batch)
        epoch_loss = total / max(len(order), 1)
    return parameters[0].astype(np.float32), parameters[1].astype(np.float32), epoch_loss
