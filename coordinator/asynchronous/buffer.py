# FedBuff's fold, pure numpy: W_{v+1} = W_v + eta_g * sum_i s(tau_i) * Delta_i / K, order-independent.
from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from coordinator.strategies.aggregate import RunningSum
from protocol.tensors import Weights, check_layout, spec_of


def staleness_weight(staleness: int) -> float:
    """FedBuff's default s(tau) = 1 / sqrt(1 + tau): a fresh update (tau = 0) counts fully, older ones less."""
    if isinstance(staleness, bool) or not isinstance(staleness, int) or staleness < 0:
        raise ValueError(f"staleness is an integer >= 0, got {staleness!r}")
    return 1.0 / math.sqrt(1.0 + staleness)


def delta_of(trained: Weights, base: Weights) -> Weights:
    """Delta_i = W_i - W_base per tensor, in float64 (exact for float32 weights)."""
    check_layout(spec_of(base), trained)
    return {name: trained[name].astype(np.float64) - base[name].astype(np.float64) for name in base}


@dataclass
class BufferSum:
    """sum_i s(tau_i) * Delta_i over a buffer's updates: a RunningSum with s(tau_i) as each coefficient, so the
    same exact sums (the same bits in any arrival order) and checks as a synchronous round's."""

    running: RunningSum = field(default_factory=RunningSum)
    staleness: dict[str, int] = field(default_factory=dict)

    def add(self, key: str, delta: Weights, staleness: int) -> None:
        """Adds s(tau) * Delta for one update (all tensors or none); `key` names it, once per buffer."""
        self.running.add(key, delta, staleness_weight(staleness))
        self.staleness[key] = staleness

    def fold(self, base: Weights, server_lr: float) -> Weights:
        """W_base + server_lr * sum_i s(tau_i) * Delta_i / K, K the updates added, cast to the base's dtypes."""
        if not self.staleness:
            raise ValueError("cannot fold an empty buffer")
        if not math.isfinite(server_lr) or server_lr <= 0.0:
            raise ValueError(f"the server learning rate must be positive and finite, got {server_lr!r}")
        count = len(self.staleness)
        return {
            name: (base[name].astype(np.float64) + server_lr * summed.total() / count).astype(base[name].dtype)
            for name, summed in self.running.sums.items()
        }

    def weights(self) -> dict[str, float]:
        """Each update's staleness weight s(tau_i), for the version's report."""
        return {key: staleness_weight(tau) for key, tau in sorted(self.staleness.items())}


def fold_buffer(base: Weights, deltas: Mapping[str, tuple[Weights, int]], server_lr: float = 1.0) -> Weights:
    """The next global model from a full buffer: key -> (Delta_i, tau_i), folded onto `base` (see BufferSum)."""
    buffer = BufferSum()
    for key, (delta, staleness) in deltas.items():
        buffer.add(key, delta, staleness)
    return buffer.fold(base, server_lr)
