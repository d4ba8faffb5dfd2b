# The torch back end built from a bundle: its weights.npz, checked against the manifest's weights hash.
from __future__ import annotations

import torch

from edge_agent.learning.bundle import Bundle, BundleError
from edge_agent.learning.mc_dropout import TorchMCDropout
from edge_agent.learning.models import build_model, set_weights
from protocol.files import load_arrays
from protocol.tensors import weights_hash


def torch_scorer_from_bundle(bundle: Bundle, batch_size: int, threads: int = 0) -> TorchMCDropout:
    """A TorchMCDropout over the bundle's weights; threads > 0 sets torch's intra-op thread count."""
    weights = load_arrays(bundle.weights_path)
    if weights_hash(weights) != bundle.manifest.weights_hash:
        raise BundleError(f"{bundle.weights_path}: weights hash differs from the manifest's weights_hash")
    if threads > 0:
        torch.set_num_threads(threads)
    model = build_model(bundle.manifest.spec)
    set_weights(model, weights)
    return TorchMCDropout(model, batch_size)
