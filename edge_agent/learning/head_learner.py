# A device that trains only the classifier: onnxruntime features of the frozen backbone, softmax regression in numpy.
from __future__ import annotations

import numpy as np

from edge_agent.learning.bundle import Bundle
from edge_agent.learning.head_training import HeadSettings, train_classifier
from edge_agent.learning.learner import bundle_scorer
from edge_agent.learning.local_data import LOGIT_ADJUSTMENT_OPTION, RESERVOIR_OPTION, LocalData, label_logit_bias
from edge_agent.learning.mc_scorer import MCScorer
from edge_agent.learning.ort_scorer import penultimate_features
from edge_agent.loop.agent_settings import AgentSettings
from protocol import messages
from protocol.tensors import Weights


class HeadLearner:
    """The round's global model with only its classifier trained: what a 512 MB device affords (no torch).

    It scores with the round's bundle as shipped (the global model), so a round with several acquisitions
    scores each with the global model; the trained classifier goes into the update.
    """

    def __init__(self, settings: AgentSettings, global_weights: Weights, bundle: Bundle | None) -> None:
        if bundle is None or bundle.manifest.head is None:
            raise ValueError("head-only training needs the round's bundle with its penultimate graph")
        self.settings = settings
        self.bundle = bundle
        self._weights = dict(global_weights)

    def weights(self) -> Weights:
        """The global weights with this round's classifier."""
        return dict(self._weights)

    def scorer(self, bundle: Bundle | None) -> MCScorer:
        """The bundle's graphs as shipped."""
        return bundle_scorer(self.settings, bundle, None)

    def train(self, data: LocalData, recipe: messages.Recipe, seed: int) -> dict[str, float]:
        """Softmax regression of the classifier on what the recipe's rule trains on."""
        head = self.bundle.manifest.head
        assert head is not None  # checked in the constructor
        images, labels = training_data(data, recipe, seed)
        features = self.features(images)
        options = HeadSettings(
            recipe.epochs,
            recipe.batch_size,
            recipe.learning_rate,
            recipe.momentum,
            recipe.weight_decay,
            head.dropout,
            seed,
            recipe.lr_schedule,
        )
        weight = self._weights[head.weight]
        adjustment = logit_bias(recipe, labels, len(weight))
        weight, bias, loss = train_classifier(features, labels, weight, self._weights[head.bias], options, adjustment)
        self._weights[head.weight], self._weights[head.bias] = weight, bias
        return {"train_loss": loss, "train_samples": float(len(images))}

    def features(self, images: np.ndarray) -> np.ndarray:
        """Penultimate features of raw images under the bundle's graphs as shipped (what scores the pool)."""
        settings = self.settings
        return penultimate_features(
            self.bundle, images, settings.inference_batch, settings.inference_threads, settings.execution_providers
        )

    def logits(self, which: str, images: np.ndarray) -> np.ndarray:
        """Not available: whole-model logits need torch (round_problem refuses such rounds first)."""
        raise ValueError(f"{which} model logits need the whole model in torch; this profile trains the classifier only")


def logit_bias(recipe: messages.Recipe, labels: np.ndarray, num_classes: int) -> np.ndarray | None:
    """kept-labels' logit adjustment tau ln n_c over the trained labels' counts, or None (plain CE)."""
    tau = LOGIT_ADJUSTMENT_OPTION.read(recipe.options) if recipe.local_rule == "kept-labels" else 0.0
    return label_logit_bias(labels, num_classes, tau)


def training_data(data: LocalData, recipe: messages.Recipe, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """What the recipe's rule trains on: the kept set, or the online rule's new batch and replay set."""
    if recipe.local_rule == "kept-labels":
        return data.kept_set(int(RESERVOIR_OPTION.read(recipe.options)), seed)
    return data.new_and_replay()
