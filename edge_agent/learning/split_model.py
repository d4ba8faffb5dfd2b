# The split every zoo model shares: standardisation and a deterministic prefix, then a tail that takes dropout masks.
from __future__ import annotations

from abc import abstractmethod
from collections.abc import Sequence

import torch
from torch import nn

from protocol.model_spec import ModelSpec


class SplitDropoutModel(nn.Module):
    """A model whose MC-dropout scoring is fast: a deterministic prefix run once per image, and a stochastic tail
    that takes explicit dropout masks (run r times, in torch or as the exported ONNX tail).

    Inputs are pixels scaled to [0, 1]; the prefix standardises them with the spec's per-channel mean and std
    (non-persistent buffers: they never travel as weights), so no caller needs to know a dataset's statistics.
    """

    default_dropout: tuple[float, ...]
    classifier_layer: str
    input_mean: torch.Tensor
    input_std: torch.Tensor
    """The final linear layer, fed by `penultimate` through the last dropout: what head-only training trains."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.spec = spec
        self.dropout_rates = tuple(spec.dropout) or self.default_dropout
        self.dropout_mask_shapes: tuple[tuple[int, ...], ...] = ()
        self.dropouts = nn.ModuleList(nn.Dropout(rate) for rate in self.dropout_rates)
        self.register_buffer("input_mean", torch.tensor(spec.mean).view(1, -1, 1, 1), persistent=False)
        self.register_buffer("input_std", torch.tensor(spec.std).view(1, -1, 1, 1), persistent=False)

    def standardise(self, x: torch.Tensor) -> torch.Tensor:
        """(x - mean) / std per channel, for inputs scaled to [0, 1]."""
        return (x - self.input_mean) / self.input_std

    def prefix(self, x: torch.Tensor) -> torch.Tensor:
        """Everything before the first dropout layer (standardisation included)."""
        return self.backbone(self.standardise(x))

    @abstractmethod
    def backbone(self, x: torch.Tensor) -> torch.Tensor:
        """The deterministic layers after standardisation."""

    @abstractmethod
    def _penultimate(self, h: torch.Tensor, masks: Sequence[torch.Tensor] | None) -> torch.Tensor:
        """From the prefix output to the classifier's input, through every dropout (masks None: random dropout)."""

    def classifier(self) -> nn.Linear:
        """The final linear layer."""
        layer = getattr(self, self.classifier_layer)
        assert isinstance(layer, nn.Linear)
        return layer

    def penultimate(self, h: torch.Tensor) -> torch.Tensor:
        """From the prefix output to the classifier's input features (after the last dropout)."""
        return self._penultimate(h, None)

    def tail(self, h: torch.Tensor) -> torch.Tensor:
        """Stochastic part: from the prefix output to the logits; dropout acts here only."""
        return self.classifier()(self._penultimate(h, None))

    def tail_with_masks(self, h: torch.Tensor, masks: Sequence[torch.Tensor]) -> torch.Tensor:
        """The tail with each dropout replaced by a product with an explicit, already scaled mask.

        masks[i] has shape (len(h), *dropout_mask_shapes[i]) and holds 0 or 1/(1-p_i); masks of ones give the
        deterministic (eval-mode) tail. Explicit masks make MC passes reproducible across torch and ONNX.
        """
        if len(masks) != len(self.dropout_rates):
            raise ValueError(f"tail_with_masks needs {len(self.dropout_rates)} masks, got {len(masks)}")
        return self.classifier()(self._penultimate(h, masks))

    def _dropout(self, index: int, h: torch.Tensor, masks: Sequence[torch.Tensor] | None) -> torch.Tensor:
        """Dropout layer `index`: the module's own random dropout without masks, else the product with masks[index]."""
        return self.dropouts[index](h) if masks is None else h * masks[index]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits for a batch of images scaled to [0, 1], shaped (N, C, H, W)."""
        return self.tail(self.prefix(x))

    def features_and_logits(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(penultimate features, logits) from one pass, so both see the same dropout masks (distillation)."""
        features = self.penultimate(self.prefix(x))
        return features, self.classifier()(features)
