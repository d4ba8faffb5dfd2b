# The MC-dropout scorer interface, seeded dropout masks, and the batching loop every back end shares (no torch).
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol, Sequence

import numpy as np

PrefixFunction = Callable[[np.ndarray], np.ndarray]
TailFunction = Callable[[np.ndarray, Sequence[np.ndarray]], np.ndarray]


class MCScorer(Protocol):
    """An MC-dropout back end: class probabilities of r stochastic passes, reproducible for a seed."""

    name: str

    def probabilities(self, images: np.ndarray, passes: int, seed: int) -> np.ndarray:
        """Softmax outputs shaped (passes, N, C) for normalised images shaped (N, 1, 28, 28)."""


MASK_LEVELS = 1 << 16


@dataclass(frozen=True)
class DropoutSpec:
    """The dropout layers of a tail: their rates and the per-sample shape of each layer's mask."""

    rates: tuple[float, ...]
    mask_shapes: tuple[tuple[int, ...], ...]

    def __post_init__(self) -> None:
        if len(self.rates) != len(self.mask_shapes):
            raise ValueError(f"{len(self.rates)} dropout rates but {len(self.mask_shapes)} mask shapes")
        if not all(0.0 <= rate < 1.0 for rate in self.rates):
            raise ValueError(f"dropout rates must lie in [0, 1), got {self.rates}")


def dropout_masks(rng: np.random.Generator, rows: int, spec: DropoutSpec) -> list[np.ndarray]:
    """One float32 mask per dropout layer, shaped (rows, *shape): 0 with probability p, else 1/(1-p).

    The scaling is in the mask, so a tail multiplies by it and nothing else. The draws are 16-bit integers
    (p is taken to the nearest 1/65536, exact for the paper's 0.25 and 0.5), which is several times cheaper
    than float draws and matters because masks are a large share of the scoring work.
    """
    masks = []
    for rate, shape in zip(spec.rates, spec.mask_shapes):
        keep = rng.integers(0, MASK_LEVELS, (rows, *shape), dtype=np.uint16) >= round(rate * MASK_LEVELS)
        masks.append(keep.astype(np.float32) * np.float32(1.0 / (1.0 - rate)))
    return masks


def batch_masks(seed: int, first_image: int, count: int, passes: int, spec: DropoutSpec) -> list[np.ndarray]:
    """Masks for `count` images starting at `first_image`, pass-major rows (passes * count, *shape).

    Each image's masks come from a generator seeded with (seed, image index), so they depend neither on the
    batch size nor on the back end: the same seed gives the same passes everywhere.
    """
    per_image = [dropout_masks(np.random.default_rng([seed, first_image + offset]), passes, spec)
                 for offset in range(count)]
    return [np.stack([masks[layer] for masks in per_image], axis=1).reshape(passes * count, *shape)
            for layer, shape in enumerate(spec.mask_shapes)]


def check_pass_request(images: np.ndarray, passes: int, batch_size: int) -> None:
    """Raises ValueError for a non-image array, fewer than one pass or a batch size below one."""
    if passes < 1:
        raise ValueError(f"MC passes must be at least 1, got {passes}")
    if batch_size < 1:
        raise ValueError(f"inference batch size must be at least 1, got {batch_size}")
    if images.ndim != 4 or images.dtype != np.float32:
        raise ValueError(f"images must be normalised float32 shaped (N, 1, H, W), got {images.dtype} {images.shape}")


def mc_probabilities(
    prefix: PrefixFunction, tail: TailFunction, spec: DropoutSpec, images: np.ndarray, passes: int, seed: int, batch_size: int,
) -> np.ndarray:
    """(passes, N, C) probabilities ((passes, 0, 0) for no images): the prefix once per image, the tail on each batch replicated `passes` times.

    Rows of a replicated batch are pass-major (pass 0's images first); masks come from batch_masks, so the
    same seed gives the same passes whatever the batch size.
    """
    images = np.ascontiguousarray(images)
    check_pass_request(images, passes, batch_size)
    result = np.empty((passes, 0, 0), dtype=np.float32)
    for start in range(0, len(images), batch_size):
        features = prefix(images[start:start + batch_size])
        count = len(features)
        replicated = np.broadcast_to(features, (passes, *features.shape)).reshape(passes * count, *features.shape[1:])
        probs = tail(replicated, batch_masks(seed, start, count, passes, spec)).reshape(passes, count, -1)
        if start == 0:
            result = np.empty((passes, len(images), probs.shape[-1]), dtype=np.float32)
        result[:, start:start + count] = probs
    return result
