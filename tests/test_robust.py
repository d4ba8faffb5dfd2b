# Unit tests for robust aggregation (coordinate median, trimmed mean) and the divergence outlier scores (issue #5).
import json

import numpy as np
import pytest

from coordinator.intake.divergence import flag_suspects, fleet_divergence, robust_z_scores, suspect_scores
from coordinator.strategies.aggregate import ClientUpdate, coordinate_median, trimmed_count, trimmed_mean
from coordinator.strategies.means import AveFL
from coordinator.strategies.registry import make_strategy
from coordinator.strategies.robust import Median, TrimmedMean
from protocol.tensors import Weights

SHAPES = {"conv.weight": (4, 1, 3, 3), "conv.bias": (4,), "fc.weight": (2, 4)}


def random_weights(rng: np.random.Generator, dtype: type = np.float32) -> Weights:
    """Weights with the SHAPES layout, standard normal entries."""
    return {name: rng.normal(size=shape).astype(dtype) for name, shape in SHAPES.items()}


def near(weights: Weights, rng: np.random.Generator, scale: float = 0.01) -> Weights:
    """The weights plus small normal noise."""
    return {name: (array + scale * rng.normal(size=array.shape)).astype(array.dtype) for name, array in weights.items()}


def column_sets(columns: list[list[float]]) -> list[Weights]:
    """One weight set {"w": [...]} per device from per-coordinate lists: columns[j][i] is device i's coordinate j."""
    return [{"w": np.array(values, dtype=np.float32)} for values in zip(*columns)]


def trimmed_by_a_fifth(weight_sets: list[Weights]) -> Weights:
    """trimmed_mean with trim 0.2."""
    return trimmed_mean(weight_sets, 0.2)


COMBINERS = pytest.mark.parametrize("combine", [coordinate_median, trimmed_by_a_fifth], ids=["median", "trimmed"])


def updates_for(weight_sets: list[Weights]) -> list[ClientUpdate]:
    """One update per weight set, from devices d0, d1, ..."""
    return [ClientUpdate(f"d{i}", weights, 10) for i, weights in enumerate(weight_sets)]


# --- coordinate median -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [3, 4])
def test_median_equals_numpy_median_per_coordinate(n: int) -> None:
    rng = np.random.default_rng(0)
    sets = [random_weights(rng) for _ in range(n)]
    median = coordinate_median(sets)
    for name in SHAPES:
        stacked = np.stack([weights[name].astype(np.float64) for weights in sets])
        np.testing.assert_array_equal(median[name], np.median(stacked, axis=0).astype(np.float32))
        assert median[name].dtype == np.float32


def test_median_hand_example() -> None:
    # odd n: the middle value; even n: the mean of the middle two, (2 + 6) / 2 = 4
    np.testing.assert_array_equal(coordinate_median(column_sets([[9.0, -1.0, 5.0]]))["w"], [5.0])
    np.testing.assert_array_equal(coordinate_median(column_sets([[9.0, 2.0, -1.0, 6.0]]))["w"], [4.0])


def test_median_stays_in_the_honest_range_when_one_device_sends_fifty_times_the_model() -> None:
    rng = np.random.default_rng(1)
    model = random_weights(rng)
    honest = [near(model, rng) for _ in range(4)]
    attacker = {name: 50.0 * array for name, array in model.items()}
    sets = honest[:2] + [attacker] + honest[2:]
    median = coordinate_median(sets)
    averaged = AveFL().aggregate(model, updates_for(sets), None)[0]
    for name in SHAPES:
        low = np.min([weights[name] for weights in honest], axis=0)
        high = np.max([weights[name] for weights in honest], axis=0)
        assert np.all((low <= median[name]) & (median[name] <= high))
        # the plain mean is dragged about 49/5 ~ 10 model-sizes away, so the check above is not vacuous
        assert not np.all((low <= averaged[name]) & (averaged[name] <= high))
    strategy_result, report = Median().aggregate(model, updates_for(sets), None)
    for name in SHAPES:
        np.testing.assert_array_equal(strategy_result[name], median[name])
    assert report == {"method": "median"}


# --- trimmed mean -----------------------------------------------------------------------------------------------


def test_trimmed_mean_with_zero_trim_is_the_plain_mean() -> None:
    rng = np.random.default_rng(2)
    sets = [random_weights(rng) for _ in range(5)]
    trimmed = trimmed_mean(sets, 0.0)
    for name in SHAPES:
        expected = np.mean([weights[name].astype(np.float64) for weights in sets], axis=0)
        np.testing.assert_allclose(trimmed[name], expected, rtol=1e-6, atol=1e-7)


def test_trimmed_mean_of_five_with_trim_point_two_drops_one_value_from_each_end_per_coordinate() -> None:
    # floor(0.2 * 5) = 1 per end, chosen per coordinate, so different devices are dropped in each column:
    #   [7, -1, 3, 100, 2]  sorted [-1, 2, 3, 7, 100]  -> drop -1 (d1) and 100 (d3) -> (2 + 3 + 7) / 3 = 4
    #   [40, 0, 30, 10, 20] sorted [0, 10, 20, 30, 40] -> drop 0 (d1) and 40 (d0)   -> (10 + 20 + 30) / 3 = 20
    #   [5, 5, 5, 5, -50]   sorted [-50, 5, 5, 5, 5]   -> drop -50 and one 5         -> 5
    # (the plain mean of the first column is 111 / 5 = 22.2 and its median 3; neither is 4)
    sets = column_sets([[7.0, -1.0, 3.0, 100.0, 2.0], [40.0, 0.0, 30.0, 10.0, 20.0], [5.0, 5.0, 5.0, 5.0, -50.0]])
    np.testing.assert_array_equal(trimmed_mean(sets, 0.2)["w"], [4.0, 20.0, 5.0])
    # floor(0.19 * 5) = 0: nothing dropped, the plain mean (111 / 5, 100 / 5, -30 / 5)
    np.testing.assert_allclose(trimmed_mean(sets, 0.19)["w"], [22.2, 20.0, -6.0], rtol=1e-6)
    # floor(0.4 * 5) = 2 per end leaves the middle value: the median
    np.testing.assert_array_equal(trimmed_mean(sets, 0.4)["w"], coordinate_median(sets)["w"])


@pytest.mark.parametrize(("n", "trim", "dropped"), [(5, 0.2, 1), (4, 0.2, 0), (10, 0.2, 2), (5, 0.19, 0), (3, 0.49, 1)])
def test_trimmed_count_is_floor_of_trim_times_n(n: int, trim: float, dropped: int) -> None:
    assert trimmed_count(n, trim) == dropped


def test_every_trim_below_one_half_leaves_at_least_one_value() -> None:
    for n in range(1, 60):
        for trim in (0.0, 0.25, 0.4, 0.49, 0.4999999):
            assert n - 2 * trimmed_count(n, trim) >= 1


@pytest.mark.parametrize("trim", [0.5, 0.7, 1.0, -0.1, float("nan"), True, "0.2", None])
def test_bad_trim_is_rejected(trim: object) -> None:
    sets = [random_weights(np.random.default_rng(3)) for _ in range(4)]
    with pytest.raises(ValueError, match="trim must be a number in \\[0, 0.5\\)"):
        trimmed_mean(sets, trim)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="--trim must (lie in \\[0, 0.5\\)|be a finite number)"):
        TrimmedMean(trim)  # type: ignore[arg-type]


def test_no_weight_sets_leaves_nothing_to_aggregate() -> None:
    with pytest.raises(ValueError, match="at least one value to trim, got 0"):
        trimmed_mean([], 0.2)
    with pytest.raises(ValueError, match="at least one weight set"):
        coordinate_median([])


def test_trimmed_mean_accumulates_in_float64() -> None:
    # (1 + 1e8 - 1e8) / 3 = 1/3; a float32 accumulator loses the 1 next to 1e8 (its spacing there is 8).
    np.testing.assert_allclose(trimmed_mean(column_sets([[1.0, 1e8, -1e8]]), 0.0)["w"], [1.0 / 3.0], rtol=1e-6)


# --- shared properties ------------------------------------------------------------------------------------------


@COMBINERS
def test_robust_aggregates_are_order_invariant(combine) -> None:
    rng = np.random.default_rng(4)
    sets = [random_weights(rng) for _ in range(7)]
    reference = combine(sets)
    for _ in range(3):
        permuted = combine([sets[i] for i in rng.permutation(len(sets))])
        for name in SHAPES:
            np.testing.assert_array_equal(permuted[name], reference[name])


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
@COMBINERS
def test_robust_aggregates_preserve_the_input_dtype(combine, dtype: type) -> None:
    rng = np.random.default_rng(5)
    result = combine([random_weights(rng, dtype) for _ in range(5)])
    assert list(result) == list(SHAPES)
    assert all(result[name].dtype == dtype and result[name].shape == shape for name, shape in SHAPES.items())


@COMBINERS
def test_robust_aggregates_reject_mismatched_layouts(combine) -> None:
    base = random_weights(np.random.default_rng(6))
    reshaped = dict(base, **{"conv.bias": np.ones(5, dtype=np.float32)})
    with pytest.raises(
        ValueError, match="weight set 2 differs: tensor 'conv.bias' has shape \\(5,\\), expected \\(4,\\)"
    ):
        combine([base, base, reshaped])
    retyped = dict(base, **{"conv.bias": base["conv.bias"].astype(np.float64)})
    with pytest.raises(ValueError, match="'conv.bias' has dtype float64, expected float32"):
        combine([base, retyped, base])
    renamed = {("fc.w" if name == "fc.weight" else name): array for name, array in base.items()}
    with pytest.raises(ValueError, match="missing \\['fc.weight'\\], unexpected \\['fc.w'\\]"):
        combine([base, renamed, base])


# --- strategies and the registry --------------------------------------------------------------------------------


def test_trimmed_mean_strategy_through_make_strategy_with_and_without_options() -> None:
    # per coordinate d0..d4 hold 0, 1, 2, 3, 100: trim 0.2 drops 0 and 100 -> (1 + 2 + 3) / 3 = 2;
    # trim 0 keeps all -> 106 / 5 = 21.2
    sets = [{name: np.full(shape, v, dtype=np.float32) for name, shape in SHAPES.items()} for v in (0, 1, 2, 3, 100)]
    default = make_strategy("trimmed-mean")
    assert isinstance(default, TrimmedMean) and default.trim == 0.2
    trimmed, report = default.aggregate(sets[0], updates_for(sets), None)
    assert all(np.all(trimmed[name] == 2.0) for name in SHAPES)
    assert report == {"method": "trimmed-mean", "trim": 0.2, "dropped_per_end": 1}
    assert json.loads(json.dumps(report)) == report
    untrimmed, report = make_strategy("trimmed-mean", trim=0.0).aggregate(sets[0], updates_for(sets), None)
    assert all(np.allclose(untrimmed[name], 21.2) for name in SHAPES)
    assert report == {"method": "trimmed-mean", "trim": 0.0, "dropped_per_end": 0}


def test_median_strategy_through_make_strategy() -> None:
    strategy = make_strategy("median")
    assert isinstance(strategy, Median) and not strategy.needs_evaluation and not TrimmedMean.needs_evaluation
    sets = column_sets([[9.0, -1.0, 5.0]])
    median, report = strategy.aggregate(sets[0], updates_for(sets), None)
    np.testing.assert_array_equal(median["w"], [5.0])
    assert report == {"method": "median"}


def test_make_strategy_rejects_options_a_strategy_does_not_take() -> None:
    with pytest.raises(ValueError, match="'trimmed-mean' does not take option\\(s\\) \\['trimm'\\]; it takes: trim$"):
        make_strategy("trimmed-mean", trimm=0.1)
    with pytest.raises(ValueError, match="'median' does not take option\\(s\\) \\['trim'\\]; it takes: no options"):
        make_strategy("median", trim=0.1)
    with pytest.raises(ValueError, match="--trim must lie in \\[0, 0.5\\), got 0.5"):
        make_strategy("trimmed-mean", trim=0.5)


# --- divergence outlier scores ----------------------------------------------------------------------------------


def test_identical_divergences_score_zero_and_flag_nobody() -> None:
    for value in (0.3, 0.0):
        fleet = {f"d{i}": {"conv": value, "fc": value} for i in range(5)}
        assert suspect_scores(fleet) == {device: {"conv": 0.0, "fc": 0.0} for device in fleet}
        assert flag_suspects(fleet) == {}


def test_robust_z_hand_example() -> None:
    # [0.1, 0.2, 0.3, 0.4, 1.0]: median 0.3; |x - 0.3| = [0.2, 0.1, 0, 0.1, 0.7] -> MAD 0.1; scale 1.4826 * 0.1
    #   z = [-0.2, -0.1, 0, 0.1, 0.7] / 0.14826 = [-1.34898, -0.67449, 0, 0.67449, 4.72144]
    # [1, 2, 3, 4, 5]: median 3; |x - 3| = [2, 1, 0, 1, 2] -> MAD 1; z = [-2, -1, 0, 1, 2] / 1.4826, antisymmetric
    fleet = {
        device: {"conv": skewed, "fc": even}
        for device, skewed, even in zip("abcde", [0.1, 0.2, 0.3, 0.4, 1.0], [1.0, 2.0, 3.0, 4.0, 5.0])
    }
    scores = suspect_scores(fleet)
    conv, fc = [scores[d]["conv"] for d in "abcde"], [scores[d]["fc"] for d in "abcde"]
    assert conv == pytest.approx([-1.34898, -0.67449, 0.0, 0.67449, 4.72144], abs=1e-5)
    assert fc == pytest.approx([-2 / 1.4826, -1 / 1.4826, 0.0, 1 / 1.4826, 2 / 1.4826])
    assert scores["a"]["fc"] == -scores["e"]["fc"] and scores["b"]["fc"] == -scores["d"]["fc"]
    assert flag_suspects(fleet) == {"e": ["conv"]}
    assert flag_suspects(fleet, threshold=5.0) == {}
    # one-sided: a and b sit below the median on both layers and are never flagged
    assert flag_suspects(fleet, threshold=0.5) == {"d": ["conv", "fc"], "e": ["conv", "fc"]}


def test_one_device_fifty_times_the_others_on_one_layer_is_flagged_on_that_layer_only() -> None:
    # honest divergences 0.10, 0.12, ..., 0.20 in a different device order per layer: median 0.15, MAD 0.03, so
    # |z| <= 0.05 / (1.4826 * 0.03) = 1.12; pi-3's conv.bias becomes 50x its value (>= 5, z in the hundreds)
    rng = np.random.default_rng(7)
    spread = {name: rng.permutation([0.10, 0.12, 0.14, 0.16, 0.18, 0.20]) for name in SHAPES}
    fleet = {f"pi-{i}": {name: float(spread[name][i]) for name in SHAPES} for i in range(6)}
    fleet["pi-3"]["conv.bias"] *= 50.0
    scores = suspect_scores(fleet)
    assert scores["pi-3"]["conv.bias"] > 3.5
    others = [z for d, layers in scores.items() for name, z in layers.items() if (d, name) != ("pi-3", "conv.bias")]
    assert max(abs(z) for z in others) < 3.5
    assert flag_suspects(fleet) == {"pi-3": ["conv.bias"]}


def test_a_lone_outlier_among_identical_values_gets_a_huge_finite_score() -> None:
    # MAD = 0, floored at 1e-12 * median: z = (10 - 0.2) / (1.4826 * 1e-12 * 0.2) ~ 3.3e13
    scores = robust_z_scores([0.2, 0.2, 10.0, 0.2, 0.2])
    assert list(scores[[0, 1, 3, 4]]) == [0.0] * 4
    assert scores[2] == pytest.approx(9.8 / (1.4826 * 1e-12 * 0.2))
    # median 0: the floor is 1e-12 itself, z = 0.5 / 1.4826e-12
    assert robust_z_scores([0.0, 0.0, 0.5])[2] == pytest.approx(0.5 / 1.4826e-12)


def test_fewer_than_three_devices_score_zero() -> None:
    assert suspect_scores({"a": {"w": 0.1}, "b": {"w": 5.0}}) == {"a": {"w": 0.0}, "b": {"w": 0.0}}
    assert flag_suspects({"a": {"w": 0.1}, "b": {"w": 5.0}}) == {}
    assert flag_suspects({"a": {"w": float("inf")}}) == {}
    assert suspect_scores({}) == {} and flag_suspects({}) == {}


def test_an_infinite_divergence_scores_infinity_and_does_not_move_the_others() -> None:
    # an all-zero device layer has divergence inf (see relative_divergence); the rest are scored among themselves:
    # [0.1, 0.2, 0.3]: median 0.2, MAD 0.1 -> z = [-0.1, 0, 0.1] / 0.14826 = [-0.67449, 0, 0.67449]
    scores = robust_z_scores([0.1, float("inf"), 0.2, 0.3])
    assert scores[1] == float("inf")
    assert list(scores[[0, 2, 3]]) == pytest.approx([-0.67449, 0.0, 0.67449], abs=1e-5)
    fleet = {"a": {"w": 0.1}, "zeros": {"w": float("inf")}, "b": {"w": 0.2}, "c": {"w": 0.3}}
    assert flag_suspects(fleet) == {"zeros": ["w"]}


def test_suspect_scores_from_real_weights_find_the_scaled_layer() -> None:
    # honest devices are the model plus 1% noise (divergence ~0.01); the attacker sends 50x the model's conv.bias,
    # whose divergence from the median aggregate is |50W - W| / |50W| ~ 0.98.
    rng = np.random.default_rng(8)
    model = random_weights(rng)
    updates = {f"pi-{i}": near(model, rng) for i in range(5)}
    updates["attacker"] = dict(near(model, rng), **{"conv.bias": 50.0 * model["conv.bias"]})
    aggregate = coordinate_median(list(updates.values()))
    fleet = fleet_divergence(updates, aggregate)
    assert flag_suspects(fleet) == {"attacker": ["conv.bias"]}


def test_bad_divergence_input_is_rejected() -> None:
    with pytest.raises(ValueError, match="non-negative numbers"):
        suspect_scores({"a": {"w": 0.1}, "b": {"w": float("nan")}, "c": {"w": 0.2}})
    with pytest.raises(ValueError, match="non-negative numbers"):
        robust_z_scores([0.1, -0.2, 0.3])
    with pytest.raises(ValueError, match="'c' differs in layers from 'a': missing \\['fc'\\], unexpected \\['fx'\\]"):
        suspect_scores({"a": {"w": 0.1, "fc": 0.1}, "b": {"fc": 0.1, "w": 0.1}, "c": {"w": 0.1, "fx": 0.1}})
    with pytest.raises(ValueError, match="threshold must be a finite number"):
        flag_suspects({"a": {"w": 0.1}}, threshold=float("nan"))
