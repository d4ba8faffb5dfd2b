# What the coordinator checks of a secure round's unmasked sum, the one thing it sees (there are no range proofs):
# the summed weight against the survivors, each coordinate against the summed weight times the clip, the summed
# labels, and under device-placed DP the sum's L2 norm against the survivors' clipped deltas and noise shares.
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from protocol import messages
from protocol.dp import DP_DEVICE, NOISE_NORM_SLACK, ROUNDING_SLACK, DpRound, device_share, l2_norm
from protocol.secagg.fixed_point import FixedPoint
from protocol.secagg.weighting import LABELS, WEIGHT
from protocol.tensors import Weights


@dataclass(frozen=True)
class SumLimits:
    """What bounds an honest round's sum beyond the fixed point: whether every device weighs exactly 1 (a sample cap
    of 0), and under `--dp device` the L2 clip of each device's delta and the std of one device's noise share on
    each coordinate (a dp_clip of 0: no L2 bound)."""

    equal_weights: bool
    dp_clip: float = 0.0
    noise_share_std: float = 0.0


def sum_limits(recipe: messages.Recipe, selected: int) -> SumLimits:
    """What bounds an honest secure round's sum over `selected` devices: equal weights with a sample cap of 0, and
    under --dp device the L2 clip every device applies and its share of the noise (the clip is fixed: secure
    aggregation refuses an adaptive one at start-up)."""
    if recipe.dp != DP_DEVICE:
        return SumLimits(recipe.secagg_sample_cap == 0)
    round_dp = DpRound(recipe.dp_clip, recipe.dp_noise_multiplier, 0.0, selected)
    return SumLimits(recipe.secagg_sample_cap == 0, recipe.dp_clip, device_share(round_dp.sum_std, selected))


def sum_refusal(total: Weights, survivors: int, fixed: FixedPoint, limits: SumLimits) -> str | None:
    """Why an unmasked sum of `survivors` devices cannot be honest (each weight w_i in [0, 1], each delta coordinate
    clipped to the clip c before weighting, so |sum_i w_i d_ij| <= c sum_i w_i), or None. Every comparison allows
    the fixed point's rounding (`FixedPoint.error_bound`) on both sides; the reason names numbers, never data."""
    slack = fixed.error_bound(survivors)
    clip = fixed.clip
    weight = float(total[WEIGHT][0])
    if limits.equal_weights and abs(weight - survivors * clip) > slack:
        return (
            f"refused: the summed weight is {weight / clip:.6g}, not the {survivors} survivors' "
            "(with --secagg-sample-cap 0 every device weighs 1)"
        )
    if not slack < weight <= survivors * clip + slack:
        return f"refused: the summed weight {weight / clip:.6g} lies outside (0, {survivors}], the survivors' count"
    labels = float(total[LABELS][0])
    if not -slack <= labels <= survivors * clip + slack:
        return f"refused: the summed label coordinate {labels:.6g} lies outside [0, {survivors} x the clip {clip:g}]"
    deltas = {name: array for name, array in total.items() if name not in (WEIGHT, LABELS)}
    largest, name = max(
        ((float(np.max(np.abs(array), initial=0.0)), name) for name, array in deltas.items()), default=(0.0, "")
    )
    if largest > weight + 2 * slack:
        return (
            f"refused: a coordinate of {name[:64]} sums to {largest:.6g}, beyond the summed weight times the clip "
            f"({weight:.6g}): some device's delta was not clipped to {clip:g}"
        )
    if limits.dp_clip > 0.0:
        size = sum(int(np.size(array)) for array in deltas.values())
        spread = limits.noise_share_std * math.sqrt(survivors) * (math.sqrt(size) + NOISE_NORM_SLACK)
        allowed = ROUNDING_SLACK * (survivors * limits.dp_clip + spread) + slack * math.sqrt(size)
        norm = l2_norm(deltas)
        if norm > allowed:
            return (
                f"refused: the sum's L2 norm {norm:.6g} exceeds {survivors} deltas clipped to {limits.dp_clip:g} "
                f"and their noise ({allowed:.6g}): some device did not clip"
            )
    return None
