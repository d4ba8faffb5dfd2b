# The strategies by name: the registry the command line, the docs and the coordinator read, and its factory.
from __future__ import annotations

from typing import Any

from coordinator.strategies.contract import Strategy
from coordinator.strategies.means import CADIS, FMLU, AveFL, FedAvg, MixFL, OptFL
from coordinator.strategies.optimizers import FedAdagrad, FedAdam, FedAvgM, FedYogi
from coordinator.strategies.pooled_head import PooledHead
from coordinator.strategies.robust import Median, TrimmedMean
from protocol.options import Registry

STRATEGIES: Registry[type[Strategy]] = Registry("strategy")

for registered in (
    AveFL,
    OptFL,
    MixFL,
    FedAvg,
    Median,
    TrimmedMean,
    CADIS,
    FMLU,
    FedAvgM,
    FedAdam,
    FedYogi,
    FedAdagrad,
    PooledHead,
):
    STRATEGIES.register(registered)


def make_strategy(name: str, **options: Any) -> Strategy:
    """A fresh strategy by its registry name, built with its declared options (e.g. trim=0.2), each checked."""
    strategy = STRATEGIES.get(name)
    declared = {option.key for option in strategy.options}
    unknown = sorted(set(options) - declared)
    if unknown:
        takes = ", ".join(sorted(declared)) or "no options"
        raise ValueError(f"strategy {name!r} does not take option(s) {unknown[:5]}; it takes: {takes}")
    return strategy(**{key: strategy.option(key).check(value) for key, value in options.items()})
