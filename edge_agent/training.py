# Local update rules behind one interface; the training loop they share also trains the coordinator's W0.
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch
from torch import nn

from edge_agent.data import IMAGE_SHAPE, normalise
from edge_agent.models import NUM_CLASSES
from edge_agent.sampling import class_prior_bias
from edge_agent.wire import Recipe


def _no_images() -> np.ndarray:
    """An empty uint8 image array."""
    return np.zeros((0, *IMAGE_SHAPE), dtype=np.uint8)


@dataclass(frozen=True)
class LocalData:
    """What a local rule may train on: this acquisition's new labels, the replay set, all human labels, the pool,
    the weak (machine) labels a sampler proposed, and which communication round of the active round this is."""

    new_images: np.ndarray
    new_labels: np.ndarray
    replay_images: np.ndarray
    replay_labels: np.ndarray
    labelled_images: np.ndarray
    labelled_labels: np.ndarray
    unlabelled_images: np.ndarray
    weak_images: np.ndarray = field(default_factory=_no_images)
    weak_labels: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    round_in_active_round: int = 1

    def training_set(self) -> tuple[np.ndarray, np.ndarray]:
        """Human labels followed by weak labels: what a rule that trains on 'the labelled set' uses."""
        return (np.concatenate([self.labelled_images, self.weak_images]),
                np.concatenate([self.labelled_labels, self.weak_labels]).astype(np.int64))

    def class_counts(self) -> np.ndarray:
        """Human labels per class (n_k of KAFAL)."""
        return np.bincount(np.asarray(self.labelled_labels, dtype=np.int64), minlength=NUM_CLASSES)


OPTIMIZERS = ("sgd", "adam")


@dataclass(frozen=True)
class TrainSettings:
    """Mini-batch training hyperparameters (weight decay is the paper's Eq. 5 regulariser)."""

    epochs: int
    batch_size: int
    learning_rate: float
    momentum: float = 0.0
    weight_decay: float = 0.0
    seed: int = 0
    optimizer: str = "sgd"

    def __post_init__(self) -> None:
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"unknown optimizer {self.optimizer!r}; known: {', '.join(OPTIMIZERS)}")

    @classmethod
    def from_recipe(cls, recipe: Recipe, seed: int) -> "TrainSettings":
        """The SGD part of a round recipe, with a per-device, per-acquisition seed."""
        return cls(recipe.epochs, recipe.batch_size, recipe.learning_rate, recipe.momentum, recipe.weight_decay, seed)

    def make_optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        """A fresh optimizer over the model's parameters."""
        if self.optimizer == "adam":
            return torch.optim.Adam(model.parameters(), lr=self.learning_rate, weight_decay=self.weight_decay)
        return torch.optim.SGD(model.parameters(), lr=self.learning_rate, momentum=self.momentum,
                               weight_decay=self.weight_decay)


BatchLoss = Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]


def cross_entropy_loss(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Plain cross-entropy of the model's logits: the default batch loss."""
    return nn.functional.cross_entropy(model(inputs), targets)


def train_supervised(model: nn.Module, images: np.ndarray, labels: np.ndarray, settings: TrainSettings,
                     batch_loss: BatchLoss = cross_entropy_loss) -> float:
    """Trains in place with dropout on, shuffled mini-batches, a fresh optimizer; returns the last epoch's mean loss.

    `batch_loss(model, inputs, targets)` is the objective of one labelled mini-batch (a local rule may add terms).
    """
    if len(images) != len(labels):
        raise ValueError(f"{len(images)} images but {len(labels)} labels")
    if len(images) == 0:
        return float("nan")
    inputs = torch.from_numpy(normalise(images))
    targets = torch.from_numpy(np.asarray(labels, dtype=np.int64))
    optimizer = settings.make_optimizer(model)
    generator = torch.Generator().manual_seed(settings.seed)
    model.train()
    epoch_loss = float("nan")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(settings.seed)
        for _ in range(settings.epochs):
            order = torch.randperm(len(inputs), generator=generator)
            total, seen = 0.0, 0
            for start in range(0, len(order), settings.batch_size):
                batch = order[start:start + settings.batch_size]
                optimizer.zero_grad(set_to_none=True)
                loss = batch_loss(model, inputs[batch], targets[batch])
                loss.backward()
                optimizer.step()
                total += loss.item() * len(batch)
                seen += len(batch)
            epoch_loss = total / seen
    model.eval()
    return epoch_loss


class LocalRule(ABC):
    """A device's local update: trains the model in place on its data and returns metrics for the update."""

    name: str

    @abstractmethod
    def train(self, model: nn.Module, data: LocalData, global_model: nn.Module, recipe: Recipe, seed: int) -> dict[str, float]:
        """Trains `model` (which starts as a copy of `global_model`) and returns scalar metrics."""


class OnlineReplaySGD(LocalRule):
    """The core paper's online AL rule: E epochs on the new batch plus the balanced replay set, weight decay."""

    name = "online-replay"

    def train(self, model: nn.Module, data: LocalData, global_model: nn.Module, recipe: Recipe, seed: int) -> dict[str, float]:
        """Trains on new ∪ replay only; older labels stay in the store but are not revisited (online learning)."""
        images = np.concatenate([data.new_images, data.replay_images])
        labels = np.concatenate([data.new_labels, data.replay_labels])
        loss = train_supervised(model, images, labels, TrainSettings.from_recipe(recipe, seed))
        return {"train_loss": loss, "train_samples": float(len(images))}


def proximal_term(model: nn.Module, anchors: list[torch.Tensor], mu: float) -> torch.Tensor:
    """FedProx's (mu/2) ||w - w^t||^2 over every parameter, w^t being the round's global model."""
    return 0.5 * mu * sum(((parameter - anchor) ** 2).sum() for parameter, anchor in zip(model.parameters(), anchors))


class FedProx(LocalRule):
    """FedProx: E epochs on the labelled set (human plus weak labels) with the proximal term against w^t.

    mu comes from the recipe's options (default 0.01); mu = 0 is plain FedAvg local SGD on the labelled set.
    """

    name = "fedprox"

    def train(self, model: nn.Module, data: LocalData, global_model: nn.Module, recipe: Recipe, seed: int) -> dict[str, float]:
        """Minimises CE + (mu/2)||w - w^t||^2 per mini-batch."""
        mu = float(recipe.options.get("mu", 0.01))
        if mu < 0:
            raise ValueError(f"mu must be non-negative, got {mu}")
        anchors = [parameter.detach().clone() for parameter in global_model.parameters()]
        images, labels = data.training_set()

        def loss(net: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            return cross_entropy_loss(net, inputs, targets) + proximal_term(net, anchors, mu)

        train_loss = train_supervised(model, images, labels, TrainSettings.from_recipe(recipe, seed), loss)
        return {"train_loss": train_loss, "train_samples": float(len(images))}


def balanced_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, class_counts: np.ndarray) -> torch.Tensor:
    """KAFAL Eq. 4: CE(g(x) + ln n, y), the logit-adjusted loss (a class without labels gets -inf)."""
    bias = torch.from_numpy(class_prior_bias(class_counts, 1.0)).to(logits.dtype)
    return nn.functional.cross_entropy(logits + bias, targets)


def compensation_weights(class_counts: np.ndarray) -> np.ndarray:
    """KAFAL's Gamma per pseudo-label class as the authors' code computes it: (1/n_c) / sum_{n_c' > 0} (1/n_c'),
    0 for a class without labels.

    On the labelled classes this is the paper's N_k / n_{k,c} divided by a per-device constant (the same relative
    weights); the paper's scale (up to N_k) and its undefined n = 0 case made the local model collapse on the bench.
    """
    counts = np.asarray(class_counts, dtype=np.float64)
    inverse = np.where(counts > 0, 1.0 / np.maximum(counts, 1.0), 0.0)
    total = inverse.sum()
    return inverse / total if total > 0 else inverse


def compensation_loss(student: nn.Module, teacher: nn.Module, unlabelled: torch.Tensor, class_counts: np.ndarray,
                      generator: torch.Generator) -> torch.Tensor:
    """KAFAL Eq. 5 on one unlabelled batch: Gamma-weighted KL(teacher || student) on mixup of the batch.

    x~ = beta x'_1 + (1-beta) x'_2 with beta ~ Beta(2,2) per sample and the partner from a random permutation;
    Gamma(x~) mixes the Gammas of the teacher's pseudo-labels of x'_1 and x'_2 the same way.
    """
    partner = torch.randperm(len(unlabelled), generator=generator)
    beta = torch.distributions.Beta(2.0, 2.0).sample((len(unlabelled),))
    mixed = beta.view(-1, 1, 1, 1) * unlabelled + (1 - beta.view(-1, 1, 1, 1)) * unlabelled[partner]
    with torch.no_grad():
        gamma = torch.from_numpy(compensation_weights(class_counts)).float()[teacher(unlabelled).argmax(dim=1)]
        gamma = beta * gamma + (1 - beta) * gamma[partner]
        teacher_log = torch.log_softmax(teacher(mixed), dim=1)
    student_log = torch.log_softmax(student(mixed), dim=1)
    divergence = torch.sum(teacher_log.exp() * (teacher_log - student_log), dim=1)
    return torch.mean(gamma * divergence)


class KCFU(LocalRule):
    """KAFAL's knowledge-compensatory update (Alg. 2): balanced CE on the labelled set, plus, after the first
    communication round of an active round, nu-weighted compensation distillation from the global model."""

    name = "kcfu"

    def train(self, model: nn.Module, data: LocalData, global_model: nn.Module, recipe: Recipe, seed: int) -> dict[str, float]:
        """L = L_client in round 1 of the active round, else nu L_client + (1 - nu) L_comp (Eq. 6, nu default 0.5)."""
        nu = float(recipe.options.get("nu", 0.5))
        if not 0.0 <= nu <= 1.0:
            raise ValueError(f"nu must lie in [0, 1], got {nu}")
        counts = data.class_counts()
        unlabelled = torch.from_numpy(normalise(data.unlabelled_images)) if len(data.unlabelled_images) else None
        compensate = data.round_in_active_round > 1 and unlabelled is not None
        teacher = global_model.eval()
        generator = torch.Generator().manual_seed(seed + 1)

        def loss(net: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            client = balanced_cross_entropy(net(inputs), targets, counts)
            if not compensate:
                return client
            batch = unlabelled[torch.randint(len(unlabelled), (len(inputs),), generator=generator)]
            return nu * client + (1 - nu) * compensation_loss(net, teacher, batch, counts, generator)

        train_loss = train_supervised(model, data.labelled_images, data.labelled_labels,
                                      TrainSettings.from_recipe(recipe, seed), loss)
        return {"train_loss": train_loss, "train_samples": float(len(data.labelled_labels)),
                "compensation": float(compensate)}


LOCAL_RULES: dict[str, type[LocalRule]] = {rule.name: rule for rule in (OnlineReplaySGD,)}
LOCAL_RULES.update({rule.name: rule for rule in (FedProx, KCFU)})


def make_local_rule(name: str) -> LocalRule:
    """The local rule registered under `name`; ValueError listing the known ones otherwise."""
    if name not in LOCAL_RULES:
        raise ValueError(f"unknown local rule {name!r}; known: {', '.join(sorted(LOCAL_RULES))}")
    return LOCAL_RULES[name]()
