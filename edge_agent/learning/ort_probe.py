# `python -m edge_agent.learning.ort_probe`: imports onnxruntime and runs one tiny inference (edge-agent doctor's child).
"""Run in a child process by `edge-agent doctor`, so that a runtime whose wheel uses an instruction the board's CPU
lacks dies here (SIGILL) and the doctor reports it in one line instead of dying itself. Exit 0 and one line with
the result when the inference gives the expected numbers; exit 1 naming the difference otherwise."""

from __future__ import annotations

import base64
import sys

import numpy as np

# A 1x8 input times an 8x4 weight (linspace(-1, 1, 32)), then Relu: an ONNX model of 239 bytes (opset 13, IR 7),
# written once by onnx.helper, so the probe needs neither the onnx package nor a bundle.
MODEL = base64.b64decode(
    "CAcSADriAQoRCgF4CgF3EgF5IgZNYXRNdWwKDAoBeRIBeiIEUmVsdRIGZG9jdG9yKowBCAgIBBABQgF3SoABAACAv997b7++916/nXNOv3zv"
    "Pb9bay2/OuccvxljDL/vvfe+rbXWvmuttb4ppZS+zjlnvkopJb6MMca9CCEEvQghBD2MMcY9SiklPs45Zz4ppZQ+a621Pq211j7vvfc+GWMM"
    "PzrnHD9bay0/fO89P51zTj++914/33tvPwAAgD9aEwoBeBIOCgwIARIICgIIAQoCCAhiEwoBehIOCgwIARIICgIIAQoCCARCBAoAEA0="
)
WEIGHT = np.linspace(-1, 1, 32, dtype=np.float32).reshape(8, 4)


def expected_output() -> np.ndarray:
    """What the model gives for an input of ones: Relu of the weight's column sums."""
    return np.maximum(WEIGHT.sum(axis=0), 0)[None, :]


def main() -> int:
    """Imports onnxruntime, runs the model once on the CPU provider and compares with numpy."""
    import onnxruntime

    session = onnxruntime.InferenceSession(MODEL, providers=["CPUExecutionProvider"])
    (output,) = session.run(None, {"x": np.ones((1, 8), dtype=np.float32)})
    if not np.allclose(output, expected_output(), atol=1e-5):
        print(f"onnxruntime {onnxruntime.__version__} computed {output.ravel()[:4]}, not {expected_output().ravel()}")
        return 1
    print(f"onnxruntime {onnxruntime.__version__} ran one inference")
    return 0


if __name__ == "__main__":
    sys.exit(main())
