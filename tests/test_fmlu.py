# FMLU (ALGORITHMS.md section 4): the DMLU local rule with its private model, and the exp(-H) aggregation.
from __future__ import annotations

import copy
import dataclasses
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from coordinator.intake.validation import Expectation, Rejection, validate_update
from coordinator.strategies.aggregate import ClientUpdate, entropy_coefficients
from coordinator.strategies.means import FMLU, AveFL
from coordinator.strategies.registry import make_strategy
from edge_agent.data.fashion_mnist import load_fashion_mnist
from edge_agent.learning.local_data import LocalData
from edge_agent.learning.local_rules import DMLU
from edge_agent.learning.models import build_model, get_weights, set_weights, weight_spec
from edge_agent.learning.rule_losses import confidence_coefficients, dmlu_losses, mean_prediction_entropy, mutual_losses
from edge_agent.learning.torch_rules import private_model_path, train_rule
from protocol import messages, wire
from protocol.files import load_arrays
from protocol.model_spec import DEFAULT_SPEC
from protocol.tensors import weights_hash

NUM_CLASSES = DEFAULT_SPEC.num_classes

RECIPE = messages.Recipe(local_rule="dmlu", epochs=1, batch_size=16, learning_rate=0.05, momentum=0.0, weight_decay=0.0)


@pytest.fixture(scope="module")
def labelled() -> tuple[np.ndarray, np.ndarray]:
    dataset = load_fashion_mnist()
    return dataset.test_images[:64], dataset.test_labels[:64].astype(np.int64)


def local_data(images: np.ndarray, labels: np.ndarray, state_dir: Path | None) -> LocalData:
    empty = np.zeros((0, 28, 28), dtype=np.uint8)
    none = np.zeros(0, dtype=np.int64)
    return LocalData(images[:0], none, empty, none, images, labels, lambda: empty, state_dir=state_dir)


def model_from(weights: dict) -> torch.nn.Module:
    model = build_model()
    set_weights(model, weights)
    return model.eval()


def run_dmlu(global_weights: dict, data: LocalData, recipe: messages.Recipe = RECIPE) -> tuple[dict, dict]:
    """One DMLU round as the agent runs it: the meme starts as a copy of the global model."""
    global_model = model_from(global_weights)
    meme = copy.deepcopy(global_model)
    metrics = train_rule(DMLU(), meme, data, global_model, recipe, seed=1)
    return get_weights(meme), metrics


def logits_pair(seed: int = 0, batch: int = 6) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    local = torch.randn(batch, NUM_CLASSES, generator=generator) * 2
    meme = torch.randn(batch, NUM_CLASSES, generator=generator) * 2
    targets = torch.randint(0, NUM_CLASSES, (batch,), generator=generator)
    return local, meme, targets


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


def test_equal_entropies_give_the_uniform_fml_mean() -> None:
    rng = np.random.default_rng(0)
    base = get_weights(build_model(seed=0))
    updates = [
        ClientUpdate(
            f"dev-{i}",
            {k: (v + rng.normal(0, 0.1, v.shape)).astype(v.dtype) for k, v in base.items()},
            num_samples=10 * (i + 1),
            metrics={messages.METRIC_MEME_ENTROPY: 0.7},
        )
        for i in range(3)
    ]
    fmlu, report = FMLU().aggregate(base, updates, None)
    uniform, _ = AveFL().aggregate(base, updates, None)
    assert report["coefficients"] == pytest.approx({"dev-0": 1 / 3, "dev-1": 1 / 3, "dev-2": 1 / 3})
    for name in base:
        np.testing.assert_allclose(fmlu[name], uniform[name], rtol=1e-6, atol=1e-7)


def test_weights_are_the_softmax_of_minus_entropy() -> None:
    entropies = [0.1, 0.5, 2.0]
    expected = np.exp(-np.array(entropies)) / np.exp(-np.array(entropies)).sum()
    np.testing.assert_allclose(entropy_coefficients(entropies), expected, rtol=1e-12)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(0.0, math.log(NUM_CLASSES)), min_size=1, max_size=12))
def test_weights_sum_to_one_and_fall_as_entropy_rises(entropies: list[float]) -> None:
    weights = entropy_coefficients(entropies)
    assert weights.sum() == pytest.approx(1.0)
    order = np.argsort(entropies, kind="stable")
    assert np.all(np.diff(weights[order]) <= 1e-15)


def test_non_finite_entropy_cannot_be_aggregated() -> None:
    base = get_weights(build_model(seed=0))
    updates = [ClientUpdate("a", base, 1, {messages.METRIC_MEME_ENTROPY: 0.5}), ClientUpdate("b", base, 1, {})]
    with pytest.raises(ValueError, match="update of b has no finite 'meme_entropy'"):
        FMLU().aggregate(base, updates, None)
    with pytest.raises(ValueError, match="finite"):
        entropy_coefficients([0.2, float("nan")])


def test_dmlu_with_both_coefficients_one_is_twice_fml_at_one_half() -> None:
    local, meme, targets = logits_pair()
    ones = torch.ones(len(targets))
    dmlu_local, dmlu_meme = mutual_losses(local, meme, targets, ones, ones)
    kl = torch.nn.functional.kl_div  # kl_div(log q, p) = KL(p || q), batch mean
    fml_local = 0.5 * torch.nn.functional.cross_entropy(local, targets) + 0.5 * kl(
        torch.log_softmax(local, 1), torch.softmax(meme, 1), reduction="batchmean"
    )
    fml_meme = 0.5 * torch.nn.functional.cross_entropy(meme, targets) + 0.5 * kl(
        torch.log_softmax(meme, 1), torch.softmax(local, 1), reduction="batchmean"
    )
    assert dmlu_local.item() == pytest.approx(2 * fml_local.item(), rel=1e-5)
    assert dmlu_meme.item() == pytest.approx(2 * fml_meme.item(), rel=1e-5)


def test_dmlu_losses_use_per_sample_exp_minus_entropy_of_the_other_model() -> None:
    local, meme, targets = logits_pair(seed=3)
    p_local, p_meme = softmax(local.numpy().astype(np.float64)), softmax(meme.numpy().astype(np.float64))
    entropy = lambda p: -(p * np.log(p)).sum(axis=1)  # noqa: E731
    kl = lambda p, q: (p * (np.log(p) - np.log(q))).sum(axis=1)  # noqa: E731
    ce = lambda p: -np.log(p[np.arange(len(targets)), targets.numpy()]).mean()  # noqa: E731
    expected_local = ce(p_local) + (np.exp(-entropy(p_meme)) * kl(p_meme, p_local)).mean()
    expected_meme = ce(p_meme) + (np.exp(-entropy(p_local)) * kl(p_local, p_meme)).mean()
    actual_local, actual_meme = dmlu_losses(local, meme, targets)
    assert actual_local.item() == pytest.approx(expected_local, rel=1e-5)
    assert actual_meme.item() == pytest.approx(expected_meme, rel=1e-5)


def test_each_dmlu_loss_trains_only_its_own_model() -> None:
    local, meme, targets = logits_pair(seed=4)
    local.requires_grad_(True)
    meme.requires_grad_(True)
    local_loss, _ = dmlu_losses(local, meme, targets)
    local_loss.backward()
    assert meme.grad is None and local.grad is not None and local.grad.abs().sum() > 0


def test_dmlu_coefficient_lies_between_one_over_c_and_one() -> None:
    uniform = torch.zeros(1, NUM_CLASSES)
    certain = torch.tensor([[100.0] + [0.0] * (NUM_CLASSES - 1)])
    assert confidence_coefficients(uniform).item() == pytest.approx(1 / NUM_CLASSES, rel=1e-6)
    assert confidence_coefficients(certain).item() == pytest.approx(1.0, abs=1e-6)
    random = torch.randn(200, NUM_CLASSES) * 3
    values = confidence_coefficients(random)
    assert values.min() >= 1 / NUM_CLASSES - 1e-6 and values.max() <= 1.0


def test_private_model_starts_from_the_first_global_and_is_untouched_by_server_steps(labelled, tmp_path) -> None:
    images, labels = labelled
    data = local_data(images, labels, tmp_path)
    first_global = get_weights(build_model(seed=1))
    run_dmlu(first_global, data, dataclasses.replace(RECIPE, learning_rate=0.0))
    assert weights_hash(load_arrays(private_model_path(tmp_path))) == weights_hash(first_global)

    meme_1, _ = run_dmlu(first_global, data)
    private_1 = load_arrays(private_model_path(tmp_path))
    assert weights_hash(private_1) not in (weights_hash(first_global), weights_hash(meme_1))

    server_step = get_weights(build_model(seed=2))
    meme_2, _ = run_dmlu(server_step, data, dataclasses.replace(RECIPE, learning_rate=0.0))
    private_2 = load_arrays(private_model_path(tmp_path))
    assert weights_hash(private_2) == weights_hash(private_1)
    assert weights_hash(meme_2) == weights_hash(server_step)


def test_update_metrics_are_only_the_memes_entropy_on_its_training_data(labelled, tmp_path) -> None:
    images, labels = labelled
    meme, metrics = run_dmlu(get_weights(build_model(seed=1)), local_data(images, labels, tmp_path))
    assert set(metrics) == {messages.METRIC_MEME_ENTROPY}
    assert metrics[messages.METRIC_MEME_ENTROPY] == pytest.approx(
        mean_prediction_entropy(model_from(meme), images), rel=1e-6
    )
    private = model_from(load_arrays(private_model_path(tmp_path)))
    assert metrics[messages.METRIC_MEME_ENTROPY] != pytest.approx(mean_prediction_entropy(private, images), rel=1e-6)


def test_dmlu_without_a_state_dir_is_refused(labelled) -> None:
    images, labels = labelled
    with pytest.raises(ValueError, match="needs the device's state_dir"):
        run_dmlu(get_weights(build_model(seed=1)), local_data(images, labels, None))


WEIGHTS = get_weights(build_model(seed=0))


def fmlu_update(metrics: dict[str, float]) -> bytes:
    return wire.encode(
        messages.Update(
            device_id="dev-1",
            round_id=3,
            update_id="u",
            base_hash=weights_hash(WEIGHTS),
            num_samples=20,
            class_counts=[2] * NUM_CLASSES,
            acquired_labels=10,
            metrics=metrics,
            tensors=WEIGHTS,
        )
    )


FMLU_EXPECTATION = Expectation(
    3,
    weights_hash(WEIGHTS),
    weight_spec(build_model()),
    NUM_CLASSES,
    1 << 24,
    required_metrics=make_strategy("fmlu").metric_bounds(NUM_CLASSES),
)


@pytest.mark.parametrize(
    ("metrics", "reason"),
    [
        ({}, "missing metric 'meme_entropy'"),
        ({"meme_entropy": float("nan")}, "undecodable: update.metrics must be a map of names to finite numbers"),
        ({"meme_entropy": float("inf")}, "undecodable: update.metrics must be a map of names to finite numbers"),
        ({"meme_entropy": -3.0}, "metric 'meme_entropy' = -3.0 lies outside [0, 2.30259]"),
        ({"meme_entropy": 9.0}, "lies outside"),
    ],
)
def test_fmlu_rejects_a_missing_or_impossible_entropy(metrics: dict, reason: str) -> None:
    with pytest.raises(Rejection) as info:
        validate_update("dev-1", fmlu_update(metrics), FMLU_EXPECTATION)
    assert reason in info.value.reason


def test_fmlu_accepts_an_entropy_in_range_and_other_strategies_do_not_ask_for_it() -> None:
    assert validate_update("dev-1", fmlu_update({"meme_entropy": 1.2}), FMLU_EXPECTATION).metrics["meme_entropy"] == 1.2
    plain = dataclasses.replace(FMLU_EXPECTATION, required_metrics=make_strategy("fedavg").metric_bounds(NUM_CLASSES))
    assert validate_update("dev-1", fmlu_update({}), plain).metrics == {}
