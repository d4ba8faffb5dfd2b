# The torch back end built from a bundle: its weights (a frozen backbone's from its prefix graph), hash-checked.
from __future__ import annotations

import torch

from edge_agent.learning.bundle import Bundle, bundle_weights
from edge_agent.learning.mc_dropout import TorchMCDropout
from edge_agent.learning.models import build_model, set_weights


def torch_scorer_from_bundle(bundle: Bundle, batch_size: int, threads: int = 0) -> TorchMCDropout:
    """A TorchMCDropout over the bundle's weights; threads > 0 sets torch's intra-op thread count."""
    weights = bundle_weights(bundle)
    if threads > 0:
        torch.set_num_threads(threads)
    model = build_model(bundle.manifest.spec)
    set_weights(model, weights)
    return TorchMCDropout(model, batch_size)
