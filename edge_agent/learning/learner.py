# What a round trains: the Learner interface both back ends implement (the whole model in torch, the classifier alone).
from __future__ import annotations

from typing import Protocol

import numpy as np

from edge_agent.learning.bundle import Bundle
from edge_agent.learning.local_data import LocalData
from edge_agent.learning.mc_scorer import MCScorer
from edge_agent.loop.agent_settings import AgentSettings
from protocol import messages
from protocol.tensors import Weights


class Learner(Protocol):
    """The model a device works with in one round, whatever runs it: scores the pool, trains, gives its weights."""

    def weights(self) -> Weights:
        """The model's weights now (after any training this round)."""

    def scorer(self, bundle: Bundle | None) -> MCScorer:
        """The profile's MC-dropout back end over this model."""

    def train(self, data: LocalData, recipe: messages.Recipe, seed: int) -> dict[str, float]:
        """Trains with the recipe's local rule; the metrics the update carries."""

    def logits(self, which: str, images: np.ndarray) -> np.ndarray:
        """Deterministic logits (N, C) of raw images under the device's own last model ('own') or the round's
        global one ('global'): what KSAS compares."""

    def features(self, images: np.ndarray) -> np.ndarray:
        """Deterministic penultimate features (N, D) of raw images under the model that scores them (BADGE)."""


def bundle_scorer(settings: AgentSettings, bundle: Bundle | None, weights: Weights | None) -> MCScorer:
    """The onnxruntime scorer over the round's bundle, with `weights` in place of the bundle's own (None: as shipped)."""
    from edge_agent.learning.ort_scorer import OrtMCDropout

    if bundle is None:
        raise ValueError("the onnxruntime back end needs the round's bundle, which has not arrived")
    return OrtMCDropout(
        bundle,
        settings.inference_batch,
        threads=settings.inference_threads,
        providers=settings.execution_providers,
        weights=weights,
    )
