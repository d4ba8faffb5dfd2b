# A bundle's frozen prefix behind a device's feature cache: each sample's backbone output is computed once (no torch).
from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import numpy as np

from edge_agent.data.device_data import Samples
from edge_agent.data.feature_cache import FeatureCache
from edge_agent.learning.bundle import Bundle
from edge_agent.learning.onnx_initializers import output_shape
from edge_agent.learning.ort_scorer import CPU_PROVIDER, prefix_session
from protocol.model_spec import trainable_names
from protocol.tensors import weights_hash


def prefix_frozen(bundle: Bundle) -> bool:
    """True when no weight of the bundle's prefix graph is one its spec trains (trainable = "head"): the prefix
    output of an image then never changes, and a feature cache may keep it."""
    mapping = bundle.manifest.initializers.get("prefix")
    if not mapping:
        return False
    return not trainable_names(bundle.manifest.spec, mapping.values())


def prefix_key(bundle: Bundle, weights: Mapping[str, np.ndarray]) -> str:
    """sha256 naming what the fp32 prefix graph computes: the hash of its weights (the manifest's initializer map
    names them), the architecture and input the spec builds it from, and the exporter that wrote it."""
    mapping = bundle.initializers("prefix")
    missing = sorted(name for name in mapping.values() if name not in weights)
    if missing:
        raise ValueError(f"weights lack {missing[:5]}, which the prefix graph needs")
    spec, manifest = bundle.manifest.spec, bundle.manifest
    identity = {
        "weights": weights_hash({name: weights[name] for name in mapping.values()}),
        "initializers": sorted(mapping.items()),
        "model": [spec.architecture, spec.width_multiplier, spec.channels, spec.height, spec.width],
        "normalisation": [spec.mean, spec.std],
        "exporter": [manifest.opset, sorted(manifest.exporter.items())],
        "precision": "fp32",
    }
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()


def prefix_width(bundle: Bundle) -> int | None:
    """The values in one flattened output row of the bundle's fp32 prefix graph, as the graph declares its output
    shape (read from its bytes, no session opened): the width a cached row must have to be this prefix's; None when
    the graph declares no shape or an axis past the batch is dynamic."""
    sides = [side or 0 for side in output_shape(bundle.graph_path("fp32", "prefix").read_bytes())[1:]]
    return math.prod(sides) if sides and all(sides) else None


class CachedPrefix:
    """The prefix outputs of a device's samples, each computed once with the bundle's fp32 prefix graph and kept in
    the feature cache under `folder` (keyed by `prefix_key`, its rows' width the graph's declared output); the graph
    opens only when a row is missing."""

    def __init__(
        self,
        bundle: Bundle,
        folder: Path,
        weights: Mapping[str, np.ndarray],
        batch_size: int,
        threads: int = 0,
        providers: Sequence[str] = (CPU_PROVIDER,),
        scope: str = "",
    ) -> None:
        """`scope` names what the sample indices index when it is not a device's own data (`edge-agent score`'s
        pool file); it joins the key, so another pool in the same folder replaces the cache."""
        self.bundle, self.threads, self.providers = bundle, threads, tuple(providers)
        key = prefix_key(bundle, weights)
        key = hashlib.sha256(f"{key}|{scope}".encode()).hexdigest() if scope else key
        self.cache = FeatureCache(folder, key, batch_size, prefix_width(bundle))
        self._prefix: Callable[[np.ndarray], np.ndarray] | None = None

    def rows(self, samples: Samples) -> np.ndarray:
        """The prefix outputs (n, D) of the samples, flattened (float16, float32 for a prefix whose outputs leave
        float16's range); only rows not cached (or failing their check) run the prefix, their images read only then."""
        return self.cache.rows(samples.indices, samples.digests(), lambda indices: self.extract(samples.read(indices)))

    def fill(self, samples: Samples) -> None:
        """Computes the prefix outputs of the samples not cached yet (their images are read only then)."""
        self.cache.fill(samples.indices, samples.digests(), lambda indices: self.extract(samples.read(indices)))

    def close(self) -> None:
        """Lets the prefix session go (about 47 MB for EfficientNet-Lite0); it opens again when a row is missing."""
        self._prefix = None

    def extract(self, images: np.ndarray) -> np.ndarray:
        """The prefix's flattened outputs of raw uint8 images (the backbone pass the cache saves)."""
        if self._prefix is None:
            self._prefix = prefix_session(self.bundle, self.threads, self.providers)
        return self._prefix(images)
