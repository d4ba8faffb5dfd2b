# Local update rules behind one interface; the training loop they share also trains the coordinator's W0.
from __future__ import annotations

import copy
import logging
from abc import abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import numpy as np
import torch
from torch import nn

from edge_agent.data.image_arrays import model_input
from edge_agent.learning.local_data import LOGIT_ADJUSTMENT_OPTION, RESERVOIR_OPTION, LocalData, label_logit_bias
from edge_agent.learning.lr_schedules import lr_factor, schedule_problem
from edge_agent.learning.mc_dropout import as_split_model
from edge_agent.learning.models import get_weights, set_weights
from edge_agent.learning.sampling import class_prior_bias
from protocol.files import load_arrays, save_arrays
from protocol.messages import METRIC_MEME_ENTROPY, Recipe
from protocol.options import Method, Option, Registry

log = logging.getLogger(__name__)

PRIVATE_MODEL_FILE = "dmlu_private.npz"
MIN_KD_BATCH = 3


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
        """A fresh optimizer over the model's parameters."""
        if self.optimizer == "adam":
            return torch.optim.Adam(model.parameters(), lr=self.learning_rate, weight_decay=self.weight_decay)
        return torch.optim.SGD(
            model.parameters(), lr=self.learning_rate, momentum=self.momentum, weight_decay=self.weight_decay
        )

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


LOCAL_RULES: Registry[type[LocalRule]] = Registry("local rule")


class LocalRule(Method):
    """A device's local update: trains the model in place on its data and returns metrics for the update."""

    reported_metrics: ClassVar[tuple[str, ...]] = ()

    @abstractmethod
    def train(
        self, model: nn.Module, data: LocalData, global_model: nn.Module, recipe: Recipe, seed: int
    ) -> dict[str, float]:
        """Trains `model` (which starts as a copy of `global_model`) and returns scalar metrics."""


class OnlineReplaySGD(LocalRule):
    """The core paper's online AL rule: E epochs on the new batch plus the balanced replay set, weight decay."""

    name = "online-replay"
    summary = "the core paper's online AL: new batch + 50-image balanced replay set, weight decay"

    def train(
        self, model: nn.Module, data: LocalData, global_model: nn.Module, recipe: Recipe, seed: int
    ) -> dict[str, float]:
        """Trains on new ∪ replay only; older labels stay in the store but are not revisited (online learning)."""
        images, labels = data.new_and_replay()
        loss = train_supervised(model, images, labels, TrainSettings.from_recipe(recipe, seed))
        return {"train_loss": loss, "train_samples": float(len(images))}


class KeptLabels(LocalRule):
    """Every label the device paid for, each round: human and weak labels, or a class-balanced reservoir of them.

    With a logit adjustment tau > 0 the loss is CE(logits + tau ln n_c, y): under label skew the device's own
    frequent classes stop pulling the shared classifier towards them (Menon et al. 2021; KAFAL's tau = 1).
    """

    name = "kept-labels"
    summary = "every label the device holds (or a class-balanced reservoir of them), E epochs from the global model"
    options = (RESERVOIR_OPTION, LOGIT_ADJUSTMENT_OPTION)

    def train(
        self, model: nn.Module, data: LocalData, global_model: nn.Module, recipe: Recipe, seed: int
    ) -> dict[str, float]:
        """Local SGD on the kept set, logit-adjusted by the kept set's class counts when tau > 0."""
        images, labels = data.kept_set(int(RESERVOIR_OPTION.read(recipe.options)), seed)
        settings = TrainSettings.from_recipe(recipe, seed)
        adjustment = label_logit_bias(labels, data.num_classes, LOGIT_ADJUSTMENT_OPTION.read(recipe.options))
        if adjustment is None:
            train_loss = train_supervised(model, images, labels, settings)
        else:
            bias = torch.from_numpy(adjustment).float()
            train_loss = run_epochs(
                [model], images, labels, settings, lambda x, y: nn.functional.cross_entropy(model(x) + bias, y)
            )
        return {"train_loss": train_loss, "train_samples": float(len(images))}


def prediction_entropy(logits: torch.Tensor) -> torch.Tensor:
    """H(softmax(logits)) per sample, in nats."""
    log_p = nn.functional.log_softmax(logits, dim=1)
    return -(log_p.exp() * log_p).sum(dim=1)


def distillation_kl(target_logits: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """KL(softmax(target) || softmax(logits)) per sample; the target distribution is detached (no gradient)."""
    log_target = nn.functional.log_softmax(target_logits.detach(), dim=1)
    return (log_target.exp() * (log_target - nn.functional.log_softmax(logits, dim=1))).sum(dim=1)


def confidence_coefficients(logits: torch.Tensor) -> torch.Tensor:
    """DMLU's per-sample coefficient e^{-H(p)}, detached; it lies in [1/C, 1]."""
    return torch.exp(-prediction_entropy(logits.detach()))


def mutual_losses(
    local_logits: torch.Tensor,
    meme_logits: torch.Tensor,
    targets: torch.Tensor,
    local_coefficients: torch.Tensor,
    meme_coefficients: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(L_local, L_meme) of deep mutual learning: each model's CE plus its per-sample weighted, batch-mean KL
    towards the other model's detached prediction."""
    local_loss = (
        nn.functional.cross_entropy(local_logits, targets)
        + (local_coefficients * distillation_kl(meme_logits, local_logits)).mean()
    )
    meme_loss = (
        nn.functional.cross_entropy(meme_logits, targets)
        + (meme_coefficients * distillation_kl(local_logits, meme_logits)).mean()
    )
    return local_loss, meme_loss


def dmlu_losses(
    local_logits: torch.Tensor, meme_logits: torch.Tensor, targets: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """FMLU's Eq. 3-4: L_local = CE + e^{-H(p_meme)} KL(p_meme||p_local), L_meme = CE + e^{-H(p_local)} KL(p_local||p_meme)."""
    return mutual_losses(
        local_logits, meme_logits, targets, confidence_coefficients(meme_logits), confidence_coefficients(local_logits)
    )


def mean_prediction_entropy(model: nn.Module, images: np.ndarray, batch_size: int = 256) -> float:
    """The model's mean H(p) over images with dropout off (FMLU's H_c); nan for no images."""
    if len(images) == 0:
        return float("nan")
    model.eval()
    total = 0.0
    with torch.no_grad():
        for start in range(0, len(images), batch_size):
            inputs = torch.from_numpy(model_input(images[start : start + batch_size]))
            total += float(prediction_entropy(model(inputs)).sum())
    return total / len(images)


def private_model_path(state_dir: Path) -> Path:
    """Where DMLU keeps the device's personalised model L^c."""
    return Path(state_dir) / PRIVATE_MODEL_FILE


def load_private_model(state_dir: Path, first_global: nn.Module) -> nn.Module:
    """L^c from the device's state dir, or a copy of the global model when the device has none yet."""
    private = copy.deepcopy(first_global)
    path = private_model_path(state_dir)
    if path.is_file():
        set_weights(private, load_arrays(path))
    return private


class DMLU(LocalRule):
    """FMLU's device side: trains the meme (the model that is uploaded) and the private L^c with DMLU losses.

    L^c never leaves the device: it lives in state_dir (atomic writes) and only this rule reads or writes it.
    The only metric reported is the meme's mean prediction entropy on the labelled data after training (H_c).
    """

    name = "dmlu"
    summary = "FMLU's device side: uploaded meme and private model train each other on all labels"
    reported_metrics = (METRIC_MEME_ENTROPY,)

    def train(
        self, model: nn.Module, data: LocalData, global_model: nn.Module, recipe: Recipe, seed: int
    ) -> dict[str, float]:
        """Trains meme and L^c together for E epochs on all labelled data; returns {meme_entropy: H_c}."""
        if data.state_dir is None:
            raise ValueError("the dmlu rule keeps a private model and needs the device's state_dir")
        private = load_private_model(data.state_dir, global_model)

        def batch_loss(inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            local_loss, meme_loss = dmlu_losses(private(inputs), model(inputs), targets)
            return local_loss + meme_loss

        loss = run_epochs(
            [private, model],
            data.labelled_images,
            data.labelled_labels,
            TrainSettings.from_recipe(recipe, seed),
            batch_loss,
        )
        save_arrays(private_model_path(data.state_dir), get_weights(private))
        entropy = mean_prediction_entropy(model, data.labelled_images)
        log.info("dmlu trained samples=%d loss=%.4f meme_entropy=%.4f", len(data.labelled_labels), loss, entropy)
        return {METRIC_MEME_ENTROPY: entropy}


def kernel_neighbour_distribution(features: torch.Tensor) -> torch.Tensor:
    """p_{j|i} over a batch's other samples (B x (B-1)), with the CADIS code's kernel on pairwise distances:
    K_ij = exp(-(d_ij - mean d)^2 / (2 (std(d)^2 + 1e-3))), d the off-diagonal Euclidean distances."""
    count = len(features)
    if count < MIN_KD_BATCH:
        raise ValueError(f"relational distillation needs at least {MIN_KD_BATCH} samples per batch, got {count}")
    distances = torch.cdist(features, features)
    off_diagonal = ~torch.eye(count, dtype=torch.bool)
    d = distances[off_diagonal].reshape(count, count - 1)
    kernel = torch.exp(-0.5 * (d - d.mean()) ** 2 / (d.std() ** 2 + 1e-3))
    return kernel / kernel.sum(dim=1, keepdim=True)


def relational_kd_loss(student_features: torch.Tensor, teacher_features: torch.Tensor) -> torch.Tensor:
    """CADIS's Eq. 18-19: sum_i sum_{j!=i} p_{j|i} ln(p_{j|i} / q_{j|i}), p from the teacher, q from the student."""
    teacher = kernel_neighbour_distribution(teacher_features.detach())
    student = kernel_neighbour_distribution(student_features)
    return (teacher * (teacher.log() - student.log())).sum()


class CadisKD(LocalRule):
    """CADIS's device side (Eq. 20): CE + kd_weight * L_KD on all labelled data; the teacher is the frozen
    global model received this round, compared on penultimate features; batches of fewer than 3 are dropped."""

    name = "cadis-kd"
    summary = "all labels: CE + kd-weight x relational distillation towards the received global model"
    options = (Option("kd_weight", float, 1.0, "cadis-kd: weight of the relational distillation term", low=0.0),)

    def train(
        self, model: nn.Module, data: LocalData, global_model: nn.Module, recipe: Recipe, seed: int
    ) -> dict[str, float]:
        """Trains `model` in place; the recipe option kd_weight (default 1.0) scales the distillation term."""
        kd_weight = self.option_value(recipe.options, "kd_weight")
        student, teacher = as_split_model(model), as_split_model(copy.deepcopy(global_model).eval())

        def batch_loss(inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            features, logits = student.features_and_logits(inputs)
            with torch.no_grad():
                teacher_features, _ = teacher.features_and_logits(inputs)
            return nn.functional.cross_entropy(logits, targets) + kd_weight * relational_kd_loss(
                features, teacher_features
            )

        loss = run_epochs(
            [model],
            data.labelled_images,
            data.labelled_labels,
            TrainSettings.from_recipe(recipe, seed),
            batch_loss,
            min_batch=MIN_KD_BATCH,
        )
        return {"train_loss": loss, "train_samples": float(len(data.labelled_labels))}


def proximal_term(model: nn.Module, anchors: list[torch.Tensor], mu: float) -> torch.Tensor:
    """FedProx's (mu/2) ||w - w^t||^2 over every parameter, w^t being the round's global model."""
    squares = (((parameter - anchor) ** 2).sum() for parameter, anchor in zip(model.parameters(), anchors))
    return 0.5 * mu * sum(squares, torch.zeros(()))


class FedProx(LocalRule):
    """FedProx: E epochs on the labelled set (human plus weak labels) with the proximal term against w^t.

    mu comes from the recipe's options (default 0.01); mu = 0 is plain FedAvg local SGD on the labelled set.
    """

    name = "fedprox"
    summary = "all labels with the proximal term (mu/2)||w - w_global||^2 (mu 0: plain local SGD)"
    options = (Option("mu", float, 0.01, "FedProx proximal weight mu", low=0.0),)

    def train(
        self, model: nn.Module, data: LocalData, global_model: nn.Module, recipe: Recipe, seed: int
    ) -> dict[str, float]:
        """Minimises CE + (mu/2)||w - w^t||^2 per mini-batch."""
        mu = self.option_value(recipe.options, "mu")
        anchors = [parameter.detach().clone() for parameter in global_model.parameters()]
        images, labels = data.training_set()

        def loss(inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            return nn.functional.cross_entropy(model(inputs), targets) + proximal_term(model, anchors, mu)

        train_loss = run_epochs([model], images, labels, TrainSettings.from_recipe(recipe, seed), loss)
        return {"train_loss": train_loss, "train_samples": float(len(images))}


def balanced_cross_entropy(
    logits: torch.Tensor, targets: torch.Tensor, class_counts: np.ndarray, tau: float = 1.0
) -> torch.Tensor:
    """KAFAL Eq. 4 (tau = 1): CE(g(x) + tau ln n, y), the logit-adjusted loss (a class without labels gets -inf;
    tau = 0 is plain CE)."""
    bias = torch.from_numpy(class_prior_bias(class_counts, tau)).to(logits.dtype)
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


def compensation_loss(
    student: nn.Module,
    teacher: nn.Module,
    unlabelled: torch.Tensor,
    class_counts: np.ndarray,
    generator: torch.Generator,
) -> torch.Tensor:
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
    summary = "KAFAL: balanced CE on all labels + Gamma-weighted distillation on mixup of unlabelled samples"
    options = (Option("nu", float, 0.5, "KCFU trade-off nu between L_client and L_comp", 0.0, 1.0, flag="--kcfu-nu"),)

    def train(
        self, model: nn.Module, data: LocalData, global_model: nn.Module, recipe: Recipe, seed: int
    ) -> dict[str, float]:
        """L = L_client in round 1 of the active round, else nu L_client + (1 - nu) L_comp (Eq. 6, nu default 0.5)."""
        nu = self.option_value(recipe.options, "nu")
        counts = data.class_counts()
        pool = data.unlabelled()
        unlabelled = torch.from_numpy(model_input(pool)) if len(pool) else None
        compensate = data.round_in_active_round > 1 and unlabelled is not None
        teacher = global_model.eval()
        generator = torch.Generator().manual_seed(seed + 1)

        def loss(inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            client = balanced_cross_entropy(model(inputs), targets, counts)
            if not compensate or unlabelled is None:
                return client
            batch = unlabelled[torch.randint(len(unlabelled), (len(inputs),), generator=generator)]
            return nu * client + (1 - nu) * compensation_loss(model, teacher, batch, counts, generator)

        train_loss = run_epochs(
            [model], data.labelled_images, data.labelled_labels, TrainSettings.from_recipe(recipe, seed), loss
        )
        return {
            "train_loss": train_loss,
            "train_samples": float(len(data.labelled_labels)),
            "compensation": float(compensate),
        }


for registered in (KeptLabels, OnlineReplaySGD, DMLU, CadisKD, FedProx, KCFU):
    LOCAL_RULES.register(registered)


def make_local_rule(name: str) -> LocalRule:
    """The local rule registered under `name`; ValueError listing the known ones otherwise."""
    return LOCAL_RULES.get(name)()
