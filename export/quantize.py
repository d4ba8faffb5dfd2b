# int8 quantization of the prefix graph (static, QDQ, calibrated on images like the devices') and its check against fp32.
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static

from export.graph_names import IMAGES_INPUT

CALIBRATION_BATCH = 128
PER_CHANNEL = True
"""One weight scale per output channel: EfficientNet-Lite0's depthwise layers lose far less (ImageNet top-1
agreement with fp32 on held-out crops at 224 px: 0.50 per tensor, 0.75 per channel; docs/benchmarks/backbone_profiles)."""
BATCH_VALUES = 1 << 20
"""Input values per batch when calibrating or checking: 128 Fashion-MNIST images, 6 at 224x224 RGB (whose
activations then peak at tens of MB, not GBs)."""
METHOD = "static QDQ (uint8 activations, int8 per-channel weights) on the prefix's Conv layers; the tail stays fp32"


class _ImageBatches(CalibrationDataReader):
    """Feeds normalised calibration images to the quantizer in fixed-size batches."""

    def __init__(self, images: np.ndarray) -> None:
        self._size = images_per_batch(images)
        self._batches = iter(range(0, len(images), self._size))
        self._images = images

    def get_next(self) -> dict[str, np.ndarray] | None:
        """The next calibration batch, or None at the end."""
        start = next(self._batches, None)
        return None if start is None else {IMAGES_INPUT: self._images[start : start + self._size]}


def images_per_batch(images: np.ndarray) -> int:
    """How many of these images one batch holds: at most CALIBRATION_BATCH and BATCH_VALUES input values."""
    return max(1, min(CALIBRATION_BATCH, BATCH_VALUES // max(1, int(np.prod(images.shape[1:])))))


def quantize_prefix(fp32_path: Path, int8_path: Path, calibration_images: np.ndarray) -> None:
    """Writes an int8 copy of the prefix graph; the prefix holds about 95% of the multiply-adds."""
    if len(calibration_images) == 0:
        raise ValueError("int8 quantization needs calibration images, got none")
    quiet = logging.getLogger().level
    logging.getLogger().setLevel(logging.ERROR)
    try:
        quantize_static(
            str(fp32_path),
            str(int8_path),
            _ImageBatches(calibration_images),
            quant_format=QuantFormat.QDQ,
            activation_type=QuantType.QUInt8,
            weight_type=QuantType.QInt8,
            op_types_to_quantize=["Conv"],
            per_channel=PER_CHANNEL,
        )
    finally:
        logging.getLogger().setLevel(quiet)


def deterministic_probabilities(prefix_path: Path, tail_path: Path, mask_shapes: Any, images: np.ndarray) -> np.ndarray:
    """Class probabilities of a prefix/tail graph pair with dropout off (masks of ones), one bounded batch at a time."""
    prefix = ort.InferenceSession(str(prefix_path), providers=["CPUExecutionProvider"])
    tail = ort.InferenceSession(str(tail_path), providers=["CPUExecutionProvider"])
    names = [graph_input.name for graph_input in tail.get_inputs()]
    size, parts = images_per_batch(images), []
    for start in range(0, len(images), size):
        features = prefix.run(None, {IMAGES_INPUT: images[start : start + size]})[0]
        masks = [np.ones((len(features), *shape), dtype=np.float32) for shape in mask_shapes]
        parts.append(tail.run(None, dict(zip(names, (features, *masks))))[0])
    return np.concatenate(parts)


def int8_change(fp32: np.ndarray, int8: np.ndarray, labels: np.ndarray | None) -> dict[str, float]:
    """How the int8 prefix changes the answers on the check images: the share whose top class stays the same, the
    largest change of a class probability (its mean over images and its worst), and, when the labels are known, the accuracy before and after."""
    change = np.abs(int8 - fp32)
    found = {
        "top1_agreement": float(np.mean(fp32.argmax(axis=1) == int8.argmax(axis=1))),
        "mean_probability_change": float(change.max(axis=1).mean()),
        "max_probability_change": float(change.max()),
    }
    if labels is not None:
        before, after = (float(np.mean(p.argmax(axis=1) == labels)) for p in (fp32, int8))
        found |= {"test_accuracy_fp32": before, "test_accuracy_int8": after, "test_accuracy_change": after - before}
    return found
