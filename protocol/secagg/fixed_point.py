# Fixed-point encoding of a float vector into integers mod 2^32, so masked vectors add exactly and wrap.
from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from protocol.errors import UsageError

MODULUS_BITS = 32
SIGNED_LIMIT = 2 ** (MODULUS_BITS - 1)


@dataclass(frozen=True)
class FixedPoint:
    """Values clipped to [-clip, clip] and scaled by 2^bits, with bits the most that keeps a sum of up to
    `max_summands` vectors inside the signed 32-bit range; a power-of-two scale decodes exactly in float64.

    Error bound: each coordinate of a decoded sum of n vectors within the clip is off by at most n / 2^(bits + 1)
    (each rounding is at most half a step); values beyond the clip are clipped first."""

    clip: float
    max_summands: int

    def __post_init__(self) -> None:
        if not (math.isfinite(self.clip) and self.clip > 0) or self.max_summands < 1:
            raise UsageError("fixed point needs a positive finite clip and at least one summand")
        if self.bits < 0:
            raise UsageError(f"clip {self.clip} with {self.max_summands} summands leaves no room in 32 bits")

    @property
    def bits(self) -> int:
        """Fraction bits: the largest b with max_summands * (clip * 2^b + 1/2) below 2^31."""
        room = (SIGNED_LIMIT - 1) / self.max_summands - 0.5
        return math.floor(math.log2(room / self.clip)) if room > 0 else -1

    @property
    def step(self) -> float:
        """One integer step in the value's units (2^-bits)."""
        return 2.0**-self.bits

    def error_bound(self, summands: int) -> float:
        """The most a coordinate of a decoded sum of `summands` vectors (each within the clip) can be off."""
        return summands * self.step / 2

    def encode(self, values: np.ndarray) -> np.ndarray:
        """The clipped, rounded values as uint32 (two's complement mod 2^32)."""
        clipped = np.clip(np.asarray(values, dtype=np.float64), -self.clip, self.clip)
        return np.rint(clipped * 2.0**self.bits).astype(np.int64).astype(np.uint32)

    def decode_sum(self, total: np.ndarray) -> np.ndarray:
        """The float64 sum a uint32 total of encoded vectors stands for (read as signed 32-bit)."""
        return np.asarray(total, dtype=np.uint32).view(np.int32).astype(np.float64) * self.step


Layout = dict[str, tuple[int, ...]]


def layout_of(tensors: Mapping[str, np.ndarray]) -> Layout:
    """Name -> shape of each tensor: the order (sorted names) and sizes every masked vector of a round shares."""
    return {name: tuple(tensors[name].shape) for name in sorted(tensors)}


def flat(tensors: Mapping[str, np.ndarray]) -> np.ndarray:
    """The tensors (sorted by name) as one flat vector."""
    return np.concatenate([np.ravel(tensors[name]) for name in sorted(tensors)]) if tensors else np.zeros(0)


def shaped(vector: np.ndarray, layout: Layout) -> dict[str, np.ndarray]:
    """The flat vector cut back into the layout's named tensors."""
    sizes = [math.prod(shape) for shape in layout.values()]
    parts = np.split(vector, np.cumsum(sizes)[:-1]) if sizes else []
    return {name: part.reshape(shape) for (name, shape), part in zip(layout.items(), parts)}
