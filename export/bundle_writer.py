# Writes a model bundle: fp32 (and optionally int8) ONNX graphs, the weights, and a manifest with every hash.
from __future__ import annotations

import json
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import torch

from edge_agent.learning.bundle import (
    MANIFEST_NAME,
    BundleError,
    bundle_files,
    file_sha256,
    load_bundle,
)
from edge_agent.learning.mc_dropout import dropout_spec
from edge_agent.learning.models import build_model, set_weights
from edge_agent.learning.split_model import SplitDropoutModel
from export import quantize
from export.graph_names import DEFAULT_OPSET, FEATURES_NAME, IMAGES_INPUT, PENULTIMATE_OUTPUT, PROBABILITIES_OUTPUT
from export.onnx_graphs import EXPORTER, export_graphs, export_penultimate, mask_input_names
from protocol.backbone import frozen_prefix
from protocol.errors import UsageError
from protocol.files import atomic_write_bytes, save_arrays
from protocol.manifest import PIXEL_INPUT, BundleManifest, DropoutSection, HeadSection, weight_of_initializer
from protocol.model_spec import DEFAULT_SPEC, ModelSpec
from protocol.tensors import Weights, weights_hash

WEIGHTS_FILE = "weights.npz"
FP32_GRAPHS = {"prefix": "prefix.onnx", "tail": "tail.onnx"}
INT8_GRAPHS = {"prefix": "prefix.int8.onnx", "tail": "tail.onnx"}
PENULTIMATE_GRAPH = "penultimate.onnx"


@dataclass(frozen=True)
class Int8Data:
    """What an int8 prefix is calibrated and checked on: calibration images and held-out check images (float32
    pixel / 255, (N, C, H, W)), and the check images' labels when known (accuracy then joins the agreement)."""

    calibration: np.ndarray
    check: np.ndarray
    labels: np.ndarray | None = None
    held_out: bool = True
    """False when the check images are the calibration images (a folder of a single image)."""


def _int8_section(work: Path, data: Int8Data, mask_shapes: Any) -> dict[str, Any]:
    """Quantizes the prefix and returns the manifest's record of the method and how int8 changes the answers."""
    quantize.quantize_prefix(work / FP32_GRAPHS["prefix"], work / INT8_GRAPHS["prefix"], data.calibration)
    fp32, int8 = (
        quantize.deterministic_probabilities(work / graphs["prefix"], work / graphs["tail"], mask_shapes, data.check)
        for graphs in (FP32_GRAPHS, INT8_GRAPHS)
    )
    return {
        "method": quantize.METHOD,
        "calibration_images": len(data.calibration),
        "check_images": len(data.check),
        "check_held_out": data.held_out,
        **quantize.int8_change(fp32, int8, data.labels),
    }


def initializer_map(graph_path: Path, weights: Weights) -> dict[str, str]:
    """Which model weight each initializer of an ONNX graph holds (the exporter names them `model.<weight>`);
    other initializers are the graph's constants (e.g. the spec's mean and std) and stay as they are.

    A device scoring its locally trained model overrides these initializers with its own weights, so the
    graph shipped once per round also serves every later acquisition of that round.
    """
    graph = onnx.load(str(graph_path)).graph
    held = {init.name: weight_of_initializer(init.name) for init in graph.initializer}
    return {name: weight for name, weight in held.items() if weight is not None and weight in weights}


def _check_every_weight_mapped(initializers: dict[str, dict[str, str]], weights: Weights) -> None:
    """Every weight must be an initializer of exactly one fp32 graph, or overriding would leave some stale."""
    mapped = [weight for part in initializers.values() for weight in part.values()]
    if sorted(mapped) != sorted(weights):
        raise ValueError(f"fp32 graphs hold weights {sorted(mapped)}, the model has {sorted(weights)}")


def write_bundle(
    weights: Weights,
    out_dir: Path,
    spec: ModelSpec = DEFAULT_SPEC,
    opset: int = DEFAULT_OPSET,
    int8_data: Int8Data | None = None,
) -> BundleManifest:
    """Exports weights as a bundle in out_dir (created; must not hold a bundle yet) and returns its manifest.

    int8_data adds the int8 prefix, calibrated and checked on its images.
    Files go to a temporary folder first, so a failed export leaves no half bundle behind.
    """
    out_dir = Path(out_dir)
    if (out_dir / MANIFEST_NAME).exists():
        raise UsageError(f"{out_dir} already holds a bundle; choose another --out")
    model = build_model(spec)
    set_weights(model, weights)
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out_dir, prefix=".export-") as temp:
        work = Path(temp)
        manifest = write_files(model, weights, work, opset, int8_data)
        for name in manifest.files:
            shutil.move(str(work / name), out_dir / name)
    atomic_write_bytes(out_dir / MANIFEST_NAME, (json.dumps(manifest.to_json(), indent=2) + "\n").encode())
    return manifest


def write_files(
    model: SplitDropoutModel,
    weights: Weights,
    work: Path,
    opset: int,
    int8_data: Int8Data | None,
) -> BundleManifest:
    """Writes the graphs and weights into `work`, checks them, and returns the manifest that lists them.

    A frozen prefix's weights stay out of the weights file: its graph holds them (the backbone a device keeps)."""
    export_graphs(model, work / FP32_GRAPHS["prefix"], work / FP32_GRAPHS["tail"], opset)
    export_penultimate(model, work / PENULTIMATE_GRAPH, opset)
    initializers = {part: initializer_map(work / name, weights) for part, name in FP32_GRAPHS.items()}
    _check_every_weight_mapped(initializers, weights)
    held = frozen_prefix(model.spec, initializers["prefix"].values())
    save_arrays(work / WEIGHTS_FILE, {name: array for name, array in weights.items() if name not in held})
    graphs = {"fp32": FP32_GRAPHS}
    quantization = None
    if int8_data is not None:
        quantization = _int8_section(work, int8_data, dropout_spec(model).mask_shapes)
        graphs["int8"] = INT8_GRAPHS
    names = sorted({WEIGHTS_FILE, PENULTIMATE_GRAPH, *(name for parts in graphs.values() for name in parts.values())})
    for name in (name for name in names if name.endswith(".onnx")):
        onnx.checker.check_model(str(work / name))
    files = {name: file_sha256(work / name) for name in names}
    return manifest_for(model, weights, graphs, initializers, files, opset, quantization)


def manifest_for(
    model: SplitDropoutModel,
    weights: Weights,
    graphs: dict[str, dict[str, str]],
    initializers: dict[str, dict[str, str]],
    files: dict[str, str],
    opset: int,
    quantization: dict[str, Any] | None,
) -> BundleManifest:
    """The manifest of a bundle whose files are written and hashed: input, normalisation, graphs, dropout masks."""
    spec = dropout_spec(model)
    return BundleManifest(
        model=model.spec.architecture,
        input_name=IMAGES_INPUT,
        input_shape=list(model.spec.input_shape),
        normalisation=PIXEL_INPUT,
        class_names=list(model.spec.class_names),
        weights_hash=weights_hash(weights),
        weights_file=WEIGHTS_FILE,
        graphs=graphs,
        outputs={"prefix": FEATURES_NAME, "tail": PROBABILITIES_OUTPUT},
        initializers=initializers,
        files=files,
        opset=opset,
        exporter={"tool": EXPORTER, "torch": torch.__version__, "onnx": onnx.__version__},
        dropout=DropoutSection(
            [float(rate) for rate in spec.rates], list(mask_input_names(model)), [list(s) for s in spec.mask_shapes]
        ),
        spec=model.spec,
        quantization=quantization,
        head=head_section(model),
    )


def head_section(model: SplitDropoutModel) -> HeadSection:
    """The manifest's head section: the penultimate graph and the classifier a head-only device trains."""
    layer = model.classifier_layer
    rate = float(dropout_spec(model).rates[-1])
    return HeadSection(PENULTIMATE_GRAPH, FEATURES_NAME, PENULTIMATE_OUTPUT, f"{layer}.weight", f"{layer}.bias", rate)


def ensure_bundle_files(weights: Weights, out_dir: Path, spec: ModelSpec = DEFAULT_SPEC) -> dict[str, bytes]:
    """The files of weights' fp32 bundle in out_dir, exported first unless a valid one is already there.

    The coordinator calls this once per global model to ship the bundle beside the weights.
    """
    out_dir = Path(out_dir)
    if not (out_dir / MANIFEST_NAME).exists():
        write_bundle(weights, out_dir, spec)
    bundle = load_bundle(out_dir)
    if bundle.manifest.weights_hash != weights_hash(weights):
        raise BundleError(
            f"{out_dir / MANIFEST_NAME}: holds weights {bundle.manifest.weights_hash[:12]}, "
            f"expected {weights_hash(weights)[:12]}"
        )
    return bundle_files(bundle)
