# Suspicion on a head-only fleet: honest heads are not flagged for a noisy bias; a head trained on shuffled labels is.
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from coordinator.intake.divergence import WHOLE_UPDATE, layer_divergence, suspicion_divergence, whole_divergence
from coordinator.intake.round_aggregator import SuspectPolicy, suspects_by_divergence
from protocol.tensors import Weights

RECORDED = Path(__file__).parent / "data" / "camera_head_updates.npz"
"""Rounds 1, 2 and 4 of a real run of the guide's commands (bench.camera_path) on bench.camera_fleet's default fleet
(4 field agents on the Pi Zero 2 W profile, EfficientNet-Lite0 head-only at 96 px, 5 classes, 50 scenes per class
on each device, 200 on the server, 20 labels a round, seed 0, --keep-updates) in which cam-3's person answered from
its answer key with the labels shuffled: each round's base head and the four heads sent, as float16."""


def recorded_round(round_id: int) -> tuple[Weights, dict[str, Weights]]:
    """(base head, device -> head sent) of one recorded round."""
    with np.load(RECORDED) as arrays:
        tensors: dict[str, dict[str, np.ndarray]] = {}
        for key in arrays.files:
            recorded, owner, name = key.split("/")
            if recorded == f"round{round_id}":
                tensors.setdefault(owner, {})[name] = arrays[key].astype(np.float32)
    base = tensors.pop("base")
    return base, tensors


def suspects(base: Weights, heads: dict[str, Weights]) -> dict[str, list[str]]:
    """The round's suspects as the round aggregator judges them (SuspectPolicy's defaults)."""
    return suspects_by_divergence({d: suspicion_divergence(w, base) for d, w in heads.items()}, SuspectPolicy())


@pytest.mark.parametrize(
    ("round_id", "expected"), [(1, {"cam-3": [WHOLE_UPDATE]}), (2, {}), (4, {"cam-3": [WHOLE_UPDATE]})]
)
def test_a_head_trained_on_shuffled_labels_is_flagged_and_honest_heads_are_not(round_id: int, expected: dict) -> None:
    base, heads = recorded_round(round_id)
    assert sorted(heads) == ["cam-0", "cam-1", "cam-2", "cam-3"] and len(base) == 2
    assert suspects(base, heads) == expected


def test_per_tensor_scores_flagged_an_honest_head_for_its_five_number_bias() -> None:
    base, heads = recorded_round(2)
    per_tensor = {device: layer_divergence(head, base) for device, head in heads.items()}
    assert suspects_by_divergence(per_tensor, SuspectPolicy()) == {"cam-1": ["classifier_fc.bias"]}


def test_a_model_of_four_tensors_or_more_is_still_judged_per_tensor() -> None:
    rng = np.random.default_rng(0)
    model = {f"layer{n}": rng.normal(size=(3, 3)) for n in range(4)}
    base = {name: value + 0.1 for name, value in model.items()}
    assert suspicion_divergence(model, base) == layer_divergence(model, base)
    head = {name: model[name] for name in ("layer0", "layer1")}
    base = {name: base[name] for name in head}
    whole = np.concatenate([head[name].ravel() for name in sorted(head)])
    difference = whole - np.concatenate([base[name].ravel() for name in sorted(head)])
    assert suspicion_divergence(head, base) == {
        WHOLE_UPDATE: pytest.approx(np.linalg.norm(difference) / np.linalg.norm(whole))
    }
    assert whole_divergence(head, base) == suspicion_divergence(head, base)[WHOLE_UPDATE]
