# The active-learning schedule of a recipe: which rounds acquire, how many labels, where an active round starts.
from __future__ import annotations

import math

from protocol.messages import Recipe


def round_in_active_round(round_id: int, recipe: Recipe) -> int:
    """1-based communication round inside its active round (an active round is rounds_per_acquisition rounds)."""
    return (round_id - 1) % recipe.rounds_per_acquisition + 1


def acquires_in_round(round_id: int, recipe: Recipe) -> bool:
    """True on the first round of every active round, except the very first when the device starts from
    random initial labels (KAFAL's active round 0 trains on those alone)."""
    if round_in_active_round(round_id, recipe) != 1:
        return False
    return not (recipe.initial_label_fraction > 0 and round_id <= recipe.rounds_per_acquisition)


def labels_per_acquisition(recipe: Recipe, own_samples: int) -> int:
    """ceil(label_fraction * own samples) when a fraction is set (KAFAL's b_i), else the recipe's fixed count."""
    if recipe.label_fraction > 0:
        return math.ceil(recipe.label_fraction * own_samples)
    return recipe.labels_per_acquisition


def initial_label_count(recipe: Recipe, own_samples: int) -> int:
    """ceil(initial_label_fraction * own samples): the random labels a device takes before its first round."""
    return math.ceil(recipe.initial_label_fraction * own_samples)


def labels_by_round(recipe: Recipe, round_id: int) -> int | None:
    """The most human labels the schedule lets a device acquire in rounds 1..round_id (an acquisition asks at most
    labels_per_acquisition); None when label fractions make the budget depend on the device's own data."""
    if recipe.initial_label_fraction > 0 or recipe.label_fraction > 0:
        return None
    acquiring_rounds = (max(round_id, 1) - 1) // recipe.rounds_per_acquisition + 1
    return acquiring_rounds * recipe.acquisitions_per_round * recipe.labels_per_acquisition
