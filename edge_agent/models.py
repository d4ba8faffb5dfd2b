# Model zoo (the paper's Table 2 CNN first) and the conversion between torch modules and named numpy weights.
from __future__ import annotations

from abc import abstractmethod
from collections.abc import Callable, Sequence
from typing import ClassVar

import numpy as np
import torch
from torch import nn

from edge_agent.tensors import Weights, WeightSpec, check_layout, spec_of

NUM_CLASSES = 10
INPUT_SHAPE = (1, 28, 28)


class SplitDropoutModel(nn.Module):
    """A model whose MC-dropout scoring is fast: a deterministic prefix run once per image, and a stochastic tail
    that takes explicit dropout masks (run r times, in torch or as the exported ONNX tail)."""

    dropout_rates: ClassVar[tuple[float, ...]]
    dropout_mask_shapes: ClassVar[tuple[tuple[int, ...], ...]]
    classifier_layer: ClassVar[str]
    """The final linear layer, fed by `penultimate` through the last dropout: what head-only training trains."""

    @abstractmethod
    def prefix(self, x: torch.Tensor) -> torch.Tensor:
        """Everything before the first dropout layer."""

    @abstractmethod
    def penultimate(self, h: torch.Tensor) -> torch.Tensor:
        """From the prefix output to the classifier's input features."""

    @abstractmethod
    def tail_with_masks(self, h: torch.Tensor, masks: Sequence[torch.Tensor]) -> torch.Tensor:
        """From the prefix output to the logits, each dropout replaced by a product with an explicit scaled mask."""

    @abstractmethod
    def features_and_logits(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(classifier-input features, logits) from one pass, so both see the same dropout masks."""


class PaperCNN(SplitDropoutModel):
    """The Table 2 network of the core paper: four convolutions, no batch norm, three dropout layers.

    It is split into a deterministic `prefix` (everything before the first dropout) and a stochastic
    `tail`, so that MC-dropout scoring can run the expensive prefix once and the cheap tail r times.
    """

    dropout_rates: ClassVar[tuple[float, ...]] = (0.25, 0.25, 0.5)
    dropout_mask_shapes: ClassVar[tuple[tuple[int, ...], ...]] = ((16, 10, 10), (16, 2, 2), (128,))
    classifier_layer: ClassVar[str] = "fc2"

    def __init__(self, num_classes: int = NUM_CLASSES) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 64, kernel_size=4)
        self.conv2 = nn.Conv2d(64, 16, kernel_size=5)
        self.conv3 = nn.Conv2d(16, 32, kernel_size=4)
        self.conv4 = nn.Conv2d(32, 16, kernel_size=4)
        self.fc1 = nn.Linear(16 * 2 * 2, 128)
        self.fc2 = nn.Linear(128, num_classes)
        self.drop1 = nn.Dropout(self.dropout_rates[0])
        self.drop2 = nn.Dropout(self.dropout_rates[1])
        self.drop3 = nn.Dropout(self.dropout_rates[2])

    def prefix(self, x: torch.Tensor) -> torch.Tensor:
        """Deterministic part: conv64, ReLU, conv16, ReLU, maxpool (about 95% of the multiply-adds)."""
        return nn.functional.max_pool2d(torch.relu(self.conv2(torch.relu(self.conv1(x)))), 2)

    def penultimate(self, h: torch.Tensor) -> torch.Tensor:
        """From the prefix output to the classifier's input features (the 128-unit layer, after dropout 3)."""
        return self._penultimate(h, None)

    def tail(self, h: torch.Tensor) -> torch.Tensor:
        """Stochastic part: from the prefix output to the logits; dropout acts here only."""
        return self.fc2(self._penultimate(h, None))

    def tail_with_masks(self, h: torch.Tensor, masks: Sequence[torch.Tensor]) -> torch.Tensor:
        """The tail with each dropout replaced by a product with an explicit, already scaled mask.

        masks[i] has shape (len(h), *dropout_mask_shapes[i]) and holds 0 or 1/(1-p_i); masks of ones give the
        deterministic (eval-mode) tail. Explicit masks make MC passes reproducible across torch and ONNX.
        """
        if len(masks) != len(self.dropout_rates):
            raise ValueError(f"tail_with_masks needs {len(self.dropout_rates)} masks, got {len(masks)}")
        return self.fc2(self._penultimate(h, masks))

    def _dropout(self, index: int, h: torch.Tensor, masks: Sequence[torch.Tensor] | None) -> torch.Tensor:
        """Dropout layer `index`: the module's own random dropout without masks, else the product with masks[index]."""
        if masks is None:
            return (self.drop1, self.drop2, self.drop3)[index](h)
        return h * masks[index]

    def _penultimate(self, h: torch.Tensor, masks: Sequence[torch.Tensor] | None) -> torch.Tensor:
        """The one layer sequence behind penultimate, tail and tail_with_masks."""
        h = self._dropout(0, h, masks)
        h = nn.functional.max_pool2d(torch.relu(self.conv4(torch.relu(self.conv3(h)))), 2)
        h = self._dropout(1, h, masks).flatten(1)
        return self._dropout(2, torch.relu(self.fc1(h)), masks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits for a batch of normalised images shaped (N, 1, 28, 28)."""
        return self.tail(self.prefix(x))

    def features_and_logits(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(penultimate features, logits) from one pass, so both see the same dropout masks (distillation)."""
        features = self.penultimate(self.prefix(x))
        return features, self.fc2(features)


MODEL_ZOO: dict[str, Callable[[], SplitDropoutModel]] = {"paper-cnn": PaperCNN}


def build_model(name: str = "paper-cnn", seed: int | None = None) -> SplitDropoutModel:
    """A fresh model from the zoo; with a seed, its initial weights are reproducible."""
    if name not in MODEL_ZOO:
        raise ValueError(f"unknown model {name!r}; known: {', '.join(sorted(MODEL_ZOO))}")
    if seed is None:
        return MODEL_ZOO[name]()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return MODEL_ZOO[name]()


def get_weights(model: nn.Module) -> Weights:
    """The model's parameters as named float32 numpy arrays (copies), in state_dict order."""
    return {name: tensor.detach().cpu().numpy().copy() for name, tensor in model.state_dict().items()}


def set_weights(model: nn.Module, weights: Weights) -> None:
    """Loads named numpy arrays into the model; names and shapes must match exactly."""
    check_layout(weight_spec(model), weights)
    state = {name: torch.from_numpy(np.ascontiguousarray(array)) for name, array in weights.items()}
    model.load_state_dict(state, strict=True)


def weight_spec(model: nn.Module) -> WeightSpec:
    """Name -> (shape, numpy dtype string) of every parameter: what a valid update must carry."""
    return spec_of(get_weights(model))
