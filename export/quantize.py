# int8 quantization of the prefix graph (static, QDQ, calibrated on training images) and its accuracy check.
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static

from export.graph_names import IMAGES_INPUT

CALIBRATION_BATCH = 128
METHOD = "static QDQ (uint8 activations, int8 weights) on the prefix's Conv layers; the masked tail stays fp32"


class _ImageBatches(CalibrationDataReader):
    """Feeds normalised calibration images to the quantizer in fixed-size batches."""

    def __init__(self, images: np.ndarray) -> None:
        self._batches = iter(range(0, len(images), CALIBRATION_BATCH))
        self._images = images

    def get_next(self) -> dict[str, np.ndarray] | None:
        """The next calibration batch, or None at the end."""
        start = next(self._batches, None)
        return None if start is None else {IMAGES_INPUT: self._images[start : start + CALIBRATION_BATCH]}


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
        )
    finally:
        logging.getLogger().setLevel(quiet)


def deterministic_accuracy(
    prefix_path: Path, tail_path: Path, mask_shapes: Any, images: np.ndarray, labels: np.ndarray, batch_size: int = 1000
) -> float:
    """Test accuracy of a prefix/tail graph pair with dropout off (masks of ones)."""
    prefix = ort.InferenceSession(str(prefix_path), providers=["CPUExecutionProvider"])
    tail = ort.InferenceSession(str(tail_path), providers=["CPUExecutionProvider"])
    names = [graph_input.name for graph_input in tail.get_inputs()]
    hits = 0
    for start in range(0, len(images), batch_size):
        features = prefix.run(None, {IMAGES_INPUT: images[start : start + batch_size]})[0]
        masks = [np.ones((len(features), *shape), dtype=np.float32) for shape in mask_shapes]
        probabilities = tail.run(None, dict(zip(names, (features, *masks))))[0]
        hits += int(np.sum(probabilities.argmax(axis=1) == labels[start : start + batch_size]))
    return hits / len(images)
