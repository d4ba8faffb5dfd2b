# Local update rules behind one interface; the training loop they share also trains the coordinator's W0.
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from edge_agent.data import normalise
from edge_agent.wire import Recipe


@dataclass(frozen=True)
class LocalData:
    """What a local rule may train on: this acquisition's new labels, the replay set, all labels, the pool."""

    new_images: np.ndarray
    new_labels: np.ndarray
    replay_images: np.ndarray
    replay_labels: np.ndarray
    labelled_images: np.ndarray
    labelled_labels: np.ndarray
    unlabelled_images: np.ndarray


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


def train_supervised(model: nn.Module, images: np.ndarray, labels: np.ndarray, settings: TrainSettings) -> float:
    """Trains in place with dropout on, shuffled mini-batches, a fresh optimizer; returns the last epoch's mean loss."""
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
                loss = nn.functional.cross_entropy(model(inputs[batch]), targets[batch])
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


LOCAL_RULES: dict[str, type[LocalRule]] = {rule.name: rule for rule in (OnlineReplaySGD,)}


def make_local_rule(name: str) -> LocalRule:
    """The local rule registered under `name`; ValueError listing the known ones otherwise."""
    if name not in LOCAL_RULES:
        raise ValueError(f"unknown local rule {name!r}; known: {', '.join(sorted(LOCAL_RULES))}")
    return LOCAL_RULES[name]()
