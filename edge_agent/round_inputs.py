# What one round's work reads: the models (global, current, own), the MC-dropout scorer, the training view.
from __future__ import annotations

import logging
from dataclasses import dataclass
from functools import cache

import numpy as np
from torch import nn

from edge_agent import wire
from edge_agent.agent_settings import AgentSettings
from edge_agent.bundle import Bundle
from edge_agent.device_data import DeviceData
from edge_agent.files import load_arrays
from edge_agent.mc_dropout import TorchMCDropout
from edge_agent.mc_scorer import MCScorer
from edge_agent.models import build_model, get_weights, set_weights
from edge_agent.ort_scorer import OrtMCDropout
from edge_agent.training import LocalData

log = logging.getLogger(__name__)

OWN_MODEL_FILE = "own_model.npz"


@dataclass(frozen=True)
class RoundModels:
    """The models of a round: the one being trained (current), the global model received, the base hash, the
    recipe, and the artefacts that came with it (the bundle for onnxruntime scoring, FAST's encoder)."""

    current: nn.Module
    global_model: nn.Module
    base_hash: str
    recipe: wire.Recipe
    bundle: Bundle | None = None
    encoder: bytes | None = None


def make_mc_scorer(settings: AgentSettings, model: nn.Module, bundle: Bundle | None) -> MCScorer:
    """The profile's MC-dropout back end over the model as it is now (after any local training this round);
    rounds and stream acquisition both score through it."""
    if settings.scores_with_onnxruntime:
        if bundle is None:
            raise ValueError("the onnxruntime back end needs the round's bundle, which has not arrived")
        return OrtMCDropout(
            bundle,
            settings.inference_batch,
            threads=settings.inference_threads,
            providers=settings.execution_providers,
            weights=get_weights(model),
        )
    return TorchMCDropout(model, settings.inference_batch)


def mc_probabilities(
    settings: AgentSettings, models: RoundModels, images: np.ndarray, passes: int, seed: int
) -> np.ndarray:
    """MC-dropout probabilities of raw pool images with the given passes, capped by the profile."""
    passes = min(passes, settings.mc_passes_cap or passes)
    log.info("scoring backend=%s passes=%d images=%d", settings.backend, passes, len(images))
    return make_mc_scorer(settings, models.current, models.bundle).probabilities(images, passes, seed)


def own_model(data: DeviceData, model_name: str, current: nn.Module) -> nn.Module:
    """The device's own last trained model omega_i (kept across rounds), or `current` before it has one."""
    path = data.state_dir / OWN_MODEL_FILE
    if not path.is_file():
        return current
    model = build_model(model_name)
    set_weights(model, load_arrays(path))
    return model


def training_view(data: DeviceData, new_indices: np.ndarray, new_labels: np.ndarray, round_in_active: int) -> LocalData:
    """The training view of the device's data after an acquisition (replay excludes the new batch); the pool is
    read only if the rule asks for it (KCFU), never copied per step otherwise."""
    labelled_indices, labelled_labels = data.labelled()
    replay_indices, replay_labels = data.replay()
    weak_indices, weak_labels = data.weak_labels()
    keep = ~np.isin(replay_indices, new_indices)
    return LocalData(
        new_images=data.images(new_indices),
        new_labels=new_labels,
        replay_images=data.images(replay_indices[keep]),
        replay_labels=replay_labels[keep],
        labelled_images=data.images(labelled_indices),
        labelled_labels=labelled_labels,
        unlabelled=cache(lambda: data.images(data.pool_indices())),
        state_dir=data.state_dir,
        weak_images=data.images(weak_indices),
        weak_labels=weak_labels,
        round_in_active_round=round_in_active,
    )
