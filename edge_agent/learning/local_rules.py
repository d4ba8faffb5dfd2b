# The local rules declared once, without torch: name, summary, options, metrics, which trainers run them; bodies attach.
from __future__ import annotations

from abc import abstractmethod
from collections.abc import Callable, Sequence
from typing import ClassVar, Generic, TypeVar

import numpy as np

from edge_agent.learning.acquisition_scores import class_prior_bias
from edge_agent.learning.local_data import LocalData
from edge_agent.learning.propagation import FLEET_SHARES, NO_ALIGNMENT, Propagation, SemiSupervised
from protocol.dp import DP_SGD_EPSILON_METRIC
from protocol.messages import METRIC_MEME_ENTROPY, Recipe
from protocol.options import Method, Option, Registry
from protocol.trained_set import POOL_STATISTICS, STATISTICS_RULE

FULL_MODEL = "full"
CLASSIFIER_ONLY = "head"


class LocalRule(Method):
    """A device's local update as every side sees it: what the coordinator lists and checks, and which trainers
    (FULL_MODEL: the whole model in torch; CLASSIFIER_ONLY: the classifier alone in numpy) can run it."""

    reported_metrics: ClassVar[tuple[str, ...]] = ()
    trainers: ClassVar[frozenset[str]] = frozenset({FULL_MODEL})


class SupervisedRule(LocalRule):
    """Cross-entropy (logit-adjusted when the rule says so) on a set of labels the rule picks: nothing else, so the
    whole model and the classifier alone train it alike."""

    trainers = frozenset({FULL_MODEL, CLASSIFIER_ONLY})

    @abstractmethod
    def training_set(self, data: LocalData, recipe: Recipe, seed: int) -> tuple[np.ndarray, np.ndarray]:
        """(images, labels) this round trains on."""

    def logit_bias(self, labels: np.ndarray, num_classes: int, recipe: Recipe) -> np.ndarray | None:
        """A fixed per-class bias added to the logits in the loss, or None for plain cross-entropy."""
        return None


LOCAL_RULES: Registry[type[LocalRule]] = Registry("local rule")


@LOCAL_RULES.register
class KeptLabels(SupervisedRule):
    """Every label the device paid for, each round: human and weak labels, or a class-balanced reservoir of them.

    With a logit adjustment tau > 0 the loss is CE(logits + tau ln n_c, y): under label skew the device's own
    frequent classes stop pulling the shared classifier towards them (Menon et al. 2021; KAFAL's tau = 1).
    """

    name = "kept-labels"
    summary = "every label the device holds (or a class-balanced reservoir of them), E epochs from the global model"
    options: ClassVar[tuple[Option, ...]] = (
        Option("reservoir", int, 0, "most labels trained on per round, class-balanced (0: all)", low=0.0),
        Option(
            "logit_adjustment",
            float,
            0.0,
            "tau of the logit-adjusted loss CE(logits + tau ln n_c, y) over the device's class counts n_c (0: plain CE)",
            low=0.0,
        ),
    )

    def training_set(self, data: LocalData, recipe: Recipe, seed: int) -> tuple[np.ndarray, np.ndarray]:
        """The kept set: every human and weak label, or a class-balanced reservoir of them."""
        return data.kept_set(int(self.option_value(recipe.options, "reservoir")), seed)

    def logit_bias(self, labels: np.ndarray, num_classes: int, recipe: Recipe) -> np.ndarray | None:
        """tau ln n_c over the class counts of the labels trained on (-inf where n_c = 0), or None for tau = 0."""
        tau = self.option_value(recipe.options, "logit_adjustment")
        if tau == 0.0:
            return None
        return class_prior_bias(np.bincount(np.asarray(labels, dtype=np.int64), minlength=num_classes), tau)


@LOCAL_RULES.register
class PseudoLabelled(KeptLabels):
    """kept-labels, plus pseudo-labels on the device's unlabelled pool: the round's head's prediction where the
    propagation of the device's human labels over the kNN graph of its cached feature rows agrees with it (Iscen et
    al. 2019; edge_agent.learning.propagation). The pseudo-labels live only in the round's training: never in the
    labelled store, the label counts or the update, and never of a class the device holds no human label of."""

    name = "pseudo-labels"
    summary = (
        "kept-labels plus the head's predictions on the device's pool where label propagation over its cached "
        "rows agrees (never stored, counted or sent; head-only devices)"
    )
    options = (
        *KeptLabels.options,
        Option("propagation_neighbours", int, 10, "pseudo-labels: neighbours per row of the kNN graph", low=1.0),
        Option(
            "propagation_alpha",
            float,
            0.9,
            "pseudo-labels: alpha of the diffusion (I - alpha W)^-1 Y",
            0.0,
            1.0,
            high_open=True,
        ),
        Option(
            "pseudo_labels",
            int,
            300,
            "pseudo-labels: most pseudo-labels a round trains on, in equal quotas per class held (0: none)",
            low=0.0,
        ),
        Option(
            "pseudo_weight",
            float,
            1.0,
            "pseudo-labels: a pseudo-label's weight (times the head's confidence) in the loss",
            low=0.0,
        ),
        Option(
            "pseudo_alignment",
            int,
            NO_ALIGNMENT,
            "pseudo-labels: align the head's pool posteriors to class shares first (0: no; 1: the device's "
            "human labels'; 2: the fleet's of the announcement, else the device's)",
            NO_ALIGNMENT,
            FLEET_SHARES,
        ),
    )
    trainers = frozenset({CLASSIFIER_ONLY})

    def semi_supervised(self, pool: np.ndarray, recipe: Recipe, fleet_shares: Sequence[float] = ()) -> SemiSupervised:
        """The round's semi-supervised problem over the pool rows, from the recipe's options and the fleet's label
        shares of the round's announcement (empty: unknown)."""
        settings = Propagation(
            neighbours=int(self.option_value(recipe.options, "propagation_neighbours")),
            alpha=self.option_value(recipe.options, "propagation_alpha"),
            most=int(self.option_value(recipe.options, "pseudo_labels")),
            alignment=int(self.option_value(recipe.options, "pseudo_alignment")),
        )
        weight = self.option_value(recipe.options, "pseudo_weight")
        tau = self.option_value(recipe.options, "logit_adjustment")
        return SemiSupervised(pool, settings, weight, tau, np.asarray(fleet_shares, dtype=np.float64))


@LOCAL_RULES.register
class OnlineReplay(SupervisedRule):
    """The core paper's online AL rule: E epochs on the new batch plus the balanced replay set, weight decay."""

    name = "online-replay"
    summary = "the core paper's online AL: new batch + 50-image balanced replay set, weight decay"

    def training_set(self, data: LocalData, recipe: Recipe, seed: int) -> tuple[np.ndarray, np.ndarray]:
        """New ∪ replay only; older labels stay in the store but are not revisited (online learning)."""
        return data.new_and_replay()


@LOCAL_RULES.register
class DMLU(LocalRule):
    """FMLU's device side: the uploaded meme and a private model (never leaving the device) train each other."""

    name = "dmlu"
    summary = "FMLU's device side: uploaded meme and private model train each other on all labels"
    reported_metrics = (METRIC_MEME_ENTROPY,)


@LOCAL_RULES.register
class CadisKD(LocalRule):
    """CADIS's device side (Eq. 20): CE + kd_weight * relational distillation towards the received global model."""

    name = "cadis-kd"
    summary = "all labels: CE + kd-weight x relational distillation towards the received global model"
    options = (Option("kd_weight", float, 1.0, "cadis-kd: weight of the relational distillation term", low=0.0),)


@LOCAL_RULES.register
class FedProx(LocalRule):
    """FedProx: the labelled set (human plus weak labels) with the proximal term against the global model."""

    name = "fedprox"
    summary = "all labels with the proximal term (mu/2)||w - w_global||^2 (mu 0: plain local SGD)"
    options = (Option("mu", float, 0.01, "FedProx proximal weight mu", low=0.0),)


@LOCAL_RULES.register
class KCFU(LocalRule):
    """KAFAL's knowledge-compensatory update (Alg. 2): balanced CE plus compensation distillation."""

    name = "kcfu"
    summary = "KAFAL: balanced CE on all labels + Gamma-weighted distillation on mixup of unlabelled samples"
    options = (Option("nu", float, 0.5, "KCFU trade-off nu between L_client and L_comp", 0.0, 1.0, flag="--kcfu-nu"),)


@LOCAL_RULES.register
class DpSgd(LocalRule):
    """DP-SGD on the classifier alone (Abadi et al. 2016): every label the device holds, each example's gradient
    clipped, Gaussian noise on each Poisson-sampled batch's sum; the device accounts its own example-level epsilon.
    A linear head makes per-example gradients cheap, so only the head-only trainer runs it."""

    name = "dp-sgd"
    summary = "DP-SGD on the classifier: every label, per-example clipped gradients, Gaussian noise (head-only devices)"
    options = (
        Option(
            "dp_sgd_clip",
            float,
            1.0,
            "dp-sgd: L2 norm each example's gradient (weight and bias) is clipped to",
            low=0.0,
        ),
        Option(
            "dp_sgd_noise_multiplier",
            float,
            1.0,
            "dp-sgd: noise multiplier z (std z * clip on each batch's sum)",
            low=0.0,
        ),
        Option(
            "dp_sgd_delta",
            float,
            1e-5,
            "dp-sgd: the delta the device's example-level epsilon is stated at",
            1e-12,
            1.0,
            high_open=True,
        ),
    )
    reported_metrics = (DP_SGD_EPSILON_METRIC,)
    trainers = frozenset({CLASSIFIER_ONLY})


@LOCAL_RULES.register
class ClassStatistics(LocalRule):
    """No training: the device sends its human labels' class counts, class feature sums and second moment, and the
    calibration sums of this round's new labels under the round's head (protocol.head_statistics), for the
    pooled-head strategy to fit the classifier the fleet's pooled labels give (head-only devices); with
    `pool_statistics`, its unlabelled pool's posterior sums under that head too (sums, never a row or a label; the
    privacy guide says what a crafted head reads from them)."""

    name = STATISTICS_RULE
    summary = "sends its labels' class statistics instead of a trained head, for --strategy pooled-head (head-only)"
    options = (
        Option(
            POOL_STATISTICS,
            int,
            0,
            "class-statistics: also send the unlabelled pool's posterior sums under the round's head (1), which refine "
            "the fleet's class means in rounds without new labels (--rounds-per-acquisition 2)",
            low=0.0,
            high=1.0,
        ),
    )
    trainers = frozenset({CLASSIFIER_ONLY})


def make_local_rule(name: str) -> LocalRule:
    """The local rule registered under `name`; ValueError listing the known ones otherwise."""
    return LOCAL_RULES.get(name)()


def runs_on(name: str, trainer: str) -> bool:
    """Whether the rule registered under `name` declares that `trainer` can run it (False for an unknown name)."""
    return name in LOCAL_RULES and trainer in LOCAL_RULES.get(name).trainers


Body = TypeVar("Body")


class RuleBodies(Generic[Body]):
    """One trainer's implementations of the declared rules, attached to a declared class; a subclass runs its
    parent's body unless it has its own (SupervisedRule's serves kept-labels and online-replay alike)."""

    def __init__(self, trainer: str) -> None:
        self.trainer = trainer
        self._bodies: dict[type[LocalRule], Body] = {}

    def attach(self, rule: type[LocalRule]) -> Callable[[Body], Body]:
        """A decorator attaching a body to a declared rule class."""

        def attached(body: Body) -> Body:
            self._bodies[rule] = body
            return body

        return attached

    def body(self, rule: LocalRule) -> Body:
        """The body that runs `rule` on this trainer; ValueError when the rule does not declare this trainer."""
        for declared in type(rule).__mro__:
            if declared in self._bodies and self.trainer in rule.trainers:
                return self._bodies[declared]
        raise ValueError(f"local rule {rule.name!r} does not run on the {self.trainer!r} trainer")
