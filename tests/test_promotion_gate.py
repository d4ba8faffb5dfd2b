# The promotion gate's rule (pure): a fall counts only beyond the spread its test set's size allows, overall and per
# class, on the set that decides.
from __future__ import annotations

import numpy as np
import pytest

from coordinator.rounds.promotion import (
    GateEvidence,
    PairedTable,
    PromotionGate,
    bonferroni_z,
    fall_lower_bound,
    paired_table,
    verdict,
    wilson,
)
from protocol.errors import UsageError

NAMES = [f"class{index}" for index in range(10)]
Z90 = 1.6448536269514722  # the one-sided 95% normal quantile


def table(*classes: tuple[int, int, int, int]) -> PairedTable:
    """A paired table from (both, lost, gained, neither) per class."""
    columns = np.array(classes, dtype=np.int64).T
    return PairedTable(columns[0], columns[1], columns[2], columns[3])


STEADY = (76, 4, 4, 16)  # 100 images of a class, both models at 0.80
NONE = table(*[(0, 0, 0, 0)] * 10)


def test_the_intervals_are_wilsons_and_newcombes() -> None:
    low, high = wilson(80, 100, 1.959963984540054)
    assert (round(low, 4), round(high, 4)) == (0.7112, 0.8666)  # the textbook Wilson interval of 80/100
    # 0.80 to 0.74 on 100 paired images (8 lost, 2 gained): Newcombe's method 10 at one-sided 95%
    assert fall_lower_bound(72, 8, 2, 18, Z90) == pytest.approx(0.0085237, abs=1e-7)
    assert fall_lower_bound(750, 50, 20, 180, bonferroni_z(0.95, 11)) == pytest.approx(0.0082539, abs=1e-7)
    assert bonferroni_z(0.95, 1) == pytest.approx(Z90) and bonferroni_z(0.95, 11) == pytest.approx(2.6086164)
    # two models that agree on every image never fell, however many images
    assert fall_lower_bound(800, 0, 0, 200, Z90) <= 0.0


def test_the_paired_table_counts_each_class_s_agreements() -> None:
    labels = np.array([0, 0, 0, 1, 1, 2])
    serving = np.array([0, 0, 1, 1, 0, 2])
    candidate = np.array([0, 1, 0, 1, 1, 0])
    counted = paired_table(labels, serving, candidate, 3)
    assert [counted.cells(index) for index in range(3)] == [(1, 1, 1, 0), (1, 0, 1, 0), (0, 1, 0, 0)]
    assert counted.cells(None) == (2, 2, 2, 0) and counted.images == 6


def test_noise_in_one_class_does_not_hold_a_better_round() -> None:
    """The camera demo's case: accuracy rises while one class of 100 images "fell" 6 points (8 lost, 2 gained)."""
    better = table(*[(76, 4, 5, 15)] * 9, (72, 8, 2, 18))
    judged = verdict(PromotionGate(), GateEvidence(better, NONE), NAMES)
    assert judged.promote
    assert judged.reason == (
        "accuracy 0.8030 against the serving model's 0.8000 on the server's test set (1000 images, 0.95 confidence): "
        "no fall beyond its tolerance"
    )


def test_a_class_that_fell_beyond_its_spread_holds_the_round() -> None:
    fell = table(*[(77, 3, 4, 16)] * 9, (60, 20, 2, 18))
    judged = verdict(PromotionGate(), GateEvidence(fell, NONE), NAMES)
    assert not judged.promote
    assert judged.reason == (
        "class class9 recall fell 18.0 points (0.8000 to 0.6200) on its 100 images of the server's test set: at "
        "least 6.6, beyond the 2-point tolerance (0.95 confidence)"
    )


def test_an_overall_fall_holds_beyond_its_spread_and_passes_within_it() -> None:
    gate = PromotionGate()
    fell = verdict(gate, GateEvidence(table(*[(75, 5, 2, 18)] * 10), NONE), NAMES)
    assert not fell.promote
    assert fell.reason == (
        "accuracy fell 3.0 points (0.8000 to 0.7700) on the server's test set (1000 images, 0.95 confidence): at "
        "least 0.8, beyond the 0.5-point tolerance"
    )
    within = verdict(gate, GateEvidence(table(*[(77, 3, 2, 18)] * 10), NONE), NAMES)
    assert within.promote and "accuracy 0.7900 against the serving model's 0.8000" in within.reason
    # the same 3-point fall on a tenth of the images is within what 100 images allow
    assert verdict(gate, GateEvidence(table(*[(8, 1, 0, 1)] * 7, *[(7, 0, 1, 2)] * 3), NONE), NAMES).promote


def test_the_field_set_decides_once_it_holds_enough_images() -> None:
    steady = table(*[STEADY] * 10)
    field = table(*[(15, 5, 0, 0)] * 10)  # 200 field images: the candidate lost a quarter of what serving got right
    assert verdict(PromotionGate(field_images=201), GateEvidence(steady, field), NAMES).promote
    judged = verdict(PromotionGate(field_images=200), GateEvidence(steady, field), NAMES)
    assert not judged.promote
    assert judged.reason.startswith("accuracy fell 25.0 points (1.0000 to 0.7500) on the field set (200 images")


def test_a_set_without_images_judges_nothing() -> None:
    judged = verdict(PromotionGate(), GateEvidence(NONE, NONE), NAMES)
    assert not judged.promote and judged.reason == "the server's test set holds no images to judge the round on"


@pytest.mark.parametrize(
    ("bad", "flag"),
    [
        ({"tolerance_points": -1.0}, "--promotion-tolerance"),
        ({"max_class_drop_points": 101.0}, "--promotion-max-class-drop"),
        ({"confidence": 1.0}, "--promotion-confidence"),
        ({"confidence": 0.2}, "--promotion-confidence"),
        ({"field_images": 0}, "--promotion-field-images"),
        ({"field_window": -1}, "--field-test-window must be 0"),
        ({"field_images": 50, "field_window": 40}, "--field-test-window 40 is below --promotion-field-images 50"),
    ],
)
def test_the_gate_refuses_settings_out_of_range(bad: dict, flag: str) -> None:
    with pytest.raises(UsageError, match=flag):
        PromotionGate(**bad)
