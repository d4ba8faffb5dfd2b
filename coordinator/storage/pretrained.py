# Initial weights from a team's own file (an .npz, or an ONNX file's initializers), matched to the model by name.
from __future__ import annotations

import logging
from pathlib import Path

import numpy as np

from protocol.errors import UsageError
from protocol.files import UnreadableFileError, load_arrays
from protocol.tensors import Weights
from protocol.wire import shown_names

log = logging.getLogger(__name__)


def read_weight_file(path: Path) -> Weights:
    """Named float arrays of an .npz or of an ONNX file's initializers (one-line errors naming the file); the
    `model.` prefix of this runtime's own bundle graphs is dropped, so a shipped bundle can seed a new run."""
    if not path.is_file():
        raise UsageError(f"initial weights {path}: no such file")
    if path.suffix == ".onnx":
        import onnx
        from onnx import numpy_helper

        try:
            graph = onnx.load(str(path), load_external_data=False).graph
        except Exception as error:  # onnx raises untyped protobuf errors for any malformed file
            raise UsageError(f"initial weights {path}: not a readable ONNX file ({str(error)[:120]})") from None
        return {item.name.removeprefix("model."): numpy_helper.to_array(item) for item in graph.initializer}
    try:
        return load_arrays(path)
    except (OSError, UnreadableFileError) as error:
        raise UsageError(f"initial weights {path}: not a readable .npz ({str(error)[:120]})") from None


def merge_initial_weights(model_weights: Weights, found: Weights, classifier: str, where: str) -> Weights:
    """The model's weights with every same-named, same-shaped tensor of `found` in their place.

    The classifier may differ in shape (a backbone pretrained on other classes): it keeps its fresh values. Any
    other shape disagreement, or a file that matches nothing, is an error naming the tensors."""
    clashing = [
        name
        for name, array in found.items()
        if name in model_weights and array.shape != model_weights[name].shape and not name.startswith(f"{classifier}.")
    ]
    if clashing:
        raise UsageError(f"initial weights {where}: shapes differ from the model's for {shown_names(clashing)}")
    taken = {
        name: np.asarray(array, dtype=model_weights[name].dtype)
        for name, array in found.items()
        if name in model_weights and array.shape == model_weights[name].shape
    }
    if not taken:
        raise UsageError(f"initial weights {where}: no tensor matches the model's names ({shown_names(sorted(found))})")
    log.info("initial weights file=%s loaded=%d of=%d", where, len(taken), len(model_weights))
    return {**model_weights, **taken}
