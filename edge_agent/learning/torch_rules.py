# The whole-model (torch) bodies of the declared local rules, attached to their declarations in local_rules.
from __future__ import annotations

import copy
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from edge_agent.data.image_arrays import model_input
from edge_agent.learning.local_data import LocalData
from edge_agent.learning.local_rules import (
    DMLU,
    FULL_MODEL,
    KCFU,
    CadisKD,
    FedProx,
    LocalRule,
    RuleBodies,
    SupervisedRule,
)
from edge_agent.learning.mc_dropout import as_split_model
from edge_agent.learning.models import get_weights, set_weights
from edge_agent.learning.rule_losses import (
    MIN_KD_BATCH,
    balanced_cross_entropy,
    compensation_loss,
    dmlu_losses,
    mean_prediction_entropy,
    proximal_term,
    relational_kd_loss,
)
from edge_agent.learning.training import TrainSettings, run_epochs, train_supervised
from protocol.files import load_arrays, save_arrays
from protocol.messages import METRIC_MEME_ENTROPY, Recipe

log = logging.getLogger(__name__)

PRIVATE_MODEL_FILE = "dmlu_private.npz"

TorchBody = Callable[[Any, nn.Module, LocalData, nn.Module, Recipe, int], dict[str, float]]
TORCH_BODIES: RuleBodies[TorchBody] = RuleBodies(FULL_MODEL)


def train_rule(
    rule: LocalRule, model: nn.Module, data: LocalData, global_model: nn.Module, recipe: Recipe, seed: int
) -> dict[str, float]:
    """Trains `model` (which starts as a copy of `global_model`) in place with the rule's torch body; the metrics
    the update carries."""
    return TORCH_BODIES.body(rule)(rule, model, data, global_model, recipe, seed)


@TORCH_BODIES.attach(SupervisedRule)
def train_supervised_rule(
    rule: SupervisedRule, model: nn.Module, data: LocalData, global_model: nn.Module, recipe: Recipe, seed: int
) -> dict[str, float]:
    """Local SGD on the rule's training set, on CE(logits + bias, y) when the rule gives a logit bias."""
    images, labels = rule.training_set(data, recipe, seed)
    settings = TrainSettings.from_recipe(recipe, seed)
    adjustment = rule.logit_bias(labels, data.num_classes, recipe)
    if adjustment is None:
        train_loss = train_supervised(model, images, labels, settings)
    else:
        bias = torch.from_numpy(adjustment).float()
        train_loss = run_epochs(
            [model], images, labels, settings, lambda x, y: nn.functional.cross_entropy(model(x) + bias, y)
        )
    return {"train_loss": train_loss, "train_samples": float(len(images))}


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


@TORCH_BODIES.attach(DMLU)
def train_dmlu(
    rule: DMLU, model: nn.Module, data: LocalData, global_model: nn.Module, recipe: Recipe, seed: int
) -> dict[str, float]:
    """Trains the meme (`model`, uploaded) and L^c together for E epochs on all labelled data with DMLU losses;
    L^c lives in state_dir (atomic writes). Returns {meme_entropy: H_c}, the meme's mean prediction entropy."""
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


@TORCH_BODIES.attach(CadisKD)
def train_cadis_kd(
    rule: CadisKD, model: nn.Module, data: LocalData, global_model: nn.Module, recipe: Recipe, seed: int
) -> dict[str, float]:
    """CE + kd_weight * L_KD on all labelled data; the teacher is the frozen global model, compared on penultimate
    features; batches of fewer than 3 are dropped."""
    kd_weight = rule.option_value(recipe.options, "kd_weight")
    student, teacher = as_split_model(model), as_split_model(copy.deepcopy(global_model).eval())

    def batch_loss(inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        features, logits = student.features_and_logits(inputs)
        with torch.no_grad():
            teacher_features, _ = teacher.features_and_logits(inputs)
        return nn.functional.cross_entropy(logits, targets) + kd_weight * relational_kd_loss(features, teacher_features)

    settings = TrainSettings.from_recipe(recipe, seed)
    loss = run_epochs([model], data.labelled_images, data.labelled_labels, settings, batch_loss, MIN_KD_BATCH)
    return {"train_loss": loss, "train_samples": float(len(data.labelled_labels))}


@TORCH_BODIES.attach(FedProx)
def train_fedprox(
    rule: FedProx, model: nn.Module, data: LocalData, global_model: nn.Module, recipe: Recipe, seed: int
) -> dict[str, float]:
    """Minimises CE + (mu/2)||w - w^t||^2 per mini-batch on the labelled set (mu 0: plain local SGD)."""
    mu = rule.option_value(recipe.options, "mu")
    anchors = [parameter.detach().clone() for parameter in global_model.parameters()]
    images, labels = data.training_set()

    def loss(inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(model(inputs), targets) + proximal_term(model, anchors, mu)

    train_loss = run_epochs([model], images, labels, TrainSettings.from_recipe(recipe, seed), loss)
    return {"train_loss": train_loss, "train_samples": float(len(images))}


@TORCH_BODIES.attach(KCFU)
def train_kcfu(
    rule: KCFU, model: nn.Module, data: LocalData, global_model: nn.Module, recipe: Recipe, seed: int
) -> dict[str, float]:
    """L = L_client in round 1 of the active round, else nu L_client + (1 - nu) L_comp (Eq. 6, nu default 0.5)."""
    nu = rule.option_value(recipe.options, "nu")
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
