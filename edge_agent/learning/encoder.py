# A frozen feature encoder given as ONNX bytes (FAST's f), run with onnxruntime: uint8 images -> embeddings.
from __future__ import annotations

import hashlib

import numpy as np
import onnxruntime as ort

from edge_agent.data.image_arrays import model_input

ENCODER_BATCH = 256


def encoder_hash(onnx_bytes: bytes) -> str:
    """The sha256 hex digest that names an encoder on the wire and in the recipe."""
    return hashlib.sha256(onnx_bytes).hexdigest()


class OnnxEncoder:
    """Embeds images with a frozen ONNX graph (one input: images scaled to [0, 1], (N, C, H, W); first output used)."""

    def __init__(self, onnx_bytes: bytes, threads: int = 1) -> None:
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        try:
            self.session = ort.InferenceSession(onnx_bytes, options, providers=["CPUExecutionProvider"])
        except Exception as error:  # onnxruntime raises its own untyped errors for a bad graph
            raise ValueError(f"encoder is not a loadable ONNX graph: {error}") from None
        self.input_name = self.session.get_inputs()[0].name

    def embed(self, images: np.ndarray) -> np.ndarray:
        """(N, d) float32 embeddings of raw uint8 images, in batches."""
        chunks = [
            self.session.run(None, {self.input_name: model_input(images[start : start + ENCODER_BATCH])})[0]
            for start in range(0, len(images), ENCODER_BATCH)
        ]
        if not chunks:
            return np.zeros((0, 0), dtype=np.float32)
        return np.concatenate(chunks).reshape(len(images), -1).astype(np.float32)
