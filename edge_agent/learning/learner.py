# What a round trains: the Learner interface (the whole model in torch, or the classifier alone in numpy) and its choice.
from __future__ import annotations

from pathlib import Path
from typing import Protocol

import numpy as np

from edge_agent.learning.bundle import Bundle
from edge_agent.learning.local_data import LocalData
from edge_agent.learning.mc_scorer import MCScorer
from edge_agent.learning.sampling import make_sampler
from edge_agent.loop.agent_settings import AgentSettings
from protocol import messages
from protocol.model_spec import ModelSpec
from protocol.tensors import Weights

HEAD_RULES = ("kept-labels", "online-replay")


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


def round_problem(settings: AgentSettings, recipe: messages.Recipe, bundle: Bundle | None) -> str | None:
    """Why this device cannot do a round's work, or None: a head-only device refuses a rule or sampler that needs
    the whole model (KSAS's logits, a rule other than the online one) and a bundle without a penultimate graph."""
    if settings.trainer != "head":
        return None
    if bundle is None or bundle.manifest.head is None:
        return "the round's bundle has no penultimate graph (exported before head-only training)"
    if recipe.local_rule not in HEAD_RULES:
        return f"local rule {recipe.local_rule!r} trains the whole model; this profile trains the classifier only"
    if make_sampler(recipe.sampler).needs_model_logits:
        return f"sampler {recipe.sampler!r} compares whole-model logits; this profile trains the classifier only"
    return None


def make_learner(
    settings: AgentSettings, state_dir: Path, spec: ModelSpec, global_weights: Weights, bundle: Bundle | None
) -> Learner:
    """The learner the profile asks for, over a model built from `spec`; torch is imported only for the full
    trainer (a head-only learner reads the same spec from its bundle's manifest)."""
    if settings.trainer == "head":
        from edge_agent.learning.head_learner import HeadLearner

        return HeadLearner(settings, global_weights, bundle)
    from edge_agent.learning.torch_learner import TorchLearner

    return TorchLearner(settings, state_dir, spec, global_weights)
