# The frozen encoder a round's sampler needs: a team's file, or W0's penultimate layers exported once.
from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from coordinator.setup.settings import ServerSettings
from coordinator.storage.store import RunStore
from edge_agent.learning.encoder import OnnxEncoder
from edge_agent.learning.models import build_model, set_weights
from edge_agent.learning.sampling import make_sampler
from export.onnx_graphs import export_encoder
from protocol.errors import UsageError
from protocol.model_spec import ModelSpec

ENCODER_FILE = "encoder.onnx"


def load_encoder(path: Path, spec: ModelSpec) -> bytes:
    """An encoder file's ONNX bytes, checked (one-line errors naming `--encoder PATH`)."""
    if not Path(path).is_file():
        raise UsageError(f"--encoder {path}: no such file")
    return checked_encoder(Path(path).read_bytes(), spec, f"--encoder {path}")


def checked_encoder(onnx: bytes, spec: ModelSpec, where: str) -> bytes:
    """The encoder's bytes once onnxruntime has embedded an image of the spec's shape with them; ValueError in one
    line, prefixed by `where`, otherwise."""
    try:
        OnnxEncoder(onnx).embed(np.zeros((1, *spec.image_shape), dtype=np.uint8))
    except Exception as error:  # onnxruntime's errors are untyped; any failure means an unusable encoder
        shape = "x".join(str(side) for side in spec.image_shape)
        raise UsageError(f"{where}: cannot embed a {shape} image ({str(error).splitlines()[0]})") from None
    return onnx


def round_encoder(settings: ServerSettings, store: RunStore) -> bytes:
    """The frozen encoder the round's sampler needs: --encoder, else W0's penultimate layers (exported once to
    the run directory); b"" when the sampler needs none."""
    if settings.encoder_path is not None:
        return load_encoder(settings.encoder_path, settings.spec)
    if not make_sampler(settings.recipe.sampler).needs_encoder:
        return b""
    path = settings.run_dir / ENCODER_FILE
    if not path.is_file():
        model = build_model(settings.spec)
        set_weights(model, store.checkpoints.load(0))
        temporary = path.with_suffix(".tmp")
        export_encoder(model, temporary)
        os.replace(temporary, path)
    return load_encoder(path, settings.spec)
