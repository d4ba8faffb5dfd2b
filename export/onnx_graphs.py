# Torch -> ONNX: the deterministic prefix and the masked stochastic tail as two graphs with a dynamic batch axis.
from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import onnx
import torch
from onnx import numpy_helper
from torch import nn

from edge_agent.learning.mc_dropout import MaskedTailGraph, PenultimateGraph, PrefixGraph, as_split_model, dropout_spec
from edge_agent.learning.split_model import SplitDropoutModel
from export.graph_names import (
    DEFAULT_OPSET,
    EMBEDDINGS_OUTPUT,
    FEATURES_NAME,
    IMAGES_INPUT,
    PENULTIMATE_OUTPUT,
    PROBABILITIES_OUTPUT,
)

EXPORTER = "torch.onnx.export (TorchScript exporter, dynamo=False)"


def mask_input_names(model: nn.Module) -> tuple[str, ...]:
    """Names of the tail graph's mask inputs: mask1, mask2, ... in dropout order."""
    return tuple(f"mask{index + 1}" for index in range(len(dropout_spec(model).rates)))


def sample_images(model: SplitDropoutModel) -> torch.Tensor:
    """Two blank inputs of the model's spec shape, to trace an export with."""
    return torch.zeros(2, *model.spec.input_shape)


def _export(
    module: nn.Module, args: tuple[torch.Tensor, ...], path: Path, inputs: list[str], output: str, opset: int
) -> None:
    """Exports one module with every input's and the output's first axis dynamic.

    Devices override weights by name, so every weight must stay its own named initializer: no constant folding
    (it folds GroupNorm's weights into unnamed constants), and the export sees each weight made distinct (the
    exporter merges initializers of equal value, e.g. fresh GroupNorm scales) before the true values go back in.
    """
    dynamic_axes = {name: {0: "batch"} for name in (*inputs, output)}
    originals = {name: tensor.detach().clone() for name, tensor in module.state_dict().items()}
    with torch.no_grad():
        for index, tensor in enumerate(module.state_dict().values()):
            if tensor.is_floating_point():
                tensor.fill_(float(index + 1))
    try:
        _traced_export(module, args, path, inputs, output, opset, dynamic_axes)
    finally:
        module.load_state_dict(originals, strict=False)
    restore_initializers(path, {name: tensor.numpy() for name, tensor in originals.items()})


def restore_initializers(path: Path, values: dict[str, np.ndarray]) -> None:
    """Writes the true value of every initializer named after a weight back into an exported graph."""
    graph_model = onnx.load(str(path))
    for initializer in graph_model.graph.initializer:
        if initializer.name in values:
            initializer.CopyFrom(numpy_helper.from_array(values[initializer.name], initializer.name))
    onnx.save(graph_model, str(path))


def _traced_export(
    module: nn.Module,
    args: tuple[torch.Tensor, ...],
    path: Path,
    inputs: list[str],
    output: str,
    opset: int,
    dynamic_axes: dict[str, dict[int, str]],
) -> None:
    """torch.onnx.export with the settings every graph of a bundle shares."""
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
            do_constant_folding=False,
        )


def export_graphs(model: nn.Module, prefix_path: Path, tail_path: Path, opset: int = DEFAULT_OPSET) -> None:
    """Writes model's prefix (images -> features) and masked tail (features, masks -> probabilities) as ONNX."""
    split = as_split_model(model.eval())
    spec = dropout_spec(split)
    images = sample_images(split)
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
        features = split.prefix(sample_images(split))
    _export(PenultimateGraph(split), (features,), path, [FEATURES_NAME], PENULTIMATE_OUTPUT, opset)


class EncoderGraph(nn.Module):
    """A model's penultimate-layer features of images (dropout off): the frozen encoder FAST embeds with."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = as_split_model(model)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """Classifier-input features of images scaled to [0, 1], (N, C, H, W)."""
        return self.model.penultimate(self.model.prefix(images))


def export_encoder(model: nn.Module, path: Path, opset: int = DEFAULT_OPSET) -> None:
    """Writes the model's penultimate-layer encoder (images -> embeddings) as ONNX with a dynamic batch axis."""
    model.eval()
    _export(
        EncoderGraph(model), (sample_images(as_split_model(model)),), path, [IMAGES_INPUT], EMBEDDINGS_OUTPUT, opset
    )
