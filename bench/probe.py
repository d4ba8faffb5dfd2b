# The centralised probe: softmax regression on a frozen backbone's features of every label a fleet used, pooled.
from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from scipy.optimize import minimize

from coordinator.rounds.holdout import server_holdout
from edge_agent.data.image_files import InputSpec
from edge_agent.field.folder_pool import open_folder_data
from edge_agent.learning.head_training import cross_entropy_gradients
from edge_agent.learning.pretrained_backbone import initial_model
from edge_agent.learning.training import prefix_outputs
from protocol.model_spec import ModelSpec

log = logging.getLogger(__name__)


def backbone_features(spec: ModelSpec, images: np.ndarray) -> np.ndarray:
    """The spec's frozen prefix (its pretrained backbone) over raw uint8 images: (N, D) float32, batch by batch."""
    log.info("probe features images=%d", len(images))
    return prefix_outputs(initial_model(spec, seed=0), images)


def fit_probe(features: np.ndarray, labels: np.ndarray, num_classes: int, l2: float = 1e-3) -> np.ndarray:
    """Multinomial logistic regression to convergence (L-BFGS, L2 penalty l2/2 |W|^2 on the weights): the
    centralised model a federated head on the same features and labels is compared with. Returns [W | b]."""
    dim = features.shape[1]

    def loss_and_gradient(flat: np.ndarray) -> tuple[float, np.ndarray]:
        weight, bias = flat[: num_classes * dim].reshape(num_classes, dim), flat[num_classes * dim :]
        loss, grad_weight, grad_bias = cross_entropy_gradients(features, labels, weight, bias)
        penalty = 0.5 * l2 * float(np.sum(weight * weight))
        return loss + penalty, np.concatenate([(grad_weight + l2 * weight).ravel(), grad_bias])

    start = np.zeros(num_classes * (dim + 1))
    result = minimize(loss_and_gradient, start, jac=True, method="L-BFGS-B", options={"maxiter": 500})
    return np.asarray(result.x)


def probe_accuracy(probe: np.ndarray, num_classes: int, features: np.ndarray, labels: np.ndarray) -> float:
    """Test accuracy of a fitted probe."""
    dim = features.shape[1]
    weight, bias = probe[: num_classes * dim].reshape(num_classes, dim), probe[num_classes * dim :]
    return float(np.mean(np.argmax(features @ weight.T + bias, axis=1) == labels))


def fleet_label_blocks(
    server: tuple[np.ndarray, np.ndarray],
    init_samples: int,
    seed: int,
    states: Sequence[tuple[Path, Path]],
    spec: ModelSpec,
) -> list[tuple[np.ndarray, np.ndarray]]:
    """Every labelled image a run trained on, as (uint8 images, labels) blocks: first the server's W0 samples (the
    coordinator's own seeded holdout), then each device's human labels (state dir, pool dir) in labelling order."""
    images, labels = server
    init, _, _ = server_holdout(labels, init_samples, 0, np.random.default_rng(seed), spec.num_classes)
    blocks = [(images[init], labels[init])]
    for state_dir, pool_dir in states:
        data = open_folder_data(state_dir, pool_dir, 10**6, InputSpec(*spec.input_shape), 0.0, (), spec.num_classes)
        indices, device_labels = data.labelled()
        blocks.append((data.images(indices), device_labels))
    return blocks


def leading_rows(sizes: Sequence[int], taken: Sequence[int]) -> np.ndarray:
    """Row indices, into blocks of these sizes stacked in order, of the first taken[i] rows of each block i (all of
    a block that holds fewer): the labels a run had used by some round, when each block is in labelling order."""
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
    parts = [start + np.arange(min(size, count)) for start, size, count in zip(starts, sizes, taken)]
    return np.concatenate([np.zeros(0, dtype=np.int64), *parts]).astype(np.int64)
