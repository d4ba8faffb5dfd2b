# FedProx (ALGORITHMS.md section 6): the proximal term, mu = 0 as plain local SGD, and the pull towards w^t.
from __future__ import annotations

import numpy as np
import pytest
import torch

from edge_agent.data.fashion_mnist import load_fashion_mnist
from edge_agent.learning.local_data import LocalData
from edge_agent.learning.local_rules import FedProx
from edge_agent.learning.models import build_model, get_weights
from edge_agent.learning.rule_losses import proximal_term
from edge_agent.learning.torch_rules import train_rule
from edge_agent.learning.training import TrainSettings, train_supervised
from protocol import messages


@pytest.fixture(scope="module")
def data() -> LocalData:
    fashion = load_fashion_mnist()
    images, labels = fashion.test_images[:48], fashion.test_labels[:48].astype(np.int64)
    return LocalData(
        images[:0],
        labels[:0],
        images[:0],
        labels[:0],
        images[:32],
        labels[:32],
        lambda: images[:0],
        weak_images=images[32:],
        weak_labels=labels[32:],
    )


def distance(weights: dict, reference: dict) -> float:
    return float(np.sqrt(sum(np.sum((weights[k] - reference[k]) ** 2) for k in reference)))


def test_proximal_term_is_half_mu_squared_distance_with_gradient_mu_times_difference() -> None:
    model = torch.nn.Linear(3, 2)
    anchors = [p.detach().clone() for p in model.parameters()]
    with torch.no_grad():
        model.weight.add_(torch.tensor([[1.0, 0.0, -2.0], [0.0, 0.5, 0.0]]))
        model.bias.add_(torch.tensor([0.0, 3.0]))
    term = proximal_term(model, anchors, mu=0.4)
    assert term.item() == pytest.approx(0.5 * 0.4 * (1 + 4 + 0.25 + 9))
    term.backward()
    assert torch.allclose(model.weight.grad, 0.4 * (model.weight - anchors[0]))
    assert torch.allclose(model.bias.grad, 0.4 * (model.bias - anchors[1]))


def test_mu_zero_is_plain_sgd_on_human_plus_weak_labels(data: LocalData) -> None:
    recipe = messages.Recipe(local_rule="fedprox", epochs=2, batch_size=16, learning_rate=0.05, options={"mu": 0.0})
    prox = build_model(seed=1)
    metrics = train_rule(FedProx(), prox, data, build_model(seed=1).eval(), recipe, seed=3)
    plain = build_model(seed=1)
    images, labels = data.training_set()
    train_supervised(plain, images, labels, TrainSettings.from_recipe(recipe, 3))
    assert metrics["train_samples"] == 48.0
    assert all(np.array_equal(v, get_weights(plain)[k]) for k, v in get_weights(prox).items())


def test_larger_mu_keeps_the_local_model_closer_to_the_global_one(data: LocalData) -> None:
    start = get_weights(build_model(seed=2))
    distances = []
    for mu in (0.0, 1.0, 50.0):
        model = build_model(seed=2)
        recipe = messages.Recipe(local_rule="fedprox", epochs=3, batch_size=16, learning_rate=0.01, options={"mu": mu})
        train_rule(FedProx(), model, data, build_model(seed=2).eval(), recipe, seed=4)
        distances.append(distance(get_weights(model), start))
    assert distances[0] > distances[1] > distances[2] > 0


def test_negative_mu_is_refused(data: LocalData) -> None:
    with pytest.raises(ValueError, match="--mu must be at least 0, got -1.0"):
        train_rule(
            FedProx(), build_model(seed=0), data, build_model(seed=0), messages.Recipe(options={"mu": -1.0}), seed=0
        )
