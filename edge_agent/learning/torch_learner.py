# A device that trains the whole model in torch with the recipe's local rule (imported only by such devices).
from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import torch
from torch import nn

from edge_agent.data.device_data import Samples
from edge_agent.data.image_arrays import model_input
from edge_agent.learning.bundle import Bundle
from edge_agent.learning.compute import ComputeSettings
from edge_agent.learning.learner import Learner, bundle_scorer
from edge_agent.learning.local_data import LocalData
from edge_agent.learning.local_rules import make_local_rule
from edge_agent.learning.mc_dropout import TorchMCDropout, predict_features, predict_logits
from edge_agent.learning.mc_scorer import MCScorer
from edge_agent.learning.models import build_model, get_weights, set_weights
from edge_agent.learning.torch_rules import train_rule
from protocol import messages
from protocol.files import load_arrays, save_arrays
from protocol.model_spec import ModelSpec
from protocol.tensors import Weights
from protocol.trained_set import trained_set

OWN_MODEL_FILE = "own_model.npz"


def own_model(state_dir: Path, spec: ModelSpec, current: nn.Module) -> nn.Module:
    """The device's own last trained model omega_i (kept across rounds), or `current` before it has one."""
    path = state_dir / OWN_MODEL_FILE
    if not path.is_file():
        return current
    model = build_model(spec)
    set_weights(model, load_arrays(path))
    return model


class TorchLearner(Learner):
    """The round's model in torch (current, trained by the local rule) beside a frozen copy of the global one."""

    def __init__(self, settings: ComputeSettings, state_dir: Path, spec: ModelSpec, global_weights: Weights) -> None:
        torch.set_num_threads(settings.torch_threads)
        self.settings = settings
        self.state_dir = state_dir
        self.spec = spec
        self.current = build_model(spec)
        set_weights(self.current, global_weights)
        self.global_model = copy.deepcopy(self.current).eval()

    def weights(self) -> Weights:
        """The current model's weights."""
        return get_weights(self.current)

    def update(self, spec: ModelSpec) -> Weights:
        """The spec's trained set of the current model."""
        return trained_set(spec, self.weights())

    def probabilities(self, bundle: Bundle | None, samples: Samples, passes: int, seed: int) -> np.ndarray:
        """MC-dropout outputs of the samples' images under the current model: the bundle's graphs with the current
        weights (onnxruntime profiles), else torch."""
        scorer: MCScorer = (
            bundle_scorer(self.settings, bundle, self.weights())
            if self.settings.scores_with_onnxruntime
            else TorchMCDropout(self.current, self.settings.inference_batch)
        )
        return scorer.probabilities(samples.images(), passes, seed)

    def rows(self, samples: Samples) -> np.ndarray:
        """The samples' raw images: the whole model trains on pixels."""
        return samples.images()

    def train(self, data: LocalData, recipe: messages.Recipe, seed: int) -> dict[str, float]:
        """The recipe's local rule on the current model; the result is kept as the device's own model."""
        metrics = train_rule(make_local_rule(recipe.local_rule), self.current, data, self.global_model, recipe, seed)
        save_arrays(self.state_dir / OWN_MODEL_FILE, self.weights())
        return metrics

    def logits(self, which: str, images: np.ndarray) -> np.ndarray:
        """Deterministic logits of raw images under the device's own last model or the round's global one."""
        model = own_model(self.state_dir, self.spec, self.current) if which == "own" else self.global_model
        return predict_logits(model, model_input(images), self.settings.inference_batch)

    def features(self, samples: Samples) -> np.ndarray:
        """Penultimate features of the samples' images under the current model (the one that scores the pool)."""
        return predict_features(self.current, model_input(samples.images()), self.settings.inference_batch)
