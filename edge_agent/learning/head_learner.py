# A device that trains only the classifier: onnxruntime features of the frozen backbone, softmax regression in numpy.
from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from edge_agent.data.device_data import Samples
from edge_agent.data.feature_cache import FEATURES_FOLDER
from edge_agent.learning.bundle import Bundle
from edge_agent.learning.cached_prefix import CachedPrefix, prefix_frozen
from edge_agent.learning.compute import ComputeSettings
from edge_agent.learning.dp_sgd import LEDGER_FILE, PrivateSteps
from edge_agent.learning.head_training import HeadSettings, SgdSteps, train_classifier
from edge_agent.learning.learner import Learner, bundle_scorer
from edge_agent.learning.local_data import LocalData
from edge_agent.learning.local_rules import (
    CLASSIFIER_ONLY,
    ClassStatistics,
    DpSgd,
    PseudoLabelled,
    RuleBodies,
    SupervisedRule,
    make_local_rule,
)
from edge_agent.learning.ort_scorer import penultimate_features
from edge_agent.learning.propagation import SemiSupervised
from protocol import messages
from protocol.head_statistics import HeadStatistics, calibration_sums, pool_posterior_sums
from protocol.model_spec import ModelSpec
from protocol.tensors import Weights
from protocol.trained_set import POOL_STATISTICS, trained_set

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Problem:
    """What a rule has the classifier train on: rows, their labels, a fixed logit bias (or None), and how the SGD
    steps are taken (plain, or DP-SGD's); or, with `held_out` (rows and labels the round's head did not see), that
    the rows are summed into head statistics and nothing trains (with `pool`, the unlabelled rows whose posteriors
    under the round's head the statistics carry too)."""

    rows: np.ndarray
    labels: np.ndarray
    logit_bias: np.ndarray | None = None
    steps: SgdSteps = field(default_factory=SgdSteps)
    held_out: tuple[np.ndarray, np.ndarray] | None = None
    semi: SemiSupervised | None = None
    pool: np.ndarray | None = None


HeadBody = Callable[[Any, LocalData, messages.Recipe, int, int], Problem]
HEAD_BODIES: RuleBodies[HeadBody] = RuleBodies(CLASSIFIER_ONLY)


def device_prefix(settings: ComputeSettings, state_dir: Path, weights: Weights, bundle: Bundle) -> CachedPrefix | None:
    """The device's feature cache over the bundle's prefix (under `state_dir`, at the device's scoring batch,
    threads and providers) when the spec freezes that prefix; None when the prefix trains."""
    if not prefix_frozen(bundle):
        return None
    return CachedPrefix(
        bundle,
        state_dir / FEATURES_FOLDER,
        weights,
        *(settings.inference_batch, settings.inference_threads, settings.execution_providers),
    )


class HeadLearner(Learner):
    """The round's global model with only its classifier trained: what a 512 MB device affords (no torch).

    It scores with the round's bundle as shipped (the global model), so a round with several acquisitions
    scores each with the global model; the trained classifier goes into the update. When the spec freezes the
    bundle's prefix, each sample's prefix output is computed once and kept in the device's feature cache
    (`state_dir/features`): scoring runs the tail alone over cached rows, and training the penultimate graph.
    """

    def __init__(
        self, settings: ComputeSettings, state_dir: Path, global_weights: Weights, bundle: Bundle | None
    ) -> None:
        if bundle is None or bundle.manifest.head is None:
            raise ValueError("head-only training needs the round's bundle with its penultimate graph")
        self.settings = settings
        self.bundle = bundle
        self._weights = dict(global_weights)
        self.prefix = device_prefix(settings, state_dir, global_weights, bundle)
        self.statistics: Weights | None = None

    def weights(self) -> Weights:
        """The global weights with this round's classifier."""
        return dict(self._weights)

    def update(self, spec: ModelSpec) -> Weights:
        """The class-statistics rule's statistics when it ran this round, else the spec's trained set of weights()."""
        return self.statistics if self.statistics is not None else trained_set(spec, self.weights())

    def probabilities(self, bundle: Bundle | None, samples: Samples, passes: int, seed: int) -> np.ndarray:
        """MC-dropout outputs under the bundle's graphs as shipped: the tail alone over cached prefix outputs when
        the prefix is frozen, else both graphs over the samples' images."""
        scorer = bundle_scorer(self.settings, bundle, None)
        if self.prefix is None:
            return scorer.probabilities(samples.images(), passes, seed)
        return scorer.feature_probabilities(self.prefix.rows(samples), passes, seed)

    def rows(self, samples: Samples) -> np.ndarray:
        """The samples' cached prefix outputs (frozen prefix), else their images."""
        return samples.images() if self.prefix is None else self.prefix.rows(samples)

    def train(self, data: LocalData, recipe: messages.Recipe, seed: int) -> dict[str, float]:
        """Softmax regression of the classifier on the recipe's rule's problem (its rows, labels, logit bias, and
        pseudo-labels where the rule propagates them); train_samples counts the labelled rows alone."""
        head = self.bundle.manifest.head
        assert head is not None  # checked in the constructor
        weight = self._weights[head.weight]
        rule = make_local_rule(recipe.local_rule)
        problem = HEAD_BODIES.body(rule)(rule, data, recipe, seed, len(weight))
        if problem.held_out is not None:
            return self.summarise(problem, problem.held_out, weight, self._weights[head.bias])
        features = self.penultimate(problem.rows)
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
        start = weight, self._weights[head.bias]
        if problem.semi is not None:
            pool = self.penultimate(problem.semi.pool)
            weight, bias, loss, pseudo = problem.semi.trained(
                features, problem.labels, pool, start, options, problem.logit_bias
            )
            log.info("pseudo-labels trained on=%d pool=%d labels=%d", pseudo, len(pool), len(problem.labels))
        else:
            weight, bias, loss = train_classifier(
                features, problem.labels, *start, options, problem.logit_bias, problem.steps
            )
        self._weights[head.weight], self._weights[head.bias] = weight, bias
        spent = problem.steps.spent(len(problem.rows), options)
        return {"train_loss": loss, "train_samples": float(len(problem.rows)), **spent}

    def summarise(
        self, problem: Problem, held_out: tuple[np.ndarray, np.ndarray], weight: np.ndarray, bias: np.ndarray
    ) -> dict[str, float]:
        """The problem's rows summed into head statistics, with the calibration sums of the held-out rows under the
        round's head (the update then carries them: `update`)."""
        if len(problem.labels) == 0:
            raise ValueError("class-statistics needs at least one human label, and this device holds none")
        rows, labels = held_out
        logits = self.penultimate(rows).astype(np.float64) @ weight.T + bias if len(labels) else None
        calibration = None if logits is None else calibration_sums(logits, labels)
        pool = None
        if problem.pool is not None:
            pool_rows = self.penultimate(problem.pool)
            pool = pool_posterior_sums(pool_rows, pool_rows @ weight.T.astype(pool_rows.dtype) + bias)
        features = self.penultimate(problem.rows)
        statistics = HeadStatistics.of_labels(features, problem.labels, len(weight), calibration, pool)
        self.statistics = statistics.tensors()
        return {"train_samples": float(len(problem.labels))}

    def features(self, samples: Samples) -> np.ndarray:
        """Penultimate features of the samples under the bundle's graphs as shipped (what scores the pool)."""
        return self.penultimate(self.rows(samples))

    def penultimate(self, rows: np.ndarray) -> np.ndarray:
        """The classifier's input features of this learner's rows (cached prefix outputs or raw images)."""
        settings = self.settings
        return penultimate_features(
            self.bundle,
            rows,
            *(settings.inference_batch, settings.inference_threads, settings.execution_providers),
            cached=self.prefix is not None,
        )

    def logits(self, which: str, images: np.ndarray) -> np.ndarray:
        """Not available: whole-model logits need torch (round_problem refuses such rounds first)."""
        raise ValueError(f"{which} model logits need the whole model in torch; this profile trains the classifier only")


@HEAD_BODIES.attach(SupervisedRule)
def supervised_problem(
    rule: SupervisedRule, data: LocalData, recipe: messages.Recipe, seed: int, num_classes: int
) -> Problem:
    """What the classifier trains on under a supervised rule: its training set and its logit bias (or None)."""
    images, labels = rule.training_set(data, recipe, seed)
    return Problem(images, labels, rule.logit_bias(labels, num_classes, recipe))


@HEAD_BODIES.attach(PseudoLabelled)
def propagated_problem(
    rule: PseudoLabelled, data: LocalData, recipe: messages.Recipe, seed: int, num_classes: int
) -> Problem:
    """pseudo-labels: kept-labels' training set and logit bias (the teacher's), and the pool's rows to pseudo-label
    for this training alone (SemiSupervised.trained), with the fleet's label shares the device last heard."""
    images, labels = rule.training_set(data, recipe, seed)
    semi = rule.semi_supervised(data.unlabelled(), recipe, data.fleet_label_shares)
    return Problem(images, labels, rule.logit_bias(labels, num_classes, recipe), semi=semi)


@HEAD_BODIES.attach(ClassStatistics)
def statistics_problem(
    rule: ClassStatistics, data: LocalData, recipe: messages.Recipe, seed: int, num_classes: int
) -> Problem:
    """class-statistics: every human label (never a weak one) to be summed, no training; this acquisition's new
    labels held out to calibrate the head they were chosen with; with `pool_statistics`, the unlabelled rows whose
    posteriors are summed too."""
    pool = data.unlabelled() if rule.option_value(recipe.options, POOL_STATISTICS) else None
    return Problem(data.labelled_images, data.labelled_labels, held_out=(data.new_images, data.new_labels), pool=pool)


@HEAD_BODIES.attach(DpSgd)
def private_problem(rule: DpSgd, data: LocalData, recipe: messages.Recipe, seed: int, num_classes: int) -> Problem:
    """DP-SGD's problem: every label the device holds (human and weak), no logit bias (class counts are not
    private), DP-SGD's steps with noise from fresh entropy and the ledger in the device's state directory."""
    if data.state_dir is None:
        raise ValueError("dp-sgd keeps its privacy ledger in the device's state directory, and this data has none")
    images, labels = data.training_set()
    steps = PrivateSteps(
        rule.option_value(recipe.options, "dp_sgd_clip"),
        rule.option_value(recipe.options, "dp_sgd_noise_multiplier"),
        max(1, min(recipe.batch_size, len(labels))),
        rule.option_value(recipe.options, "dp_sgd_delta"),
        data.state_dir / LEDGER_FILE,
        np.random.default_rng(),
    )
    return Problem(images, labels, None, steps)
