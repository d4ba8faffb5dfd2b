# The onnxruntime MC-dropout back end: a bundle's prefix and masked-tail graphs behind the scorer interface (no torch).
from __future__ import annotations

import logging
from typing import Sequence

import numpy as np
import onnxruntime as ort

from edge_agent.bundle import Bundle
from edge_agent.mc_scorer import DropoutSpec, mc_probabilities

log = logging.getLogger(__name__)

CPU_PROVIDER = "CPUExecutionProvider"


def select_providers(preferred: Sequence[str]) -> list[str]:
    """The preferred execution providers this onnxruntime build has, in order, always ending with CPU.

    A missing provider (e.g. TensorRT on a Pi) is skipped with a warning rather than failing the device.
    """
    available = set(ort.get_available_providers())
    chosen = []
    for provider in preferred:
        if provider in available:
            chosen.append(provider)
        else:
            log.warning("execution provider %s is not available in this onnxruntime; falling back", provider)
    if CPU_PROVIDER not in chosen:
        chosen.append(CPU_PROVIDER)
    return chosen


def _session(path: str, threads: int, providers: Sequence[str]) -> ort.InferenceSession:
    """An inference session with `threads` intra-op threads (0 = onnxruntime's default) on these providers."""
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.enable_cpu_mem_arena = False
    return ort.InferenceSession(path, sess_options=options, providers=list(providers))


class OrtMCDropout:
    """onnxruntime back end: the same masks as the torch back end for the same seed, fed as graph inputs.

    Dropout never appears in the graphs (onnxruntime's optimiser would delete it); the tail multiplies by
    the mask inputs instead, so every pass really differs.
    """

    name = "onnxruntime"

    def __init__(self, bundle: Bundle, batch_size: int = 256, precision: str = "fp32", threads: int = 0,
                 providers: Sequence[str] = (CPU_PROVIDER,)) -> None:
        self.batch_size = batch_size
        self.precision = precision
        chosen = select_providers(providers)
        self._prefix = _session(str(bundle.graph_path(precision, "prefix")), threads, chosen)
        self._tail = _session(str(bundle.graph_path(precision, "tail")), threads, chosen)
        self._prefix_input = self._prefix.get_inputs()[0].name
        self._feature_input = self._tail.get_inputs()[0].name
        self._mask_inputs = bundle.mask_inputs
        self.spec = DropoutSpec(bundle.dropout_rates, bundle.mask_shapes)

    def probabilities(self, images: np.ndarray, passes: int, seed: int) -> np.ndarray:
        """MC-dropout softmax outputs for normalised images (N, 1, 28, 28) over `passes` passes."""
        return mc_probabilities(self._run_prefix, self._run_tail, self.spec, images, passes, seed, self.batch_size)

    def _run_prefix(self, images: np.ndarray) -> np.ndarray:
        """Prefix features of a batch."""
        return self._prefix.run(None, {self._prefix_input: images})[0]

    def _run_tail(self, features: np.ndarray, masks: Sequence[np.ndarray]) -> np.ndarray:
        """Tail probabilities of features under masks (first graph input: features; masks by manifest name)."""
        feeds = {self._feature_input: features, **dict(zip(self._mask_inputs, masks))}
        return self._tail.run(None, feeds)[0]
