# The robust aggregates: coordinate-wise median and trimmed mean, for rounds where some devices send outliers.
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from coordinator.strategies.aggregate import ClientUpdate, coordinate_median, trimmed_count, trimmed_mean
from coordinator.strategies.contract import Evaluate, Strategy, check_updates
from protocol.options import Option
from protocol.tensors import Weights


class Median(Strategy):
    """Coordinate-wise median of the client models: robust while fewer than half the devices are outliers."""

    name = "median"
    summary = "coordinate-wise median of the client models"

    def aggregate(
        self, global_weights: Weights, updates: Sequence[ClientUpdate], evaluate: Evaluate | None
    ) -> tuple[Weights, dict[str, Any]]:
        """The coordinate-wise median of the updates."""
        check_updates(updates)
        return coordinate_median([update.weights for update in updates]), {"method": self.name}


class TrimmedMean(Strategy):
    """Coordinate-wise trimmed mean: drop the floor(trim * n) lowest and highest values, average the rest."""

    name = "trimmed-mean"
    summary = "coordinate-wise mean after dropping the extreme values at each end"
    options = (Option("trim", float, 0.2, "fraction trimmed from each end per coordinate", 0.0, 0.5, high_open=True),)

    def __init__(self, trim: float = 0.2) -> None:
        self.trim = self.option("trim").check(trim)

    def aggregate(
        self, global_weights: Weights, updates: Sequence[ClientUpdate], evaluate: Evaluate | None
    ) -> tuple[Weights, dict[str, Any]]:
        """The trimmed mean of the updates; the report gives trim and the count dropped from each end."""
        check_updates(updates)
        trimmed = trimmed_mean([update.weights for update in updates], self.trim)
        dropped = trimmed_count(len(updates), self.trim)
        return trimmed, {"method": self.name, "trim": float(self.trim), "dropped_per_end": dropped}
