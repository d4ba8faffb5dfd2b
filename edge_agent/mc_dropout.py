# MC-dropout class probabilities: the deterministic prefix runs once per sample, the dropout tail r times.
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import numpy as np
import torch
from torch import nn


@contextmanager
def dropout_only(model: nn.Module) -> Iterator[nn.Module]:
    """Eval mode for everything except Dropout layers, restored afterwards: a Bayesian approximation (Alg. 6)."""
    modes = {module: module.training for module in model.modules()}
    model.eval()
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.train()
    try:
        yield model
    finally:
        for module, mode in modes.items():
            module.train(mode)


class TorchMCDropout:
    """Torch back end: probabilities of r stochastic passes, shaped (r, N, C), reproducible for a seed.

    Only the layers after the first dropout are repeated, on a batch replicated r times, which cuts the work
    of the paper CNN from r full passes to one prefix plus r cheap tails per image.
    """

    name = "torch"

    def __init__(self, model: nn.Module, batch_size: int = 256) -> None:
        self.model = model
        self.batch_size = batch_size

    def probabilities(self, images: np.ndarray, passes: int, seed: int) -> np.ndarray:
        """MC-dropout softmax outputs for normalised images (N, 1, 28, 28) over `passes` passes."""
        if passes < 1:
            raise ValueError(f"MC passes must be at least 1, got {passes}")
        count = len(images)
        inputs = torch.from_numpy(np.ascontiguousarray(images, dtype=np.float32))
        chunks = [np.empty((passes, 0, 0), dtype=np.float32)]
        with torch.random.fork_rng(devices=[]), torch.inference_mode(), dropout_only(self.model):
            torch.manual_seed(seed)
            for start in range(0, count, self.batch_size):
                prefix = self.model.prefix(inputs[start:start + self.batch_size])
                replicated = prefix.repeat(passes, 1, 1, 1)
                logits = self.model.tail(replicated).reshape(passes, len(prefix), -1)
                chunks.append(torch.softmax(logits, dim=-1).numpy())
        return np.concatenate(chunks[1:], axis=1) if count else chunks[0]


def predict_probabilities(model: nn.Module, images: np.ndarray, batch_size: int = 1000) -> np.ndarray:
    """Deterministic softmax outputs (dropout off), shaped (N, C): what a plain evaluation uses."""
    was_training = model.training
    model.eval()
    chunks = []
    with torch.inference_mode():
        for start in range(0, len(images), batch_size):
            batch = torch.from_numpy(np.ascontiguousarray(images[start:start + batch_size], dtype=np.float32))
            chunks.append(torch.softmax(model(batch), dim=-1).numpy())
    model.train(was_training)
    return np.concatenate(chunks) if chunks else np.empty((0, 0), dtype=np.float32)
