# The fl-export command line: a weights .npz -> a verified model bundle for devices (run directories: fl-coordinator export).
from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from edge_agent.data.fashion_mnist import load_fashion_mnist
from edge_agent.data.image_arrays import model_input
from edge_agent.learning.bundle import load_bundle
from edge_agent.learning.models import build_model, weight_spec
from export.bundle_writer import write_bundle
from export.graph_names import DEFAULT_OPSET
from protocol.commands import reported
from protocol.errors import UsageError
from protocol.files import load_arrays
from protocol.model_spec import DEFAULT_SPEC, ModelSpec, load_model_spec
from protocol.tensors import Weights, check_layout

CALIBRATION_IMAGES = 512


def add_bundle_options(parser: argparse.ArgumentParser) -> None:
    """Where the bundle goes and what it holds: shared by fl-export and fl-coordinator export."""
    parser.add_argument("--out", type=Path, required=True, help="bundle folder to create")
    parser.add_argument(
        "--model-spec", type=Path, help="TOML model spec of the weights (default: the run's, else the paper CNN)"
    )
    parser.add_argument("--opset", type=int, default=DEFAULT_OPSET)
    parser.add_argument("--int8", action="store_true", help="also write an int8 prefix and print its accuracy change")
    parser.add_argument("--data-dir", type=Path, help="Fashion-MNIST files for int8 calibration and the test check")


def build_parser() -> argparse.ArgumentParser:
    """Arguments of fl-export."""
    parser = argparse.ArgumentParser(
        prog="fl-export", description="Export a model as an ONNX bundle that keeps MC dropout (explicit mask inputs)."
    )
    parser.add_argument("--weights", type=Path, required=True, help="a weights .npz (named float32 arrays)")
    add_bundle_options(parser)
    return parser


def export_weights(weights: Weights, origin: str, args: argparse.Namespace, spec: ModelSpec = DEFAULT_SPEC) -> None:
    """Writes and verifies the bundle of `weights` (int8 prefix too with --int8) and prints what was written;
    --model-spec, when given, overrides `spec`."""
    spec = load_model_spec(args.model_spec).spec if args.model_spec else spec
    int8_data = None
    if args.int8 and spec != DEFAULT_SPEC:
        raise UsageError("--int8 calibrates on Fashion-MNIST, so it needs the default model spec")
    if args.int8:
        dataset = load_fashion_mnist(args.data_dir)
        int8_data = (
            model_input(dataset.train_images[:CALIBRATION_IMAGES]),
            model_input(dataset.test_images),
            dataset.test_labels.astype(np.int64),
        )
    manifest = write_bundle(weights, args.out, spec, args.opset, int8_data)
    load_bundle(args.out)
    print(f"exported {origin} (weights {manifest.weights_hash[:16]}) to {args.out}")
    quantization = manifest.quantization
    if quantization:
        print(
            f"int8 prefix: test accuracy {quantization['test_accuracy_fp32']:.4f} -> "
            f"{quantization['test_accuracy_int8']:.4f} ({quantization['test_accuracy_change']:+.4f})"
        )


def main(argv: list[str] | None = None) -> int:
    """Entry point of the fl-export console script."""
    args = build_parser().parse_args(argv)
    return reported("fl-export", lambda: export_file(args))


def export_file(args: argparse.Namespace) -> int:
    """Exports the bundle of the weights file the command line names; weights that do not fit the spec's model are
    the person's mistake (one line), checked before anything is written."""
    if not args.weights.is_file():
        raise UsageError(f"weights file {args.weights} does not exist")
    weights = load_arrays(args.weights)
    spec = load_model_spec(args.model_spec).spec if args.model_spec else DEFAULT_SPEC
    try:
        check_layout(weight_spec(build_model(spec)), weights)
    except ValueError as error:
        raise UsageError(f"{args.weights}: {error}") from None
    export_weights(weights, str(args.weights), args, spec)
    return 0
