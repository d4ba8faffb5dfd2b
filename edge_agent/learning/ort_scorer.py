# The onnxruntime MC-dropout back end: a bundle's prefix and masked-tail graphs behind the scorer interface (no torch).
from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import numpy as np
import onnxruntime as ort

from edge_agent.data.image_arrays import as_model_input
from edge_agent.learning.bundle import Bundle
from edge_agent.learning.mc_scorer import DropoutSpec, mc_feature_probabilities, mc_probabilities

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
    the mask inputs instead, so every pass really differs. The prefix session opens on first use, so scoring
    cached prefix outputs (`feature_probabilities`) never loads the backbone.
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
        self.bundle, self.threads, self._weights = bundle, threads, weights
        self.providers = select_providers(providers)
        if weights is not None:
            initializer_overrides(bundle, "prefix", weights)  # a missing prefix weight is named now, not at first use
        self._prefix: ort.InferenceSession | None = None
        self._tail = self._graph("tail")
        self._feature_input = self._tail.get_inputs()[0].name
        self._mask_inputs = bundle.mask_inputs
        self.spec = DropoutSpec(bundle.dropout_rates, bundle.mask_shapes)

    def probabilities(self, images: np.ndarray, passes: int, seed: int) -> np.ndarray:
        """MC-dropout softmax outputs (passes, N, C) for model inputs (float32 (N, C, H, W) in [0, 1]) or raw uint8 images
        images; raw images are scaled one batch at a time."""
        return mc_probabilities(
            self._run_prefix, self._run_tail, self.spec, images, passes, seed, self.batch_size, self.tail_rows
        )

    def feature_probabilities(self, rows: np.ndarray, passes: int, seed: int) -> np.ndarray:
        """MC-dropout softmax outputs (passes, N, C) of cached prefix outputs (N, D) (any float dtype, flattened):
        the tail alone; row i gets the masks image i of `probabilities` would."""

        def batch_features(start: int, stop: int) -> np.ndarray:
            """Rows [start, stop) as the tail's float32 input."""
            return unflattened(rows[start:stop], self._tail)

        return mc_feature_probabilities(
            batch_features, len(rows), self._run_tail, self.spec, passes, seed, self.batch_size, self.tail_rows
        )

    def _graph(self, part: str) -> ort.InferenceSession:
        """A session of the bundle's graph part at this scorer's precision, with its replacement weights."""
        overrides = None if self._weights is None else initializer_overrides(self.bundle, part, self._weights)
        return _session(self.bundle.graph_path(self.precision, part), self.threads, self.providers, overrides)

    def _run_prefix(self, images: np.ndarray) -> np.ndarray:
        """Prefix features of a batch (the prefix session opens on the first call)."""
        if self._prefix is None:
            self._prefix = self._graph("prefix")
        return self._prefix.run(None, {self._prefix.get_inputs()[0].name: images})[0]

    def _run_tail(self, features: np.ndarray, masks: Sequence[np.ndarray]) -> np.ndarray:
        """Tail probabilities of features under masks (first graph input: features; masks by manifest name)."""
        feeds = {self._feature_input: features, **dict(zip(self._mask_inputs, masks))}
        return self._tail.run(None, feeds)[0]


def unflattened(rows: np.ndarray, session: ort.InferenceSession) -> np.ndarray:
    """Flat prefix outputs (n, D) as the float32 input of a graph that takes the prefix's output shape."""
    shape = [int(side) for side in session.get_inputs()[0].shape[1:]]
    return np.ascontiguousarray(rows, dtype=np.float32).reshape(len(rows), *shape)


def prefix_session(
    bundle: Bundle, threads: int = 0, providers: Sequence[str] = (CPU_PROVIDER,)
) -> Callable[[np.ndarray], np.ndarray]:
    """The bundle's fp32 prefix graph as a function of raw uint8 images (or model inputs): their flattened outputs
    (n, D)."""
    session = _session(bundle.graph_path("fp32", "prefix"), threads, select_providers(providers))
    name = session.get_inputs()[0].name

    def run(images: np.ndarray) -> np.ndarray:
        """Flattened prefix outputs of raw images or model inputs."""
        features = session.run(None, {name: as_model_input(images)})[0]
        return features.reshape(len(features), -1)

    return run


def penultimate_features(
    bundle: Bundle,
    inputs: np.ndarray,
    batch_size: int,
    threads: int = 0,
    providers: Sequence[str] = (CPU_PROVIDER,),
    cached: bool = False,
) -> np.ndarray:
    """The classifier's input features (N, D) under the bundle's own weights, dropout off, one batch at a time:
    the manifest's penultimate graph over the prefix outputs of raw uint8 images, or over `inputs` themselves when
    they are `cached` prefix outputs (flattened rows, no prefix pass). Each batch is written into the one (N, D)
    result (a list of batches joined at the end held the pool's features twice: 20 MB more at 4000 rows)."""
    head = bundle.manifest.head
    if head is None:
        raise ValueError(f"the bundle in {bundle.path} has no penultimate graph (exported before head-only training)")
    chosen = select_providers(providers)
    prefix = None if cached else prefix_session(bundle, threads, chosen)
    penultimate = _session(bundle.path / head.graph, threads, chosen)
    out = np.zeros((0, 0), dtype=np.float32)
    for start in range(0, len(inputs), batch_size):
        rows = inputs[start : start + batch_size]
        features = unflattened(rows if prefix is None else prefix(rows), penultimate)
        batch = penultimate.run(None, {head.input_name: features})[0]
        if start == 0:
            out = np.empty((len(inputs), *batch.shape[1:]), dtype=batch.dtype)
        out[start : start + len(batch)] = batch
    return out
