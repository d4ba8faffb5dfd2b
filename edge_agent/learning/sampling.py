# The samplers a recipe names, by name: the registry (SAMPLERS) of the probability heuristics and the batch and
# feature samplers, and the makers a device and `edge-agent score` call.
from __future__ import annotations

from edge_agent.learning.batch_samplers import (
    BadgeSampler,
    BalancedEntropy,
    BalancedMargin,
    CoresetSampler,
    FastSampler,
    KsasSampler,
    LevelMargin,
    PowerBald,
    PowerEntropy,
    PowerMargin,
    TypicalitySampler,
    TypicalThenBalancedMargin,
    TypicalThenLevelMargin,
    TypicalThenMargin,
)
from edge_agent.learning.heuristics import (
    BaldHeuristic,
    EntropyHeuristic,
    Heuristic,
    LeastConfidenceHeuristic,
    MarginHeuristic,
    RandomHeuristic,
    Sampler,
)
from protocol.options import Registry

SAMPLERS: Registry[type[Sampler]] = Registry("sampler")

for registered in (
    RandomHeuristic,
    EntropyHeuristic,
    BaldHeuristic,
    MarginHeuristic,
    LeastConfidenceHeuristic,
    KsasSampler,
    FastSampler,
    PowerEntropy,
    PowerBald,
    PowerMargin,
    BadgeSampler,
    CoresetSampler,
    BalancedEntropy,
    BalancedMargin,
    LevelMargin,
    TypicalitySampler,
    TypicalThenMargin,
    TypicalThenBalancedMargin,
    TypicalThenLevelMargin,
):
    SAMPLERS.register(registered)


def make_heuristic(name: str) -> Heuristic:
    """A fresh probability heuristic by its registry name (what `edge-agent score` can run from a bundle alone)."""
    heuristics = heuristic_names()
    if name not in heuristics:
        raise ValueError(f"unknown sampler {name!r}; known: {', '.join(sorted(heuristics))}")
    heuristic = SAMPLERS.get(name)()
    assert isinstance(heuristic, Heuristic)
    return heuristic


def heuristic_names() -> list[str]:
    """The registered samplers that need nothing but MC-dropout probabilities (what a bundle alone can run)."""
    return SAMPLERS.select(lambda method: issubclass(method, Heuristic))


def make_sampler(name: str) -> Sampler:
    """A fresh sampler of any kind by its registry name (what a device runs in a round)."""
    return SAMPLERS.get(name)()
