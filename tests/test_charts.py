# Tests for the report's charts at fleet scale: a thousand devices give readable, bounded images.
from __future__ import annotations

import io

import numpy as np
from PIL import Image

from coordinator.dashboard.charts import (
    DPI,
    MAX_HEATMAP_DEVICES,
    accuracy_chart,
    class_accuracy_chart,
    device_series,
    device_spread,
    divergence_heatmap,
    heatmap_rows,
    new_figure,
)


def size_of(png: bytes) -> tuple[int, int]:
    """(width, height) in pixels of a PNG."""
    return Image.open(io.BytesIO(png)).size


def test_heatmap_rows_keep_the_suspects_then_the_most_divergent_in_the_views_order():
    values = np.array([[0.1, 0.2], [0.9, np.nan], [0.3, 0.05], [np.nan, np.nan], [0.5, 0.4]])
    devices = ["a", "b", "c", "d", "e"]
    assert heatmap_rows(values, devices, {"d": ["w"]}, limit=3) == [1, 3, 4]  # d (suspect), then b 0.9, e 0.5
    assert heatmap_rows(values, devices, {}, limit=5) == [0, 1, 2, 3, 4]


def test_a_thousand_devices_make_a_heatmap_of_at_most_its_row_limit():
    rng = np.random.default_rng(0)
    layers = [f"layer{i}" for i in range(11)]
    devices = [f"dev-{i:04d}" for i in range(1000)]
    view = {
        "round": 3,
        "layers": layers,
        "devices": devices,
        "values": rng.random((1000, 11)).tolist(),
        "suspects": {"dev-0007": ["layer2"]},
    }
    _, height = size_of(divergence_heatmap(view))
    assert height <= (1.6 + 0.45 * MAX_HEATMAP_DEVICES) * DPI  # (it was 1.6 + 0.45 x 1000 inches: 45,000 pixels)


def test_many_devices_are_drawn_as_their_median_and_spread():
    per_device = {f"dev-{i}": [i / 100, None, 0.5] for i in range(21)}
    assert device_series(per_device) == {"median of 21 devices": [0.1, None, 0.5]}
    assert device_series({"a": [0.2], "b": [0.4]}) == {"a": [0.2], "b": [0.4]}
    rounds = [
        {"round": r, "accuracy": 0.5, "labels": 100 * r, "device_accuracy": {f"d{i}": i / 40 for i in range(40)}}
        for r in (1, 2)
    ]
    axes = new_figure(7, 3.6).add_subplot()
    device_spread(axes, rounds, 40)
    (median,) = axes.get_lines()  # one line for the 40 devices, not 40
    assert list(median.get_ydata()) == [0.4875, 0.4875]  # (19/40 + 20/40) / 2
    assert accuracy_chart(rounds) and class_accuracy_chart(
        {"round": 2, "classes": [0, 1, 2], "aggregate": [0.7, 0.6, 0.5], "devices": per_device}
    )
