# `fl-coordinator encoder`: FAST's frozen encoder fitted on unlabelled images (PCA), checked and written as ONNX.
from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from coordinator.setup.encoder import checked_encoder
from edge_agent.data.fashion_mnist import load_fashion_mnist
from edge_agent.data.image_arrays import model_input
from edge_agent.data.image_files import InputSpec, read_image_folder
from export.pca_encoder import MAX_FIT_IMAGES, fit_pca, pca_encoder_onnx
from protocol.errors import UsageError
from protocol.files import atomic_write_bytes
from protocol.model_spec import DEFAULT_SPEC, ModelSpec, load_model_spec

DEFAULT_DIMENSIONS = 32


def add_arguments(encoder: argparse.ArgumentParser) -> None:
    """`encoder`: where the ONNX goes, how many dimensions, which unlabelled images it is fitted on."""
    encoder.add_argument("--out", type=Path, required=True, help="ONNX file to write (then: --encoder FILE)")
    encoder.add_argument("--pca", type=int, default=DEFAULT_DIMENSIONS, metavar="K", help="embedding dimensions")
    encoder.add_argument(
        "--images", type=Path, help="a folder of the fleet's own images (default: Fashion-MNIST's training images)"
    )
    encoder.add_argument("--model-spec", type=Path, help="TOML model spec whose input the images are decoded to")
    encoder.add_argument("--data-dir", type=Path, help="Fashion-MNIST IDX files (default: the Debian package's)")
    encoder.add_argument("--fit-images", type=int, default=MAX_FIT_IMAGES, help="seeded draw of images fitted on")
    encoder.add_argument("--seed", type=int, default=0)
    encoder.add_argument("--log-level", default="warning")


def unlabelled_inputs(images: Path | None, spec: ModelSpec, data_dir: Path | None) -> np.ndarray:
    """Float (N, C, H, W) inputs in [0, 1], as a device's encoder sees its pool: a folder's images decoded to the
    spec's shape, else Fashion-MNIST's training images (their labels are never read into the fit)."""
    if images is not None:
        unscaled = InputSpec(spec.channels, spec.height, spec.width, mean=(0.0,), std=(1.0,), scale=1 / 255)
        return read_image_folder(images, unscaled).images
    if spec != DEFAULT_SPEC:
        raise UsageError("a model spec other than the paper CNN's needs --images FOLDER")
    return model_input(load_fashion_mnist(data_dir).train_images)


def run(args: argparse.Namespace) -> int:
    """Fits the PCA encoder, checks onnxruntime embeds the spec's images with it, writes it atomically."""
    if args.fit_images < 2:
        raise UsageError(f"--fit-images must be at least 2, got {args.fit_images}")
    spec = load_model_spec(args.model_spec).spec if args.model_spec else DEFAULT_SPEC
    basis = fit_pca(unlabelled_inputs(args.images, spec, args.data_dir), args.pca, args.fit_images, args.seed)
    atomic_write_bytes(args.out, checked_encoder(pca_encoder_onnx(basis, spec.input_shape), spec, str(args.out)))
    print(f"wrote {args.out}: PCA encoder, {args.pca} dimensions, {basis.explained:.1%} of the images' variance")
    return 0
