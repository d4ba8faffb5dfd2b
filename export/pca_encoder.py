# A frozen encoder that needs no download and no label: PCA of unlabelled images, written as a two-node ONNX graph.
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from export.graph_names import DEFAULT_OPSET, EMBEDDINGS_OUTPUT, IMAGES_INPUT
from protocol.errors import UsageError

PCA_IR_VERSION = 8  # what onnxruntime builds back to 1.14 read
MAX_FIT_IMAGES = 10_000


@dataclass(frozen=True)
class PcaBasis:
    """The mean image (D,) and the top principal directions (K, D, orthonormal rows) of flattened model inputs,
    with the share of the fitted images' variance those directions hold."""

    mean: np.ndarray
    components: np.ndarray
    explained: float

    def embed(self, inputs: np.ndarray) -> np.ndarray:
        """(N, K) coordinates of float (N, C, H, W) model inputs along the components: what the ONNX graph computes."""
        flat = np.asarray(inputs, dtype=np.float32).reshape(len(inputs), -1)
        return (flat - self.mean) @ self.components.T


def fit_pca(inputs: np.ndarray, dimensions: int, fit_images: int = MAX_FIT_IMAGES, seed: int = 0) -> PcaBasis:
    """PCA of float (N, C, H, W) model inputs over a seeded draw of at most `fit_images` of them.

    The sign of each direction is fixed (its largest-magnitude entry positive), so the same images give the same
    encoder bytes. ValueError for fewer than two images or a dimension outside 1..min(N, pixels)."""
    if len(inputs) > fit_images:
        inputs = inputs[np.sort(np.random.default_rng(seed).choice(len(inputs), fit_images, replace=False))]
    flat = np.asarray(inputs, dtype=np.float64).reshape(len(inputs), -1)
    if len(flat) < 2:
        raise UsageError(f"PCA needs at least 2 images, got {len(flat)}")
    if not 1 <= dimensions <= min(len(flat), flat.shape[1]):
        raise UsageError(
            f"PCA dimensions must be in 1..{min(len(flat), flat.shape[1])} for {len(flat)} images of "
            f"{flat.shape[1]} values, got {dimensions}"
        )
    mean = flat.mean(axis=0)
    _, singular, directions = np.linalg.svd(flat - mean, full_matrices=False)
    components = directions[:dimensions]
    signs = np.sign(components[np.arange(dimensions), np.argmax(np.abs(components), axis=1)])
    variance = singular**2
    explained = float(variance[:dimensions].sum() / variance.sum()) if variance.sum() > 0 else 1.0
    return PcaBasis(mean.astype(np.float32), (components * signs[:, None]).astype(np.float32), explained)


def pca_encoder_onnx(basis: PcaBasis, input_shape: tuple[int, ...]) -> bytes:
    """The ONNX graph images (N, C, H, W) in [0, 1] -> embeddings (N, K) = (flatten(x) - mean) @ components^T,
    with a dynamic batch axis: what `OnnxEncoder` and FAST's devices run."""
    pixels = int(np.prod(input_shape))
    if basis.mean.shape != (pixels,):
        raise ValueError(f"the basis was fitted on {basis.mean.size} values per image, the input has {pixels}")
    graph = helper.make_graph(
        [
            helper.make_node("Flatten", [IMAGES_INPUT], ["flat"], axis=1),
            helper.make_node("Sub", ["flat", "pca_mean"], ["centred"]),
            helper.make_node("MatMul", ["centred", "pca_directions"], [EMBEDDINGS_OUTPUT]),
        ],
        "pca_encoder",
        [helper.make_tensor_value_info(IMAGES_INPUT, TensorProto.FLOAT, ["batch", *input_shape])],
        [helper.make_tensor_value_info(EMBEDDINGS_OUTPUT, TensorProto.FLOAT, ["batch", len(basis.components)])],
        [
            numpy_helper.from_array(basis.mean, "pca_mean"),
            numpy_helper.from_array(np.ascontiguousarray(basis.components.T), "pca_directions"),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", DEFAULT_OPSET)], producer_name="edge-fal")
    model.ir_version = PCA_IR_VERSION
    onnx.checker.check_model(model)
    return model.SerializeToString()
