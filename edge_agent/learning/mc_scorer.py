# The MC-dropout scorer interface, seeded dropout masks, and the batching loop every back end shares (no torch).
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from edge_agent.data.image_arrays import as_model_input

PrefixFunction = Callable[[np.ndarray], np.ndarray]
TailFunction = Callable[[np.ndarray, Sequence[np.ndarray]], np.ndarray]


class MCScorer(Protocol):
    """An MC-dropout back end: class probabilities of r stochastic passes, reproducible for a seed."""

    name: str

    def probabilities(self, images: np.ndarray, passes: int, seed: int) -> np.ndarray:
        """Softmax outputs (passes, N, C) for model inputs (float32 (N, C, H, W) in [0, 1]) or raw uint8 images."""


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


def batch_masks(
    seed: int, first_image: int, count: int, passes: int, spec: DropoutSpec, out: Sequence[np.ndarray] | None = None
) -> list[np.ndarray]:
    """Masks for `count` images starting at `first_image`, pass-major rows (passes * count, *shape).

    Each image's masks come from a generator seeded with (seed, image index), so they depend neither on the
    batch size nor on the back end: the same seed gives the same passes everywhere. `out` (from an earlier
    call with at least as many rows) is reused instead of allocating; the masks are its leading rows.
    """
    rows = passes * count
    if out is None or any(len(buffer) < rows for buffer in out):
        out = [np.empty((rows, *shape), dtype=np.float32) for shape in spec.mask_shapes]
    views = [buffer[:rows].reshape(passes, count, *shape) for buffer, shape in zip(out, spec.mask_shapes)]
    thresholds = [round(rate * MASK_LEVELS) for rate in spec.rates]
    scales = [np.float32(1.0 / (1.0 - rate)) for rate in spec.rates]
    for offset in range(count):
        rng = np.random.default_rng([seed, first_image + offset])
        for view, shape, threshold, scale in zip(views, spec.mask_shapes, thresholds, scales):
            keep = rng.integers(0, MASK_LEVELS, (passes, *shape), dtype=np.uint16) >= threshold
            np.multiply(keep, scale, out=view[:, offset], dtype=np.float32)
    return [buffer[:rows] for buffer in out]


def check_counts(passes: int, batch_size: int) -> None:
    """Raises ValueError for fewer than one pass or a batch size below one."""
    if passes < 1:
        raise ValueError(f"MC passes must be at least 1, got {passes}")
    if batch_size < 1:
        raise ValueError(f"inference batch size must be at least 1, got {batch_size}")


def check_pass_request(images: np.ndarray, passes: int, batch_size: int) -> None:
    """Raises ValueError for a non-image array, fewer than one pass or a batch size below one."""
    check_counts(passes, batch_size)
    scaled = images.ndim == 4 and images.dtype == np.float32
    raw = images.ndim in (3, 4) and images.dtype == np.uint8
    if not (scaled or raw):
        raise ValueError(
            "images must be model inputs (float32 (N, C, H, W) in [0, 1]) or raw uint8 (N, H, W) or (N, H, W, C), "
            f"got {images.dtype} {images.shape}"
        )


def tail_passes(
    tail: TailFunction,
    features: np.ndarray,
    masks: list[np.ndarray],
    passes: int,
    per_call: int,
    replication_buffer: np.ndarray | None,
) -> np.ndarray:
    """(passes, count, C) probabilities of one batch's features: the tail run on `per_call` passes at a time,
    the features replicated into the reused buffer (rows pass-major, masks row-aligned)."""
    count = len(features)
    out: np.ndarray | None = None
    for first_pass in range(0, passes, per_call):
        calls = min(per_call, passes - first_pass)
        rows = slice(first_pass * count, (first_pass + calls) * count)
        if calls == 1 or replication_buffer is None:
            replicated = features
        else:
            replicated = replication_buffer[: calls * count]
            replicated.reshape(calls, *features.shape)[...] = features
        probs = tail(replicated, [mask[rows] for mask in masks]).reshape(calls, count, -1)
        if out is None:
            out = np.empty((passes, count, probs.shape[-1]), dtype=np.float32)
        out[first_pass : first_pass + calls] = probs
    assert out is not None
    return out


def mc_probabilities(
    prefix: PrefixFunction,
    tail: TailFunction,
    spec: DropoutSpec,
    images: np.ndarray,
    passes: int,
    seed: int,
    batch_size: int,
    tail_rows: int | None = None,
) -> np.ndarray:
    """(passes, N, C) float32 probabilities ((passes, 0, 0) for no images): the prefix once per image, the tail r times.

    Images are model inputs (float32 (N, C, H, W) in [0, 1]) or raw uint8 (N, H, W) / (N, H, W, C); raw images are scaled a batch at a
    time, so a pool is never held as float32 (it may be a read-only memory map). Each batch of `batch_size`
    images runs through the prefix once, then the tail as mc_feature_probabilities runs it.
    """
    check_pass_request(images, passes, batch_size)

    def batch_features(start: int, stop: int) -> np.ndarray:
        """The prefix's output of images [start, stop)."""
        batch = images[start:stop]
        return prefix(as_model_input(batch))

    return mc_feature_probabilities(batch_features, len(images), tail, spec, passes, seed, batch_size, tail_rows)


def mc_feature_probabilities(
    batch_features: Callable[[int, int], np.ndarray],
    count: int,
    tail: TailFunction,
    spec: DropoutSpec,
    passes: int,
    seed: int,
    batch_size: int,
    tail_rows: int | None = None,
) -> np.ndarray:
    """(passes, N, C) float32 probabilities of N samples whose prefix outputs `batch_features(start, stop)` gives
    (computed, or read from a feature cache): the tail r times per batch of `batch_size`.

    The tail runs on a batch's features replicated for as many passes as fit in `tail_rows` rows per call (at
    least one pass; None: all passes in one call). Rows of a call are pass-major; masks come from batch_masks by
    sample position, so the same seed gives the same passes whatever the batch size, tail_rows, and whether the
    features were computed or cached. Mask and replication buffers are reused from batch to batch.
    """
    check_counts(passes, batch_size)
    if tail_rows is not None and tail_rows < 1:
        raise ValueError(f"tail rows per call must be at least 1, got {tail_rows}")
    result = np.empty((passes, 0, 0), dtype=np.float32)
    mask_buffers: list[np.ndarray] | None = None
    replication_buffer: np.ndarray | None = None
    for start in range(0, count, batch_size):
        features = batch_features(start, min(start + batch_size, count))
        rows = len(features)
        masks = mask_buffers = batch_masks(seed, start, rows, passes, spec, mask_buffers)
        per_call = passes if tail_rows is None else max(1, min(passes, tail_rows // rows))
        if per_call > 1 and (replication_buffer is None or len(replication_buffer) < per_call * rows):
            replication_buffer = np.empty((per_call * rows, *features.shape[1:]), dtype=features.dtype)
        probs = tail_passes(tail, features, masks, passes, per_call, replication_buffer)
        if start == 0:
            result = np.empty((passes, count, probs.shape[-1]), dtype=np.float32)
        result[:, start : start + rows] = probs
    return result
