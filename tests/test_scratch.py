# The round's tensor scratch: weight sets written once, read back bit for bit as aligned read-only views.
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from coordinator.intake.scratch import ALIGNMENT, TensorScratch


def weight_set(seed: int) -> dict[str, np.ndarray]:
    """Tensors of several dtypes and odd sizes, so that alignment padding is needed between them."""
    rng = np.random.default_rng(seed)
    return {
        "w": rng.normal(size=(3, 5)).astype(np.float32),
        "b": rng.normal(size=7).astype(np.float64),
        "steps": rng.integers(0, 9, size=3).astype(np.int64),
        "empty": np.zeros((0, 4), np.float32),
    }


def test_sets_come_back_bit_for_bit_aligned_and_read_only(tmp_path: Path) -> None:
    with TensorScratch(tmp_path) as scratch:
        sets = {f"dev-{i}": weight_set(i) for i in range(5)}
        for key, weights in sets.items():
            scratch.put(key, weights)
        scratch.put("dev-2", weight_set(42))  # a later put replaces the earlier one
        sets["dev-2"] = weight_set(42)
        for key, weights in sets.items():
            back = scratch.get(key)
            assert list(back) == list(weights)
            for name, array in weights.items():
                assert back[name].dtype == array.dtype and np.array_equal(back[name], array)
                assert back[name].ctypes.data % min(ALIGNMENT, 16) == 0 and not back[name].flags.writeable
        assert len(scratch.layouts) == 1  # every set of the round shares one layout


def test_an_unknown_key_is_a_key_error_and_close_keeps_views_alive(tmp_path: Path) -> None:
    scratch = TensorScratch(tmp_path)
    scratch.put("a", weight_set(0))
    view = scratch.get("a")
    scratch.close()
    assert np.array_equal(view["w"], weight_set(0)["w"])
    with pytest.raises(KeyError):
        scratch.get("a")
