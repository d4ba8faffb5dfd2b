# Torch -> ONNX: the deterministic prefix and the masked stochastic tail as two graphs with a dynamic batch axis.
from __future__ import annotations

import warnings
from pathlib import Path

import torch
from torch import nn

from edge_agent.mc_dropout import MaskedTailGraph, PenultimateGraph, PrefixGraph, as_split_model, dropout_spec

DEFAULT_OPSET = 17
IMAGES_INPUT = "images"
FEATURES_NAME = "features"
PROBABILITIES_OUTPUT = "probabilities"
PENULTIMATE_OUTPUT = "penultimate"
EMBEDDINGS_OUTPUT = "embeddings"
EXPORTER = "torch.onnx.export (TorchScript exporter, dynamo=False)"


def mask_input_names(model: nn.Module) -> tuple[str, ...]:
    """Names of the tail graph's mask inputs: mask1, mask2, ... in dropout order."""
    return tuple(f"mask{index + 1}" for index in range(len(dropout_spec(model).rates)))


def _export(
    module: nn.Module, args: tuple[torch.Tensor, ...], path: Path, inputs: list[str], output: str, opset: int
) -> None:
    """Exports one module with every input's and the output's first axis dynamic."""
    dynamic_axes = {name: {0: "batch"} for name in (*inputs, output)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            module,
            args,
            str(path),
            input_names=inputs,
            output_names=[output],
            opset_version=opset,
            dynamic_axes=dynamic_axes,
            dynamo=False,
        )


def export_graphs(model: nn.Module, prefix_path: Path, tail_path: Path, opset: int = DEFAULT_OPSET) -> None:
    """Writes model's prefix (images -> features) and masked tail (features, masks -> probabilities) as ONNX."""
    split = as_split_model(model.eval())
    spec = dropout_spec(split)
    images = torch.zeros(2, 1, 28, 28)
    with torch.no_grad():
        features = split.prefix(images)
    masks = tuple(torch.ones(2, *shape) for shape in spec.mask_shapes)
    _export(PrefixGraph(split), (images,), prefix_path, [IMAGES_INPUT], FEATURES_NAME, opset)
    _export(
        MaskedTailGraph(split),
        (features, *masks),
        tail_path,
        [FEATURES_NAME, *mask_input_names(model)],
        PROBABILITIES_OUTPUT,
        opset,
    )


def export_penultimate(model: nn.Module, path: Path, opset: int = DEFAULT_OPSET) -> None:
    """Writes the graph from prefix features to the classifier's input features (dropout off) as ONNX."""
    split = as_split_model(model.eval())
    with torch.no_grad():
        features = split.prefix(torch.zeros(2, 1, 28, 28))
    _export(PenultimateGraph(split), (features,), path, [FEATURES_NAME], PENULTIMATE_OUTPUT, opset)


class EncoderGraph(nn.Module):
    """A model's penultimate-layer features of images (dropout off): the frozen encoder FAST embeds with."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = as_split_model(model)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """Classifier-input features of normalised images (N, 1, 28, 28)."""
        return self.model.penultimate(self.model.prefix(images))


def export_encoder(model: nn.Module, path: Path, opset: int = DEFAULT_OPSET) -> None:
    """Writes the model's penultimate-layer encoder (images -> embeddings) as ONNX with a dynamic batch axis."""
    model.eval()
    _export(EncoderGraph(model), (torch.zeros(2, 1, 28, 28),), path, [IMAGES_INPUT], EMBEDDINGS_OUTPUT, opset)
