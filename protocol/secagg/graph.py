# The SecAgg+ neighbour graph: a Harary graph over a public-seeded permutation of the round's devices, O(log n) each.
from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence

import numpy as np

from protocol.errors import UsageError


def degree_for(devices: int, dropout: float) -> int:
    """Neighbours per device: the even k >= 3 ln(n) / D(1/2 || dropout), or everyone else when that is as many. With
    a strict-majority threshold a round fails only when more than half of some device's neighbours drop; if each
    drops with probability `dropout`, Chernoff bounds that by n * exp(-k D) <= 1/n^2 (Bell et al. take k = O(log n);
    the constant grows as the tolerated dropout nears one half)."""
    if not 0 <= dropout < 0.5:
        raise UsageError(f"a tolerated dropout of {dropout} is not in [0, 0.5)")
    if devices < 2:
        return 0
    wanted = 2 * math.ceil(1.5 * math.log(devices) / _divergence(0.5, dropout))
    return devices - 1 if wanted >= devices - 1 else wanted


def _divergence(p: float, q: float) -> float:
    """The Kullback-Leibler divergence of Bernoulli(p) from Bernoulli(q), in nats."""
    return p * math.log(p / q) + (1 - p) * math.log((1 - p) / (1 - q)) if q > 0 else math.inf


def threshold_for(degree: int) -> int:
    """Shares needed to rebuild a secret: a strict majority of the holders, so a device's honest neighbours, each
    revealing one kind of share per peer, can never hand over both its self-mask seed and its mask key."""
    return degree // 2 + 1


def neighbours(devices: Sequence[str], seed: bytes, degree: int) -> dict[str, list[str]]:
    """Each device's neighbours (sorted): devices placed on a ring in an order drawn from the public seed, each joined
    to the degree / 2 nearest on either side (a Harary graph H(k, n); with an odd k the opposite one too)."""
    ring = _ring(sorted(devices), seed)
    count, half = len(ring), degree // 2
    offsets = {*range(1, half + 1), *(count - step for step in range(1, half + 1))}
    if degree % 2:
        offsets.add(count // 2)
    offsets.discard(0)
    return {ring[p]: sorted(ring[(p + step) % count] for step in offsets) for p in range(count)}


def _ring(devices: list[str], seed: bytes) -> list[str]:
    """The devices in the order a permutation seeded from sha256(seed) puts them."""
    generator = np.random.default_rng(int.from_bytes(hashlib.sha256(seed).digest(), "big"))
    return [devices[i] for i in generator.permutation(len(devices))]
