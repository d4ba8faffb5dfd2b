# Which learner a device's profile gets, and which rounds it must refuse: torch is imported only for the full trainer.
from __future__ import annotations

from pathlib import Path

from edge_agent.learning.bundle import Bundle
from edge_agent.learning.compute import ComputeSettings
from edge_agent.learning.head_learner import HeadLearner
from edge_agent.learning.learner import Learner
from edge_agent.learning.local_rules import CLASSIFIER_ONLY, LOCAL_RULES, runs_on
from edge_agent.learning.sampling import make_sampler
from protocol import messages
from protocol.model_spec import ModelSpec
from protocol.tensors import Weights


def round_problem(settings: ComputeSettings, recipe: messages.Recipe, bundle: Bundle | None) -> str | None:
    """Why this device cannot do a round's work, or None: a full-model device refuses a rule that declares the
    classifier alone (DP-SGD); a head-only device refuses a rule that does not declare it can train the classifier
    alone, a sampler that needs whole-model logits (KSAS) and a bundle without a penultimate graph."""
    if settings.trainer != CLASSIFIER_ONLY:
        if recipe.local_rule in LOCAL_RULES and not runs_on(recipe.local_rule, settings.trainer):
            return f"local rule {recipe.local_rule!r} trains the classifier alone; this profile trains the whole model"
        return None
    if bundle is None or bundle.manifest.head is None:
        return "the round's bundle has no penultimate graph (exported before head-only training)"
    if not runs_on(recipe.local_rule, CLASSIFIER_ONLY):
        return f"local rule {recipe.local_rule!r} trains the whole model; this profile trains the classifier only"
    if make_sampler(recipe.sampler).needs_model_logits:
        return f"sampler {recipe.sampler!r} compares whole-model logits; this profile trains the classifier only"
    return None


def make_learner(
    settings: ComputeSettings, state_dir: Path, spec: ModelSpec, global_weights: Weights, bundle: Bundle | None
) -> Learner:
    """The learner the profile asks for, over a model built from `spec`; torch is imported only for the full
    trainer (a head-only learner reads the same spec from its bundle's manifest)."""
    if settings.trainer == CLASSIFIER_ONLY:
        return HeadLearner(settings, state_dir, global_weights, bundle)
    from edge_agent.learning.torch_learner import TorchLearner

    return TorchLearner(settings, state_dir, spec, global_weights)
