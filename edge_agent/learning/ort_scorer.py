# The onnxruntime MC-dropout back end: a bundle's prefix and masked-tail graphs behind the scorer interface (no torch).
from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import onnxruntime as ort

from edge_agent.data.image_arrays import model_input
from edge_agent.learning.bundle import Bundle
from edge_agent.learning.mc_scorer import DropoutSpec, mc_probabilities

log = logging.getLogger(__name__)

CPU_PROVIDER = "CPUExecutionProvider"
# Measured on the benchmark's pool (T=20, 2 threads): the peak RSS grows ~0.33 MB per image of batch (masks and
# prefix activations), while throughput is flat from 64 up; 640 tail rows per call (10 passes of a batch of 64)
# is as fast as the whole replicated batch and ~18 MB smaller.
DEFAULT_BATCH = 64
TAIL_ROWS = 640


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


_ARENA_EXTEND_AS_REQUESTED = 1  # OrtArenaCfg's arena_extend_strategy: kSameAsRequested (0 is next power of two)
_shared_arena: bool | None = None


def shared_cpu_arena() -> bool:
    """Registers, once per process, one CPU arena for every scoring session; False if this build cannot.

    Without an arena every run mallocs and frees its intermediate tensors (megabytes per batch). glibc then
    raises its mmap threshold and serves them from a heap that fragments, so the peak RSS of the same run
    varied by tens of MB. An arena keeps that memory and reuses it, and sharing one between the prefix and
    tail sessions (which never run at once) holds only the larger of their working sets. It grows by exactly
    what a request lacks, so it ends at about the largest batch's working set and stays there.
    """
    global _shared_arena
    if _shared_arena is None:
        try:
            ort.create_and_register_allocator(
                ort.OrtMemoryInfo("Cpu", ort.OrtAllocatorType.ORT_ARENA_ALLOCATOR, 0, ort.OrtMemType.DEFAULT),
                ort.OrtArenaCfg(0, _ARENA_EXTEND_AS_REQUESTED, -1, -1),
            )
            _shared_arena = True
        except (AttributeError, RuntimeError, ValueError) as error:  # older builds, or registered elsewhere
            log.debug("shared CPU arena not registered (%s); each session keeps its own", error)
            _shared_arena = False
    return _shared_arena


def session_options(threads: int) -> ort.SessionOptions:
    """Options for a small-memory device: `threads` intra-op threads (0 = onnxruntime's default), one graph
    node at a time, the shared CPU arena, and no memory patterns (a pattern is one more block per input shape
    on top of the arena, about 10 MB at batch 64, for no measurable speed).
    """
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    options.enable_cpu_mem_arena = True
    options.enable_mem_pattern = False
    if shared_cpu_arena():
        options.add_session_config_entry("session.use_env_allocators", "1")
    return options


def graph_with_weights(path: Path, overrides: Mapping[str, np.ndarray]) -> bytes:
    """The ONNX graph at path, serialised with these initializers replaced (names and shapes must match).

    Replacing them in the model itself, rather than with SessionOptions.add_initializer, keeps every graph
    optimisation: onnxruntime's layout transformations pre-pack convolution weights from the file's own
    initializers and silently ignore added ones (measured: wrong features at ORT_ENABLE_ALL).
    """
    import onnx
    from onnx import numpy_helper

    model = onnx.load(str(path))
    replaced = set()
    for initializer in model.graph.initializer:
        if initializer.name in overrides:
            array = np.ascontiguousarray(overrides[initializer.name], dtype=np.float32)
            if tuple(initializer.dims) != array.shape:
                raise ValueError(
                    f"{path.name}: {initializer.name} has shape {tuple(initializer.dims)}, "
                    f"the replacement {array.shape}"
                )
            initializer.CopyFrom(numpy_helper.from_array(array, initializer.name))
            replaced.add(initializer.name)
    missing = sorted(set(overrides) - replaced)
    if missing:
        raise ValueError(f"{path.name} has no initializers {missing}")
    return model.SerializeToString()


def _session(
    path: Path, threads: int, providers: Sequence[str], overrides: Mapping[str, np.ndarray] | None = None
) -> ort.InferenceSession:
    """An inference session with session_options(threads) on these providers; `overrides` replace the graph's
    initializers of those names."""
    model = str(path) if overrides is None else graph_with_weights(path, overrides)
    return ort.InferenceSession(model, sess_options=session_options(threads), providers=list(providers))


def initializer_overrides(bundle: Bundle, part: str, weights: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The arrays that make a bundle's fp32 graph part compute with `weights` instead of its exported ones."""
    mapping = bundle.initializers(part)
    missing = sorted(weight for weight in mapping.values() if weight not in weights)
    if missing:
        raise ValueError(f"weights lack {missing}, which the {part} graph needs")
    return {initializer: weights[weight] for initializer, weight in mapping.items()}


class OrtMCDropout:
    """onnxruntime back end: the same masks as the torch back end for the same seed, fed as graph inputs.

    Dropout never appears in the graphs (onnxruntime's optimiser would delete it); the tail multiplies by
    the mask inputs instead, so every pass really differs.
    """

    name = "onnxruntime"

    def __init__(
        self,
        bundle: Bundle,
        batch_size: int = DEFAULT_BATCH,
        precision: str = "fp32",
        threads: int = 0,
        providers: Sequence[str] = (CPU_PROVIDER,),
        tail_rows: int | None = TAIL_ROWS,
        weights: Mapping[str, np.ndarray] | None = None,
    ) -> None:
        """`weights` (fp32 only) replace the bundle's own, e.g. a device's model after local training."""
        if weights is not None and precision != "fp32":
            raise ValueError(f"only fp32 graphs take replacement weights, not {precision} ones")
        self.batch_size = batch_size
        self.tail_rows = tail_rows
        self.precision = precision
        chosen = select_providers(providers)
        self._prefix, self._tail = (
            _session(
                bundle.graph_path(precision, part),
                threads,
                chosen,
                None if weights is None else initializer_overrides(bundle, part, weights),
            )
            for part in ("prefix", "tail")
        )
        self._prefix_input = self._prefix.get_inputs()[0].name
        self._feature_input = self._tail.get_inputs()[0].name
        self._mask_inputs = bundle.mask_inputs
        self.spec = DropoutSpec(bundle.dropout_rates, bundle.mask_shapes)

    def probabilities(self, images: np.ndarray, passes: int, seed: int) -> np.ndarray:
        """MC-dropout softmax outputs (passes, N, C) for model inputs (float32 (N, C, H, W) in [0, 1]) or raw uint8 images
        images; raw images are scaled one batch at a time."""
        return mc_probabilities(
            self._run_prefix, self._run_tail, self.spec, images, passes, seed, self.batch_size, self.tail_rows
        )

    def _run_prefix(self, images: np.ndarray) -> np.ndarray:
        """Prefix features of a batch."""
        return self._prefix.run(None, {self._prefix_input: images})[0]

    def _run_tail(self, features: np.ndarray, masks: Sequence[np.ndarray]) -> np.ndarray:
        """Tail probabilities of features under masks (first graph input: features; masks by manifest name)."""
        feeds = {self._feature_input: features, **dict(zip(self._mask_inputs, masks))}
        return self._tail.run(None, feeds)[0]


def penultimate_features(
    bundle: Bundle, images: np.ndarray, batch_size: int, threads: int = 0, providers: Sequence[str] = (CPU_PROVIDER,)
) -> np.ndarray:
    """The classifier's input features (N, D) of raw uint8 images under the bundle's own weights,
    dropout off: the prefix graph, then the manifest's penultimate graph, one batch at a time."""
    head = bundle.manifest.head
    if head is None:
        raise ValueError(f"the bundle in {bundle.path} has no penultimate graph (exported before head-only training)")
    chosen = select_providers(providers)
    prefix = _session(bundle.graph_path("fp32", "prefix"), threads, chosen)
    penultimate = _session(bundle.path / head.graph, threads, chosen)
    prefix_input = prefix.get_inputs()[0].name
    batches = []
    for start in range(0, len(images), batch_size):
        features = prefix.run(None, {prefix_input: model_input(images[start : start + batch_size])})[0]
        batches.append(penultimate.run(None, {head.input_name: features})[0])
    return np.concatenate(batches) if batches else np.zeros((0, 0), dtype=np.float32)
