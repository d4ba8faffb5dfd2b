# The fl-export command line: a run's checkpoint (or a weights .npz) -> a verified model bundle for devices.
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

from coordinator.store import RunStore
from edge_agent.bundle import load_bundle
from edge_agent.data import DatasetMissingError, load_arrays, load_fashion_mnist, normalise
from edge_agent.tensors import Weights
from export.bundle_writer import write_bundle
from export.onnx_graphs import DEFAULT_OPSET

CALIBRATION_IMAGES = 512


def build_parser() -> argparse.ArgumentParser:
    """Arguments of fl-export."""
    parser = argparse.ArgumentParser(
        prog="fl-export", description="Export a model as an ONNX bundle that keeps MC dropout (explicit mask inputs)."
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--run-dir", type=Path, help="a coordinator run directory (its checkpoints)")
    source.add_argument("--weights", type=Path, help="a weights .npz (named float32 arrays)")
    parser.add_argument("--round", type=int, help="checkpoint round to export (default: the latest)")
    parser.add_argument("--out", type=Path, required=True, help="bundle folder to create")
    parser.add_argument("--model", default="paper-cnn")
    parser.add_argument("--opset", type=int, default=DEFAULT_OPSET)
    parser.add_argument("--int8", action="store_true", help="also write an int8 prefix and print its accuracy change")
    parser.add_argument("--data-dir", type=Path, help="Fashion-MNIST files for int8 calibration and the test check")
    return parser


def load_source_weights(args: argparse.Namespace) -> tuple[Weights, str]:
    """The weights to export and a description of where they came from."""
    if args.weights is not None:
        if args.round is not None:
            raise ValueError("--round applies to --run-dir only")
        if not args.weights.is_file():
            raise FileNotFoundError(f"weights file {args.weights} does not exist")
        return load_arrays(args.weights), str(args.weights)
    if not (args.run_dir / "run.sqlite").is_file():
        raise FileNotFoundError(f"{args.run_dir} is not a run directory (no run.sqlite)")
    with RunStore(args.run_dir) as store:
        round_id = store.latest_checkpoint_round() if args.round is None else args.round
        if round_id is None:
            raise FileNotFoundError(f"{args.run_dir} holds no checkpoints yet")
        return store.load_checkpoint(round_id), f"{args.run_dir} round {round_id}"


def main(argv: list[str] | None = None) -> int:
    """Entry point of the fl-export console script."""
    args = build_parser().parse_args(argv)
    try:
        weights, origin = load_source_weights(args)
        int8_data = None
        if args.int8:
            dataset = load_fashion_mnist(args.data_dir)
            int8_data = (
                normalise(dataset.train_images[:CALIBRATION_IMAGES]),
                normalise(dataset.test_images),
                dataset.test_labels.astype(np.int64),
            )
        manifest = write_bundle(weights, args.out, args.model, args.opset, int8_data)
        load_bundle(args.out)
    except (ValueError, FileNotFoundError, FileExistsError, DatasetMissingError) as error:
        print(f"fl-export: {error}", file=sys.stderr)
        return 2
    print(f"exported {origin} (weights {manifest['weights_hash'][:16]}) to {args.out}")
    quantization = manifest["quantization"]
    if quantization:
        print(
            f"int8 prefix: test accuracy {quantization['test_accuracy_fp32']:.4f} -> "
            f"{quantization['test_accuracy_int8']:.4f} ({quantization['test_accuracy_change']:+.4f})"
        )
    return 0
