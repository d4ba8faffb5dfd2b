# Mini-batch boundaries shared by the torch and the numpy trainers: near-equal batches, never a stray tiny last one.
from __future__ import annotations

import math


def batch_bounds(count: int, batch_size: int) -> list[tuple[int, int]]:
    """(start, stop) of ceil(count / batch_size) consecutive batches whose sizes differ by at most one.

    Cutting every batch_size samples leaves a last batch of count % batch_size: with 1250 labels and batches of 32
    it holds 2 samples, and its full-size step on them (often the very last step before the device sends its
    weights) cost the bench 2-5 points in the rounds where it happened. Near-equal batches keep every step's size.
    """
    if batch_size < 1:
        raise ValueError(f"batch size must be at least 1, got {batch_size}")
    if count <= 0:
        return []
    batches = math.ceil(count / batch_size)
    small, extra = divmod(count, batches)
    bounds, start = [], 0
    for index in range(batches):
        stop = start + small + (1 if index < extra else 0)
        bounds.append((start, stop))
        start = stop
    return bounds
