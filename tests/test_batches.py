# Mini-batch boundaries: near-equal batches that cover every sample once; the training loop steps on them.
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from edge_agent.batches import batch_bounds
from edge_agent.models import build_model
from edge_agent.training import TrainSettings, run_epochs


@given(st.integers(0, 5000), st.integers(1, 300))
def test_batches_cover_every_sample_once_in_near_equal_sizes(count: int, batch_size: int) -> None:
    bounds = batch_bounds(count, batch_size)
    assert len(bounds) == math.ceil(count / batch_size)
    assert [start for start, _ in bounds] == [0, *[stop for _, stop in bounds[:-1]]][: len(bounds)]
    assert (bounds[-1][1] if bounds else 0) == count
    sizes = [stop - start for start, stop in bounds]
    assert all(size <= batch_size for size in sizes)
    assert not sizes or max(sizes) - min(sizes) <= 1


def test_1250_labels_in_batches_of_32_make_40_batches_of_31_or_32_not_a_last_one_of_2() -> None:
    sizes = [stop - start for start, stop in batch_bounds(1250, 32)]
    assert len(sizes) == 40 and sizes.count(32) == 10 and sizes.count(31) == 30
    with pytest.raises(ValueError, match="batch size must be at least 1, got 0"):
        batch_bounds(10, 0)


def test_the_training_loop_steps_on_near_equal_batches(fashion) -> None:
    seen: list[int] = []
    model = build_model(seed=0)

    def loss(inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        seen.append(len(inputs))
        return torch.nn.functional.cross_entropy(model(inputs), targets)

    images, labels = fashion.test_images[:34], fashion.test_labels[:34].astype(np.int64)
    run_epochs([model], images, labels, TrainSettings(epochs=2, batch_size=32, learning_rate=0.01), loss)
    assert seen == [17, 17, 17, 17]
