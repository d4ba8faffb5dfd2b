# Aggregation math over named numpy tensors: an order-independent exact-grid weighted sum, medians, trimmed means.
from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from protocol.errors import RefusalError
from protocol.messages import RejectionKind
from protocol.tensors import LayoutError, Weights, WeightSpec, check_layout, spec_of

FRACTION_BITS = 48  # each term c_i * W_i is rounded to a multiple of 2^-48 (far below float32 resolution)
LIMB_BITS = 32  # a term on that grid is split into a high and a low int64 limb
LIMIT = 2.0**46  # |sum of terms| must stay below this (checked per tensor, so the high limb can never wrap)
MAX_ABS_WEIGHT = 2.0**30  # a weight beyond this is refused at intake: no model trains to it, and sums stay in range
DEFAULT_MAX_SAMPLE_SHARE = 0.5  # the command lines' cap: no device's claimed samples outweigh all the others together


class OutOfRange(RefusalError, ValueError):
    """Values an aggregate cannot take (beyond MAX_ABS_WEIGHT, beyond the exact sum's range, beyond a DP round's
    clip): the device's update is refused as out_of_range. Any other error raised while aggregating is a bug."""

    kind = RejectionKind.OUT_OF_RANGE


@dataclass(frozen=True)
class ClientUpdate:
    """One device's model for a round, with its labelled-sample count (as a strategy weighs it: possibly clipped by
    the sample-share cap), the local metrics it reported, and how many devices' data it sums (a relay's contributors)."""

    device_id: str
    weights: Weights
    num_samples: float
    metrics: Mapping[str, float] = field(default_factory=dict)
    devices: int = 1


class ExactSum:
    """sum_i x_i of float64 arrays whose result does not depend on the order of the additions.

    Each x_i is first rounded to the grid of multiples of 2^-FRACTION_BITS (a deterministic function of x_i
    alone), then added as two int64 limbs. Integer addition is exact, so any order of the same terms gives the
    same bits; the only rounding is per term, at most 2^-49 absolute. A term or running total beyond LIMIT in
    magnitude is OutOfRange before anything is added (the limbs then cannot overflow).
    """

    def __init__(self, shape: tuple[int, ...]) -> None:
        self.high = np.zeros(shape, dtype=np.int64)
        self.low = np.zeros(shape, dtype=np.int64)
        self.bound = 0.0

    def add(self, values: np.ndarray) -> None:
        """Adds one array of the accumulator's shape."""
        self.add_checked(values, self.check(values))

    def check(self, values: np.ndarray) -> float:
        """The largest magnitude in values; OutOfRange (nothing changed) if adding them would leave the range."""
        largest = float(np.max(np.abs(values), initial=0.0))
        if not largest < LIMIT or self.bound + largest >= LIMIT:
            raise OutOfRange(f"values up to {largest:.3g} would take the sum beyond {LIMIT:.3g}")
        return largest

    def add_checked(self, values: np.ndarray, largest: float) -> None:
        """Adds values whose largest magnitude check() returned (in place where it can: this runs once per tensor of
        every accepted update)."""
        grid = np.multiply(values, 2.0**FRACTION_BITS)  # scaling by a power of two is exact, as ldexp is
        np.rint(grid, out=grid)
        high = np.multiply(grid, 2.0**-LIMB_BITS)
        np.floor(high, out=high)
        self.high += high.astype(np.int64)
        np.multiply(high, 2.0**LIMB_BITS, out=high)
        np.subtract(grid, high, out=grid)
        self.low += grid.astype(np.int64)
        self.bound += largest

    def total(self) -> np.ndarray:
        """The sum in float64 (one final rounding of the exact grid value)."""
        carried = self.high + (self.low >> LIMB_BITS)
        remainder = self.low & ((1 << LIMB_BITS) - 1)
        return np.ldexp(carried.astype(np.float64), LIMB_BITS - FRACTION_BITS) + np.ldexp(
            remainder.astype(np.float64), -FRACTION_BITS
        )


@dataclass
class RunningSum:
    """sum_i c_i W_i per tensor (order-independent) and each c_i, over the updates added so far: one model of memory."""

    spec: WeightSpec = field(default_factory=dict)
    sums: dict[str, ExactSum] = field(default_factory=dict)
    coefficients: dict[str, float] = field(default_factory=dict)

    def add(self, device_id: str, weights: Weights, coefficient: float) -> None:
        """Adds c * W, all tensors or none (every range check comes before the first addition); the first weight set
        fixes the layout every later one must match."""
        if device_id in self.coefficients:
            raise ValueError(f"more than one update from device(s) {[device_id]}")
        if not math.isfinite(coefficient) or coefficient < 0.0:
            raise ValueError(f"coefficients must be finite and non-negative, got {coefficient!r} for {device_id}")
        if not self.spec:
            self.spec = spec_of(weights)
            self.sums = {name: ExactSum(array.shape) for name, array in weights.items()}
        try:
            check_layout(self.spec, weights)
        except LayoutError as error:
            raise ValueError(f"the update of {device_id} differs in tensor names, shapes or dtypes: {error}") from None
        terms = {name: np.multiply(array, coefficient, dtype=np.float64) for name, array in weights.items()}
        largest = {name: self.sums[name].check(term) for name, term in terms.items()}
        for name, term in terms.items():
            self.sums[name].add_checked(term, largest[name])
        self.coefficients[device_id] = float(coefficient)

    def total_coefficient(self) -> float:
        """sum_i c_i, exactly rounded (math.fsum), so it does not depend on the order either."""
        return math.fsum(self.coefficients.values())

    def mean(self) -> Weights:
        """sum_i c_i W_i / sum_i c_i, cast back to the input dtypes; the coefficients must have a positive sum."""
        if not self.coefficients:
            raise ValueError("cannot aggregate zero updates")
        total = self.total_coefficient()
        if total <= 0.0:
            raise ValueError(f"coefficients must have a positive sum, got {list(self.coefficients.values())!r}")
        return {name: (summed.total() / total).astype(self.spec[name][1]) for name, summed in self.sums.items()}

    def shares(self) -> dict[str, float]:
        """Each device's normalised coefficient c_i / sum_j c_j."""
        total = self.total_coefficient()
        return {device: coefficient / total for device, coefficient in self.coefficients.items()}


def check_magnitude(weights: Weights) -> None:
    """OutOfRange naming the tensor when a value exceeds MAX_ABS_WEIGHT (the aggregate's range guard)."""
    for name, array in weights.items():
        largest = float(np.max(np.abs(array), initial=0.0))
        if not largest <= MAX_ABS_WEIGHT:
            raise OutOfRange(f"tensor {name[:64]!r} has values up to {largest:.3g}, beyond {MAX_ABS_WEIGHT:.3g}")


def normalised(coefficients: Sequence[float] | np.ndarray) -> np.ndarray:
    """The coefficients scaled to sum 1; they must be finite, non-negative and have a positive sum."""
    values = np.asarray(coefficients, dtype=np.float64)
    if values.ndim != 1 or not np.all(np.isfinite(values)) or np.any(values < 0.0):
        raise ValueError(f"coefficients must be a flat list of finite non-negative numbers, got {coefficients!r}")
    total = math.fsum(values.tolist())
    if total <= 0.0:
        raise ValueError(f"coefficients must have a positive sum, got {coefficients!r}")
    return values / total


def capped_weights(weights: Sequence[float] | np.ndarray, caps: Sequence[float] | np.ndarray) -> np.ndarray:
    """min(w_i, caps_i * T), T the clipped weights' own total: no weight keeps more than its cap's share of the total,
    and the excess goes to the others in proportion to their weights (they are unchanged when none is above its cap).

    Why: one update's claimed sample count must not decide a FedAvg round alone. When the caps sum to 1 or less no
    clipping can meet them and the positive weights become proportional to their caps. Zero weights stay zero.
    """
    values, limits = np.asarray(weights, dtype=np.float64), np.asarray(caps, dtype=np.float64)
    if values.shape != limits.shape or values.ndim != 1 or np.any(~np.isfinite(values) | (values < 0.0)):
        raise ValueError(f"weights must be a flat list of finite non-negative numbers, one per cap, got {len(values)}")
    if np.any(~(limits > 0.0) | ~(limits <= 1.0)):
        raise ValueError("caps must lie in (0, 1]")
    positive = values > 0.0
    capped = np.zeros(values.shape, dtype=bool)
    while positive.any():
        share_left, rest = 1.0 - math.fsum(limits[capped].tolist()), math.fsum(values[~capped].tolist())
        if share_left <= 0.0 or rest <= 0.0:
            return np.where(positive, limits * float(np.min(values[positive] / limits[positive])), 0.0)
        level = rest / share_left
        above = ~capped & (values > limits * level)
        if not above.any():
            return np.where(capped, limits * level, values)
        capped |= above
    return values


def weighted_average(weight_sets: Sequence[Weights], coefficients: Sequence[float] | np.ndarray) -> Weights:
    """sum_i a_i W_i / sum_i a_i per tensor (Eq. 1-2) through the same RunningSum the streaming path uses."""
    if not weight_sets:
        raise ValueError("weighted_average needs at least one weight set")
    if len(coefficients) != len(weight_sets):
        raise ValueError(f"got {len(coefficients)} coefficients for {len(weight_sets)} weight sets")
    normalised(coefficients)
    running = RunningSum()
    for index, (weights, coefficient) in enumerate(zip(weight_sets, np.asarray(coefficients, dtype=np.float64))):
        running.add(f"weight set {index}", weights, float(coefficient))
    return running.mean()


def check_same_layout(weight_sets: Sequence[Weights]) -> None:
    """ValueError unless every weight set has the first one's layout (the message says which set differs)."""
    reference = spec_of(weight_sets[0])
    for index, weights in enumerate(weight_sets[1:], start=1):
        try:
            check_layout(reference, weights)
        except LayoutError as error:
            raise ValueError(f"weight set {index} differs: {error}") from None


def per_coordinate(weight_sets: Sequence[Weights], statistic: Callable[[np.ndarray], np.ndarray]) -> Weights:
    """statistic(stack) per tensor, the stack's axis 0 running over the weight sets, in float64, cast back."""
    if not weight_sets:
        raise ValueError("a per-coordinate statistic needs at least one weight set")
    check_same_layout(weight_sets)
    return {
        name: statistic(np.stack([weights[name].astype(np.float64) for weights in weight_sets])).astype(array.dtype)
        for name, array in weight_sets[0].items()
    }


def coordinate_median(weight_sets: Sequence[Weights]) -> Weights:
    """The median of the n values of every coordinate (the mean of the middle two for even n)."""
    return per_coordinate(weight_sets, lambda stack: np.median(stack, axis=0))


def check_trim(trim: float) -> None:
    """Raises ValueError unless trim is a number in [0, 0.5)."""
    if isinstance(trim, bool) or not isinstance(trim, numbers.Real) or not 0.0 <= trim < 0.5:
        raise ValueError(f"trim must be a number in [0, 0.5), got {trim!r}")


def trimmed_count(n: int, trim: float) -> int:
    """floor(trim * n), the values dropped from each end; trim < 0.5 always leaves at least one of n >= 1 values."""
    check_trim(trim)
    if n < 1:
        raise ValueError(f"need at least one value to trim, got {n}")
    return math.floor(trim * n)


def trimmed_mean(weight_sets: Sequence[Weights], trim: float) -> Weights:
    """Per coordinate: sort the n values, drop floor(trim * n) from each end and average the rest."""
    cut = trimmed_count(len(weight_sets), trim)
    return per_coordinate(weight_sets, lambda stack: np.sort(stack, axis=0)[cut : len(stack) - cut].mean(axis=0))


def entropy_coefficients(entropies: Sequence[float]) -> np.ndarray:
    """FMLU's w_c = exp(-H_c) / sum_c' exp(-H_c'), computed stably; every H_c must be finite."""
    values = np.asarray(entropies, dtype=np.float64)
    if values.ndim != 1 or values.size == 0 or not np.all(np.isfinite(values)):
        raise ValueError(f"entropies must be a non-empty list of finite numbers, got {entropies!r}")
    scaled = np.exp(-(values - values.min()))
    return scaled / scaled.sum()
