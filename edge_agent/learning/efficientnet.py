# EfficientNet-Lite0 in the zoo: the edge variant (ReLU6, no squeeze-excite), BatchNorm folded into its convolutions.
from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from edge_agent.learning.split_model import SplitDropoutModel
from protocol.model_spec import ModelSpec

LITE0_STAGES = (
    (1, 3, 1, 1, 32, 16),
    (2, 3, 2, 6, 16, 24),
    (2, 5, 2, 6, 24, 40),
    (3, 3, 2, 6, 40, 80),
    (3, 5, 1, 6, 80, 112),
    (4, 5, 2, 6, 112, 192),
    (1, 3, 1, 6, 192, 320),
)
"""(repeats, kernel, first stride, expansion, input channels, output channels) of each stage: 16 blocks."""
STEM_CHANNELS = 32
FEATURES = 1280


def same_padding(side: int, kernel: int, stride: int) -> tuple[int, int]:
    """TensorFlow's 'SAME' padding (before, after) for one side: what the ImageNet weights were trained with."""
    total = max((-(-side // stride) - 1) * stride + kernel - side, 0)
    return total // 2, total - total // 2


class PaddedConv(nn.Module):
    """A convolution with bias (BatchNorm folded in) after a fixed 'SAME' padding for its input size."""

    def __init__(self, size: tuple[int, int], channels: tuple[int, int], kernel: int, stride: int, groups: int) -> None:
        super().__init__()
        (top, bottom), (left, right) = (same_padding(side, kernel, stride) for side in size)
        self.padding = (left, right, top, bottom)
        self.conv = nn.Conv2d(*channels, kernel, stride=stride, groups=groups, bias=True)
        self.output_size = (-(-size[0] // stride), -(-size[1] // stride))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Pad, then convolve."""
        return self.conv(nn.functional.pad(x, self.padding) if any(self.padding) else x)


class InvertedBottleneck(nn.Module):
    """MBConv without squeeze-excite: 1x1 expansion (when the ratio is not 1), depthwise kxk, 1x1 projection, and
    the identity shortcut when the shape is kept."""

    def __init__(self, size: tuple[int, int], channels: tuple[int, int], kernel: int, stride: int, ratio: int) -> None:
        super().__init__()
        wide = channels[0] * ratio
        self.expand = PaddedConv(size, (channels[0], wide), 1, 1, 1) if ratio != 1 else None
        self.depthwise = PaddedConv(size, (wide, wide), kernel, stride, wide)
        self.project = PaddedConv(self.depthwise.output_size, (wide, channels[1]), 1, 1, 1)
        self.shortcut = stride == 1 and channels[0] == channels[1]
        self.output_size = self.depthwise.output_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """expand, ReLU6, depthwise, ReLU6, project (linear), plus the input when the shortcut applies."""
        h = x if self.expand is None else nn.functional.relu6(self.expand(x))
        h = self.project(nn.functional.relu6(self.depthwise(h)))
        return h + x if self.shortcut else h


class EfficientNetLite0(SplitDropoutModel):
    """EfficientNet-Lite0 (4.65M parameters at 1000 classes): the stem, 16 blocks, the 1x1 head convolution and
    global average pooling are the deterministic prefix (1280 features); the tail is one dropout and the classifier.

    BatchNorm is folded into each convolution's weight and bias when ImageNet weights are loaded, so its statistics
    stay ImageNet's by construction and no running statistics travel or get averaged; fine-tuning a block
    ("last:N") trains its folded weights and biases, which is what BatchNorm in eval mode with a trainable affine
    would train. Without pretrained weights it starts from PyTorch's default initialisation (no normalisation:
    meant to be started from ImageNet).
    """

    default_dropout = (0.2,)
    classifier_layer = "classifier_fc"

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__(spec)
        self.stem = PaddedConv((spec.height, spec.width), (spec.channels, STEM_CHANNELS), 3, 2, 1)
        size, blocks = self.stem.output_size, []
        for repeats, kernel, stride, ratio, channels_in, channels_out in LITE0_STAGES:
            for index in range(repeats):
                first = index == 0
                block = InvertedBottleneck(
                    size, (channels_in if first else channels_out, channels_out), kernel, stride if first else 1, ratio
                )
                blocks.append(block)
                size = block.output_size
        self.blocks = nn.Sequential(*blocks)
        self.head_conv = PaddedConv(size, (LITE0_STAGES[-1][-1], FEATURES), 1, 1, 1)
        self.dropout_mask_shapes = ((FEATURES,),)
        self.classifier_fc = nn.Linear(FEATURES, spec.num_classes)

    def backbone(self, x: torch.Tensor) -> torch.Tensor:
        """Stem, blocks, head convolution, global average pooling: 1280 features."""
        h = self.blocks(nn.functional.relu6(self.stem(x)))
        return nn.functional.relu6(self.head_conv(h)).mean(dim=(2, 3))

    def _penultimate(self, h: torch.Tensor, masks: Sequence[torch.Tensor] | None) -> torch.Tensor:
        """The one dropout before the classifier."""
        return self._dropout(0, h, masks)
