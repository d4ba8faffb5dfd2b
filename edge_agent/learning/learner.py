# What a round trains: the Learner interface both back ends implement (the whole model in torch, the classifier alone).
from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import numpy as np

from edge_agent.data.device_data import Samples
from edge_agent.learning.bundle import Bundle
from edge_agent.learning.compute import ComputeSettings
from edge_agent.learning.local_data import LocalData
from protocol import messages
from protocol.model_spec import ModelSpec
from protocol.tensors import Weights

if TYPE_CHECKING:
    from edge_agent.learning.ort_scorer import OrtMCDropout


class Learner(Protocol):
    """The model a device works with in one round, whatever runs it: scores the pool, trains, gives its weights."""

    def weights(self) -> Weights:
        """The model's weights now (after any training this round)."""

    def update(self, spec: ModelSpec) -> Weights:
        """What this round's update carries: the spec's trained set of weights(), or a rule's statistics."""

    def probabilities(self, bundle: Bundle | None, samples: Samples, passes: int, seed: int) -> np.ndarray:
        """MC-dropout softmax outputs (passes, N, C) of the samples on the profile's back end over this model."""

    def rows(self, samples: Samples) -> np.ndarray:
        """What this learner trains on for these samples: their raw images, or a head learner's cached prefix
        outputs (local rules only select and join rows, so they work on either)."""

    def train(self, data: LocalData, recipe: messages.Recipe, seed: int) -> dict[str, float]:
        """Trains with the recipe's local rule; the metrics the update carries."""

    def logits(self, which: str, images: np.ndarray) -> np.ndarray:
        """Deterministic logits (N, C) of raw images under the device's own last model ('own') or the round's
        global one ('global'): what KSAS compares."""

    def features(self, samples: Samples) -> np.ndarray:
        """Deterministic penultimate features (N, D) of the samples under the model that scores them (BADGE)."""


def bundle_scorer(settings: ComputeSettings, bundle: Bundle | None, weights: Weights | None) -> OrtMCDropout:
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
