# Model zoo (the paper's Table 2 CNN, a small RGB CNN, a MobileNet-style network, EfficientNet-Lite0), built from a
# ModelSpec, and the conversion between torch modules and named numpy weights.
from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch
from torch import nn

from edge_agent.learning.efficientnet import EfficientNetLite0
from edge_agent.learning.split_model import SplitDropoutModel
from protocol.model_spec import DEFAULT_SPEC, ModelSpec, trainable_names
from protocol.tensors import Weights, WeightSpec, check_layout, spec_of


def scaled(channels: int, spec: ModelSpec) -> int:
    """A layer width under the spec's width multiplier (at least 8)."""
    return max(8, round(channels * spec.width_multiplier))


class PaperCNN(SplitDropoutModel):
    """The Table 2 network of the core paper: four convolutions, no batch norm, three dropout layers (28x28 input).

    The prefix (conv64, ReLU, conv16, ReLU, maxpool) holds about 95% of the multiply-adds.
    """

    default_dropout = (0.25, 0.25, 0.5)
    classifier_layer = "fc2"

    def __init__(self, spec: ModelSpec = DEFAULT_SPEC) -> None:
        super().__init__(spec)
        self.dropout_mask_shapes = ((16, 10, 10), (16, 2, 2), (128,))
        self.conv1 = nn.Conv2d(spec.channels, 64, kernel_size=4)
        self.conv2 = nn.Conv2d(64, 16, kernel_size=5)
        self.conv3 = nn.Conv2d(16, 32, kernel_size=4)
        self.conv4 = nn.Conv2d(32, 16, kernel_size=4)
        self.fc1 = nn.Linear(16 * 2 * 2, 128)
        self.fc2 = nn.Linear(128, spec.num_classes)

    def backbone(self, x: torch.Tensor) -> torch.Tensor:
        """conv64, ReLU, conv16, ReLU, maxpool."""
        return nn.functional.max_pool2d(torch.relu(self.conv2(torch.relu(self.conv1(x)))), 2)

    def _penultimate(self, h: torch.Tensor, masks: Sequence[torch.Tensor] | None) -> torch.Tensor:
        """dropout, conv32, ReLU, conv16, ReLU, maxpool, dropout, fc128, ReLU, dropout."""
        h = self._dropout(0, h, masks)
        h = nn.functional.max_pool2d(torch.relu(self.conv4(torch.relu(self.conv3(h)))), 2)
        h = self._dropout(1, h, masks).flatten(1)
        return self._dropout(2, torch.relu(self.fc1(h)), masks)


class RgbCNN(SplitDropoutModel):
    """A small CNN for colour images of 32-96 px: three 3x3 convolutions with two poolings in the prefix, a
    dropout, a fourth convolution and global average pooling, a 128-unit layer, a dropout and the classifier."""

    default_dropout = (0.25, 0.5)
    classifier_layer = "fc2"

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__(spec)
        wide, wider = scaled(32, spec), scaled(64, spec)
        self.dropout_mask_shapes = ((wider, spec.height // 4, spec.width // 4), (128,))
        self.conv1 = nn.Conv2d(spec.channels, wide, kernel_size=3, padding=1)
        self.conv2 = nn.Conv2d(wide, wide, kernel_size=3, padding=1)
        self.conv3 = nn.Conv2d(wide, wider, kernel_size=3, padding=1)
        self.conv4 = nn.Conv2d(wider, wider, kernel_size=3, padding=1)
        self.fc1 = nn.Linear(wider, 128)
        self.fc2 = nn.Linear(128, spec.num_classes)

    def backbone(self, x: torch.Tensor) -> torch.Tensor:
        """conv, ReLU, conv, ReLU, maxpool, conv, ReLU, maxpool."""
        h = nn.functional.max_pool2d(torch.relu(self.conv2(torch.relu(self.conv1(x)))), 2)
        return nn.functional.max_pool2d(torch.relu(self.conv3(h)), 2)

    def _penultimate(self, h: torch.Tensor, masks: Sequence[torch.Tensor] | None) -> torch.Tensor:
        """dropout, conv, ReLU, global average pool, fc128, ReLU, dropout."""
        h = torch.relu(self.conv4(self._dropout(0, h, masks))).mean(dim=(2, 3))
        return self._dropout(1, torch.relu(self.fc1(h)), masks)


MOBILENET_BLOCKS = (
    ((64, 1), (128, 2), (128, 1), (256, 2), (256, 1), (512, 2)) + ((512, 1),) * 5 + ((1024, 2), (1024, 1))
)
"""(output channels, stride) of each depthwise-separable block after the stem: MobileNet v1's thirteen."""


def separable_block(channels_in: int, channels_out: int, stride: int) -> nn.Sequential:
    """Depthwise 3x3 and pointwise 1x1 convolutions, each with GroupNorm and ReLU6.

    GroupNorm, not BatchNorm: no running statistics to average across devices (Hsieh et al., ICML 2020)."""
    return nn.Sequential(
        nn.Conv2d(channels_in, channels_in, 3, stride=stride, padding=1, groups=channels_in, bias=False),
        nn.GroupNorm(min(8, channels_in), channels_in),
        nn.ReLU6(),
        nn.Conv2d(channels_in, channels_out, 1, bias=False),
        nn.GroupNorm(min(8, channels_out), channels_out),
        nn.ReLU6(),
    )


class MobileNet(SplitDropoutModel):
    """A MobileNet-style network for 96-224 px: a strided stem, depthwise-separable blocks and global average
    pooling in the prefix; the tail is one dropout and the classifier, so MC-dropout passes cost almost nothing."""

    default_dropout = (0.2,)
    classifier_layer = "classifier_fc"

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__(spec)
        stem = scaled(32, spec)
        self.stem = nn.Sequential(
            nn.Conv2d(spec.channels, stem, 3, stride=2, padding=1, bias=False), nn.GroupNorm(8, stem), nn.ReLU6()
        )
        widths = [stem] + [scaled(channels, spec) for channels, _ in MOBILENET_BLOCKS]
        strides = [stride for _, stride in MOBILENET_BLOCKS]
        self.blocks = nn.Sequential(*(separable_block(a, b, s) for a, b, s in zip(widths, widths[1:], strides)))
        self.dropout_mask_shapes = ((widths[-1],),)
        self.classifier_fc = nn.Linear(widths[-1], spec.num_classes)

    def backbone(self, x: torch.Tensor) -> torch.Tensor:
        """Stem, blocks, global average pooling."""
        return self.blocks(self.stem(x)).mean(dim=(2, 3))

    def _penultimate(self, h: torch.Tensor, masks: Sequence[torch.Tensor] | None) -> torch.Tensor:
        """The one dropout before the classifier."""
        return self._dropout(0, h, masks)


MODEL_ZOO: dict[str, Callable[[ModelSpec], SplitDropoutModel]] = {
    "paper-cnn": PaperCNN,
    "rgb-cnn": RgbCNN,
    "mobilenet": MobileNet,
    "efficientnet-lite0": EfficientNetLite0,
}


def build_model(spec: ModelSpec = DEFAULT_SPEC, seed: int | None = None) -> SplitDropoutModel:
    """A fresh model of the spec's architecture; with a seed, its initial weights are reproducible. Every parameter
    the spec does not train (`trainable_names`) is frozen."""
    if spec.architecture not in MODEL_ZOO:
        raise ValueError(f"unknown model {spec.architecture[:40]!r}; known: {', '.join(sorted(MODEL_ZOO))}")
    with torch.random.fork_rng(devices=[], enabled=seed is not None):
        if seed is not None:
            torch.manual_seed(seed)
        model = MODEL_ZOO[spec.architecture](spec)
    trained = set(trainable_names(spec, (name for name, _ in model.named_parameters())))
    for name, parameter in model.named_parameters():
        parameter.requires_grad_(name in trained)
    return model


def get_weights(model: nn.Module) -> Weights:
    """The model's parameters as named float32 numpy arrays (copies), in state_dict order."""
    return {name: tensor.detach().cpu().numpy().copy() for name, tensor in model.state_dict().items()}


def set_weights(model: nn.Module, weights: Weights) -> None:
    """Copies named numpy arrays into the model's parameters and buffers (read-only views of a decoded message
    too: nothing keeps them); names, shapes and dtypes must match exactly."""
    check_layout(weight_spec(model), weights)
    for name, tensor in model.state_dict().items():
        np.copyto(tensor.numpy(), weights[name])


def weight_spec(model: nn.Module) -> WeightSpec:
    """Name -> (shape, numpy dtype string) of every parameter: what a valid update must carry."""
    return spec_of(get_weights(model))
