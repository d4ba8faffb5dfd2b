# MC-dropout class probabilities: the deterministic prefix runs once per sample, the dropout tail r times.
from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch
from torch import nn

from edge_agent.learning.mc_scorer import DropoutSpec, mc_probabilities
from edge_agent.learning.split_model import SplitDropoutModel


def as_split_model(model: nn.Module) -> SplitDropoutModel:
    """The model as a prefix/masked-tail model; ValueError for a model that cannot score with explicit masks."""
    if not isinstance(model, SplitDropoutModel):
        raise ValueError(f"{type(model).__name__} has no tail_with_masks, so it cannot score with explicit masks")
    return model


def dropout_spec(model: nn.Module) -> DropoutSpec:
    """The rates and mask shapes of a model's dropout layers (the model must offer tail_with_masks)."""
    model = as_split_model(model)
    return DropoutSpec(tuple(model.dropout_rates), tuple(tuple(shape) for shape in model.dropout_mask_shapes))


class PrefixGraph(nn.Module):
    """The deterministic prefix as a module of its own: what the torch back end runs and export traces."""

    def __init__(self, model: SplitDropoutModel) -> None:
        super().__init__()
        self.model = model

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """Prefix features of model inputs (images scaled to [0, 1])."""
        return self.model.prefix(images)


class MaskedTailGraph(nn.Module):
    """The stochastic tail with explicit scaled masks, ending in softmax: what the torch back end runs and export traces."""

    def __init__(self, model: SplitDropoutModel) -> None:
        super().__init__()
        self.model = model

    def forward(self, features: torch.Tensor, *masks: torch.Tensor) -> torch.Tensor:
        """Class probabilities of prefix features under the given dropout masks."""
        return torch.softmax(self.model.tail_with_masks(features, masks), dim=-1)


class PenultimateGraph(nn.Module):
    """The classifier's input features of prefix features, dropout off: what a head-only device trains on."""

    def __init__(self, model: SplitDropoutModel) -> None:
        super().__init__()
        self.model = model

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        """Penultimate features of prefix features (eval mode)."""
        return self.model.penultimate(features)


class TorchMCDropout:
    """Torch back end: probabilities of r stochastic passes, shaped (r, N, C), reproducible for a seed.

    Only the layers after the first dropout are repeated, on a batch replicated r times, which cuts the work
    of the paper CNN from r full passes to one prefix plus r cheap tails per image. The dropout masks come
    from the shared numpy generator, so the onnxruntime back end gives the same probabilities for the same seed.
    """

    name = "torch"

    def __init__(self, model: nn.Module, batch_size: int = 256) -> None:
        self.model = model
        self.batch_size = batch_size
        self.spec = dropout_spec(model)
        self._prefix = PrefixGraph(as_split_model(model))
        self._tail = MaskedTailGraph(as_split_model(model))

    def probabilities(self, images: np.ndarray, passes: int, seed: int) -> np.ndarray:
        """MC-dropout softmax outputs over `passes` passes for model inputs (float32 (N, C, H, W) in [0, 1]) or raw uint8 images."""
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.inference_mode():
                return mc_probabilities(
                    self._run_prefix, self._run_tail, self.spec, images, passes, seed, self.batch_size
                )
        finally:
            self.model.train(was_training)

    def _run_prefix(self, images: np.ndarray) -> np.ndarray:
        """Prefix features of a numpy batch, as numpy."""
        return self._prefix(torch.from_numpy(images)).numpy()

    def _run_tail(self, features: np.ndarray, masks: Sequence[np.ndarray]) -> np.ndarray:
        """Tail probabilities of numpy features under numpy masks, as numpy."""
        return self._tail(torch.from_numpy(features), *(torch.from_numpy(mask) for mask in masks)).numpy()


def predict_probabilities(model: nn.Module, images: np.ndarray, batch_size: int = 1000) -> np.ndarray:
    """Deterministic softmax outputs (dropout off), shaped (N, C): what a plain evaluation uses."""
    return _predict(model, images, batch_size, lambda batch: torch.softmax(model(batch), dim=-1))


def predict_logits(model: nn.Module, images: np.ndarray, batch_size: int = 1000) -> np.ndarray:
    """Deterministic logits (dropout off), shaped (N, C): what KSAS compares between two models."""
    return _predict(model, images, batch_size, model)


def predict_features(model: SplitDropoutModel, images: np.ndarray, batch_size: int = 1000) -> np.ndarray:
    """Deterministic penultimate features (dropout off), shaped (N, D): what BADGE's gradient embedding is built on."""
    return _predict(model, images, batch_size, lambda batch: model.penultimate(model.prefix(batch)))


def _predict(
    model: nn.Module, images: np.ndarray, batch_size: int, output: Callable[[torch.Tensor], torch.Tensor]
) -> np.ndarray:
    """output(batch) over model inputs in batches with the model's dropout off, its mode restored."""
    was_training = model.training
    model.eval()
    chunks = []
    with torch.inference_mode():
        for start in range(0, len(images), batch_size):
            batch = torch.from_numpy(np.ascontiguousarray(images[start : start + batch_size], dtype=np.float32))
            chunks.append(output(batch).numpy())
    model.train(was_training)
    return np.concatenate(chunks) if chunks else np.empty((0, 0), dtype=np.float32)
