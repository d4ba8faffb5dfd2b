# What one round's work reads: the learner (the model being trained), the base hash, recipe and artefacts.
from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np

from edge_agent.data.device_data import Samples
from edge_agent.learning.bundle import Bundle
from edge_agent.learning.learner import Learner
from edge_agent.loop.agent_settings import AgentSettings
from protocol import messages

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RoundModels:
    """The models of a round: the learner (the model being trained, beside the global one received), the base hash,
    the recipe, and the artefacts that came with it (the bundle for onnxruntime scoring, FAST's encoder)."""

    learner: Learner
    base_hash: str
    recipe: messages.Recipe
    bundle: Bundle | None = None
    encoder: bytes | None = None


def mc_probabilities(
    settings: AgentSettings, models: RoundModels, samples: Samples, passes: int, seed: int
) -> np.ndarray:
    """MC-dropout probabilities of pool samples with the given passes, capped by the profile."""
    passes = min(passes, settings.mc_passes_cap or passes)
    log.info("scoring backend=%s passes=%d images=%d", settings.backend, passes, len(samples))
    return models.learner.probabilities(models.bundle, samples, passes, seed)
