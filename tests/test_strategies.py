# Unit tests for the aggregation strategies and the averaging math: hand values and the core paper's properties.
import dataclasses
import json

import numpy as np
import pytest
import torch

from coordinator.strategies.aggregate import ClientUpdate, weighted_average
from coordinator.strategies.means import AveFL, FedAvg, MixFL, OptFL
from coordinator.strategies.registry import STRATEGIES, make_strategy
from edge_agent.learning.models import build_model, get_weights, set_weights
from protocol.tensors import Weights

SHAPES = {"conv.weight": (4, 1, 3, 3), "conv.bias": (4,), "fc.weight": (2, 4)}


def random_weights(rng: np.random.Generator) -> Weights:
    """Float32 weights with the SHAPES layout."""
    return {name: rng.normal(size=shape).astype(np.float32) for name, shape in SHAPES.items()}


def constant_weights(value: float) -> Weights:
    """Float32 weights with the SHAPES layout, every entry equal to `value`."""
    return {name: np.full(shape, value, dtype=np.float32) for name, shape in SHAPES.items()}


def updates_for(weight_sets: list[Weights], counts: list[int] | None = None) -> list[ClientUpdate]:
    """One update per weight set, from devices d0, d1, ..."""
    counts = counts or [10] * len(weight_sets)
    return [ClientUpdate(f"d{i}", weights, count) for i, (weights, count) in enumerate(zip(weight_sets, counts))]


def accuracy_towards(target: Weights):
    """A stand-in for validation accuracy: 1 / (1 + squared distance to a target model), in (0, 1]."""

    def evaluate(weights: Weights) -> float:
        distance = sum(float(np.sum((weights[n].astype(np.float64) - target[n]) ** 2)) for n in target)
        return 1.0 / (1.0 + distance)

    return evaluate


def assert_weights_equal(actual: Weights, expected: Weights) -> None:
    assert list(actual) == list(expected)
    for name in expected:
        assert actual[name].dtype == expected[name].dtype
        np.testing.assert_array_equal(actual[name], expected[name])


def test_weighted_average_hand_example_renormalises_coefficients() -> None:
    # coefficients [1, 3] -> [0.25, 0.75]: 0.25 * [0, 4] + 0.75 * [8, 0] = [6, 1]
    first = {"w": np.array([0.0, 4.0], dtype=np.float32)}
    second = {"w": np.array([8.0, 0.0], dtype=np.float32)}
    averaged = weighted_average([first, second], [1.0, 3.0])
    np.testing.assert_array_equal(averaged["w"], [6.0, 1.0])
    assert averaged["w"].dtype == np.float32


def test_weighted_average_accumulates_in_float64() -> None:
    # (1 + 1e8 - 1e8) / 3 = 1/3; a float32 accumulator loses the 1 next to 1e8 (its spacing there is 8).
    sets = [{"w": np.array([value], dtype=np.float32)} for value in (1.0, 1e8, -1e8)]
    np.testing.assert_allclose(weighted_average(sets, [1.0, 1.0, 1.0])["w"], [1.0 / 3.0], rtol=1e-6)


def test_weighted_average_rejects_mismatched_shapes_and_names() -> None:
    base = constant_weights(1.0)
    reshaped = dict(base, **{"conv.bias": np.ones(5, dtype=np.float32)})
    with pytest.raises(ValueError, match="'conv.bias' has shape \\(5,\\), expected \\(4,\\)"):
        weighted_average([base, reshaped], [1.0, 1.0])
    renamed = {("fc.w" if name == "fc.weight" else name): array for name, array in base.items()}
    with pytest.raises(ValueError, match="missing \\['fc.weight'\\], unexpected \\['fc.w'\\]"):
        weighted_average([base, renamed], [1.0, 1.0])


@pytest.mark.parametrize(
    ("coefficients", "message"),
    [
        ([1.0, -1.0], "non-negative"),
        ([0.0, 0.0], "positive sum"),
        ([1.0], "1 coefficients for 2"),
        ([np.nan, 1], "finite"),
    ],
)
def test_weighted_average_rejects_bad_coefficients(coefficients: list[float], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        weighted_average([constant_weights(0.0), constant_weights(1.0)], coefficients)


def test_avefl_of_identical_models_returns_that_model() -> None:
    model = random_weights(np.random.default_rng(0))
    averaged, report = AveFL().aggregate(model, updates_for([model, model, model]), None)
    assert_weights_equal(averaged, model)
    assert report == {
        "coefficients": {"d0": pytest.approx(1 / 3), "d1": pytest.approx(1 / 3), "d2": pytest.approx(1 / 3)}
    }


def test_avefl_is_order_invariant() -> None:
    rng = np.random.default_rng(1)
    updates = updates_for([random_weights(rng) for _ in range(5)])
    averaged, _ = AveFL().aggregate(updates[0].weights, updates, None)
    permuted, _ = AveFL().aggregate(updates[0].weights, [updates[i] for i in rng.permutation(5)], None)
    for name in SHAPES:
        np.testing.assert_allclose(permuted[name], averaged[name], rtol=1e-6, atol=1e-7)
    expected = np.mean([u.weights["fc.weight"].astype(np.float64) for u in updates], axis=0)
    np.testing.assert_allclose(averaged["fc.weight"], expected, rtol=1e-6)


def test_fedavg_weights_proportional_to_num_samples() -> None:
    # counts 1 and 3 -> coefficients 0.25 and 0.75: 0.25 * 0 + 0.75 * 4 = 3
    updates = updates_for([constant_weights(0.0), constant_weights(4.0)], counts=[1, 3])
    averaged, report = FedAvg().aggregate(updates[0].weights, updates, None)
    assert_weights_equal(averaged, constant_weights(3.0))
    assert report == {"coefficients": {"d0": 0.25, "d1": 0.75}}
    scaled = updates_for([constant_weights(0.0), constant_weights(4.0)], counts=[7, 21])
    assert_weights_equal(FedAvg().aggregate(scaled[0].weights, scaled, None)[0], averaged)


def test_optfl_returns_exactly_the_most_accurate_input() -> None:
    rng = np.random.default_rng(2)
    models = [random_weights(rng) for _ in range(4)]
    evaluate = accuracy_towards(models[2])
    chosen, report = OptFL().aggregate(models[0], updates_for(models), evaluate)
    assert_weights_equal(chosen, models[2])
    assert report["chosen"] == "d2"
    assert report["accuracy"] == 1.0
    assert report["accuracies"]["d2"] == 1.0 and all(report["accuracies"][d] < 1.0 for d in ("d0", "d1", "d3"))
    chosen["conv.bias"][:] = 99.0
    assert not np.any(models[2]["conv.bias"] == 99.0)


def test_optfl_breaks_ties_by_the_earliest_update() -> None:
    updates = updates_for([constant_weights(1.0), constant_weights(2.0), constant_weights(3.0)])
    accuracy = {1.0: 0.5, 2.0: 0.9, 3.0: 0.9}
    chosen, report = OptFL().aggregate(updates[0].weights, updates, lambda w: accuracy[float(w["fc.weight"][0, 0])])
    assert report["chosen"] == "d1"
    assert_weights_equal(chosen, constant_weights(2.0))


def test_mixfl_accuracy_is_at_least_that_of_avefl_and_optfl() -> None:
    rng = np.random.default_rng(3)
    choices = set()
    for _ in range(20):
        models = [random_weights(rng) for _ in range(int(rng.integers(2, 6)))]
        updates = updates_for(models)
        # targets near the mean favour averaging; targets near one device favour OptFL.
        anchor = models[0] if rng.random() < 0.5 else weighted_average(models, [1.0] * len(models))
        evaluate = accuracy_towards({n: anchor[n] + 0.3 * rng.normal(size=anchor[n].shape) for n in anchor})
        acc_ave = evaluate(AveFL().aggregate(models[0], updates, None)[0])
        acc_opt = evaluate(OptFL().aggregate(models[0], updates, evaluate)[0])
        mixed, report = MixFL().aggregate(models[0], updates, evaluate)
        assert evaluate(mixed) >= max(acc_ave, acc_opt)
        assert report["acc_average"] == acc_ave and report["acc_best"] == acc_opt
        choices.add("average" if report["chosen"] == "average" else "device")
    assert choices == {"average", "device"}


def test_mixfl_prefers_the_average_on_a_tie_and_evaluates_each_model_once() -> None:
    updates = updates_for([constant_weights(0.0), constant_weights(2.0)])
    evaluated: list[float] = []

    def evaluate(weights: Weights) -> float:
        evaluated.append(float(weights["conv.bias"][0]))
        return 0.7

    mixed, report = MixFL().aggregate(updates[0].weights, updates, evaluate)
    assert sorted(evaluated) == [0.0, 1.0, 2.0]
    assert report["chosen"] == "average"
    assert_weights_equal(mixed, constant_weights(1.0))


def test_one_sgd_step_then_avefl_equals_one_step_with_the_mean_gradient() -> None:
    # Eq. 3-4: from a common W0, mean_i (W0 - lr * g_i) = W0 - lr * mean_i g_i.
    lr, devices = 0.1, 3
    model = build_model(seed=0).eval()
    w0 = get_weights(model)
    generator = torch.Generator().manual_seed(0)
    stepped, gradients = [], []
    for _ in range(devices):
        set_weights(model, w0)
        inputs = torch.randn(4, 1, 28, 28, generator=generator)
        labels = torch.randint(0, 10, (4,), generator=generator)
        optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.0)
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(inputs), labels).backward()
        gradients.append({name: p.grad.detach().numpy().astype(np.float64) for name, p in model.named_parameters()})
        optimizer.step()
        stepped.append(get_weights(model))
    averaged, _ = AveFL().aggregate(w0, updates_for(stepped), None)
    assert not np.allclose(stepped[0]["fc2.weight"], stepped[1]["fc2.weight"], atol=1e-6)
    for name in w0:
        mean_gradient = np.mean([g[name] for g in gradients], axis=0)
        np.testing.assert_allclose(averaged[name], w0[name] - lr * mean_gradient, rtol=0, atol=1e-6)


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_every_strategy_rejects_zero_updates_and_reports_json(name: str) -> None:
    strategy = make_strategy(name)
    evaluate = accuracy_towards(constant_weights(1.0))
    with pytest.raises(ValueError, match="zero updates"):
        strategy.aggregate(constant_weights(0.0), [], evaluate)
    metrics = {metric: (low + high) / 2 for metric, (low, high) in strategy.metric_bounds(10).items()}
    updates = [
        dataclasses.replace(update, metrics=metrics)
        for update in updates_for([constant_weights(0.0), constant_weights(2.0)], counts=[1, 2])
    ]
    _, report = strategy.aggregate(constant_weights(0.0), updates, evaluate)
    assert json.loads(json.dumps(report)) == report


@pytest.mark.parametrize("name", ["optfl", "mixfl"])
def test_strategies_that_need_evaluation_reject_none(name: str) -> None:
    strategy = make_strategy(name)
    assert strategy.needs_evaluation
    with pytest.raises(ValueError, match=f"'{name}' needs an evaluate function"):
        strategy.aggregate(constant_weights(0.0), updates_for([constant_weights(0.0)]), None)


def test_duplicate_devices_are_rejected() -> None:
    update = ClientUpdate("d0", constant_weights(0.0), 1)
    with pytest.raises(ValueError, match="more than one update from device\\(s\\) \\['d0'\\]"):
        AveFL().aggregate(update.weights, [update, update], None)


def test_registry_names_and_unknown_name() -> None:
    assert sorted(STRATEGIES) == [
        *("avefl", "cadis", "fedadagrad", "fedadam", "fedavg", "fedavgm", "fedyogi", "fmlu"),
        *("median", "mixfl", "optfl", "pooled-head", "trimmed-mean"),
    ]
    assert all(isinstance(make_strategy(n), STRATEGIES[n]) and make_strategy(n).name == n for n in STRATEGIES)
    assert not AveFL.needs_evaluation and not FedAvg.needs_evaluation
    assert OptFL.needs_evaluation and MixFL.needs_evaluation
    with pytest.raises(
        ValueError,
        match="'krum'; known: avefl, cadis, fedadagrad, fedadam, fedavg, fedavgm, fedyogi, fmlu, median, mixfl, optfl, pooled-head, trimmed-mean$",
    ):
        make_strategy("krum")
    with pytest.raises(ValueError, match="'avefl' does not take option\\(s\\) \\['trim'\\]; it takes: no options"):
        make_strategy("avefl", trim=0.2)
