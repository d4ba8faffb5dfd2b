# The training loop every local rule shares (seeded epochs of shuffled mini-batches); it also trains the coordinator's W0.
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from edge_agent.data.image_arrays import model_input
from edge_agent.learning.lr_schedules import lr_factor, schedule_problem
from protocol.messages import Recipe

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
    lr_schedule: str = "constant"

    def __post_init__(self) -> None:
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"unknown optimizer {self.optimizer!r}; known: {', '.join(OPTIMIZERS)}")
        problem = schedule_problem(self.lr_schedule)
        if problem is not None:
            raise ValueError(problem)

    @classmethod
    def from_recipe(cls, recipe: Recipe, seed: int) -> TrainSettings:
        """The SGD part of a round recipe, with a per-device, per-acquisition seed."""
        return cls(
            recipe.epochs,
            recipe.batch_size,
            recipe.learning_rate,
            recipe.momentum,
            recipe.weight_decay,
            seed,
            lr_schedule=recipe.lr_schedule,
        )

    def make_optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        """A fresh optimizer over the parameters the spec trains (`requires_grad`): frozen blocks of a "head" or
        "last:N" model get no optimizer state and no weight decay, so they stay bit for bit as received."""
        trained = [parameter for parameter in model.parameters() if parameter.requires_grad]
        if self.optimizer == "adam":
            return torch.optim.Adam(trained, lr=self.learning_rate, weight_decay=self.weight_decay)
        return torch.optim.SGD(trained, lr=self.learning_rate, momentum=self.momentum, weight_decay=self.weight_decay)

    def make_schedulers(
        self, optimizers: Sequence[torch.optim.Optimizer], total_steps: int
    ) -> list[torch.optim.lr_scheduler.LRScheduler]:
        """One per optimizer, stepped after each mini-batch (none for the constant schedule: the loop is then
        exactly the unscheduled one)."""
        if self.lr_schedule == "constant":
            return []
        schedule = self.lr_schedule
        return [
            torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(schedule, step, total_steps))
            for optimizer in optimizers
        ]


def train_supervised(model: nn.Module, images: np.ndarray, labels: np.ndarray, settings: TrainSettings) -> float:
    """Trains in place with dropout on, shuffled mini-batches, a fresh optimizer; returns the last epoch's mean loss."""
    return run_epochs(
        [model], images, labels, settings, lambda inputs, targets: nn.functional.cross_entropy(model(inputs), targets)
    )


BatchLoss = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def batch_starts(count: int, batch_size: int, min_batch: int) -> list[int]:
    """Where an epoch's mini-batches start, leaving out a last batch smaller than min_batch: the same positions every
    epoch (only the order within them is reshuffled), so they also count a round's steps for its schedule."""
    return [start for start in range(0, count, batch_size) if min(batch_size, count - start) >= min_batch]


def run_epochs(
    models: Sequence[nn.Module],
    images: np.ndarray,
    labels: np.ndarray,
    settings: TrainSettings,
    batch_loss: BatchLoss,
    min_batch: int = 1,
) -> float:
    """The training loop every rule shares: E seeded epochs of shuffled mini-batches, one fresh optimizer per model.

    batch_loss(inputs, targets) gives the scalar to minimise; all models train (dropout on) and step together.
    A last batch smaller than min_batch is dropped. Returns the last epoch's mean loss (nan without data).
    """
    if len(images) != len(labels):
        raise ValueError(f"{len(images)} images but {len(labels)} labels")
    if settings.batch_size < min_batch:
        raise ValueError(
            f"this rule needs batches of at least {min_batch} samples, got batch size {settings.batch_size}"
        )
    if len(images) < min_batch:
        return float("nan")
    inputs = torch.from_numpy(model_input(images))
    targets = torch.from_numpy(np.asarray(labels, dtype=np.int64))
    optimizers = [settings.make_optimizer(model) for model in models]
    starts = batch_starts(len(inputs), settings.batch_size, min_batch)
    schedulers = settings.make_schedulers(optimizers, settings.epochs * len(starts))
    generator = torch.Generator().manual_seed(settings.seed)
    for model in models:
        model.train()
    epoch_loss = float("nan")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(settings.seed)
        for _ in range(settings.epochs):
            order = torch.randperm(len(inputs), generator=generator)
            batches = [order[start : start + settings.batch_size] for start in starts]
            epoch_loss = run_epoch(inputs, targets, batches, (optimizers, schedulers), batch_loss)
    for model in models:
        model.eval()
    return epoch_loss


Steppers = tuple[Sequence[torch.optim.Optimizer], Sequence[torch.optim.lr_scheduler.LRScheduler]]


def run_epoch(
    inputs: torch.Tensor,
    targets: torch.Tensor,
    batches: Sequence[torch.Tensor],
    steppers: Steppers,
    batch_loss: BatchLoss,
) -> float:
    """One pass over the given index batches, every optimizer (then its learning-rate scheduler, if any) stepping on
    each; the mean loss per sample."""
    optimizers, schedulers = steppers
    total, seen = 0.0, 0
    for batch in batches:
        for optimizer in optimizers:
            optimizer.zero_grad(set_to_none=True)
        loss = batch_loss(inputs[batch], targets[batch])
        loss.backward()
        for optimizer in optimizers:
            optimizer.step()
        for scheduler in schedulers:
            scheduler.step()
        total += loss.item() * len(batch)
        seen += len(batch)
    return total / seen
