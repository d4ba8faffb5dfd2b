# Bench partitions of a labelled data set over simulated devices: type1, type2/iid, dirichlet, clusters.
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from coordinator.rounds.holdout import NUM_CLASSES, checked_indices
from protocol.errors import UsageError

MIN_DIRICHLET_SAMPLES = 10
DIRICHLET_MAX_DRAWS = 100
CLUSTER_CLASS_SHARE = 0.2
_UNKNOWN = "unknown partition {!r}; expected type1, type2, iid, dirichlet:ALPHA or clusters:K"


@dataclass(frozen=True)
class PartitionSpec:
    """A parsed partition: its kind ("type1", "type2", "iid", "dirichlet" or "clusters"), dirichlet's alpha,
    the number of clusters."""

    kind: str
    alpha: float | None = None
    clusters: int | None = None


def parse_partition(spec: str) -> PartitionSpec:
    """Parses "type1", "type2", "iid", "dirichlet:ALPHA" (ALPHA a finite float > 0) or "clusters:K" (K an integer >= 1)."""
    if spec in ("type1", "type2", "iid"):
        return PartitionSpec(spec)
    kind, sep, alpha_text = spec.partition(":")
    if kind == "clusters" and sep:
        if not alpha_text.isdigit() or int(alpha_text) < 1:
            raise UsageError(f"partition {spec!r}: K must be an integer >= 1, got {alpha_text!r}")
        return PartitionSpec("clusters", clusters=int(alpha_text))
    if kind != "dirichlet" or not sep:
        raise UsageError(_UNKNOWN.format(spec))
    try:
        alpha = float(alpha_text)
    # float() raises ValueError for the person's ALPHA text
    except ValueError:
        raise UsageError(f"partition {spec!r}: ALPHA must be a number > 0, got {alpha_text!r}") from None
    if not math.isfinite(alpha) or alpha <= 0:
        raise UsageError(f"partition {spec!r}: ALPHA must be a finite number > 0")
    return PartitionSpec("dirichlet", alpha)


def type1_class_groups(num_devices: int) -> list[list[int]]:
    """Contiguous class groups, one per device, as even as possible with the larger groups last.

    With 4 devices this is the paper's {0,1}, {2,3}, {4,5,6}, {7,8,9}.
    """
    if not 1 <= num_devices <= NUM_CLASSES:
        raise UsageError(f"type1 gives each device its own classes: needs 1..{NUM_CLASSES} devices, not {num_devices}")
    small, larger_count = divmod(NUM_CLASSES, num_devices)
    sizes = [small] * (num_devices - larger_count) + [small + 1] * larger_count
    bounds = np.cumsum([0, *sizes])
    return [list(range(bounds[i], bounds[i + 1])) for i in range(num_devices)]


def cluster_class_groups(num_clusters: int) -> list[list[int]]:
    """The classes of each cluster: 20% of the classes each (2 of 10), consecutive, so clusters are disjoint up
    to K = 5 and wrap around (cluster g starts at class 2g mod 10) beyond."""
    if num_clusters < 1:
        raise UsageError(f"clusters needs K >= 1, got {num_clusters}")
    share = max(1, round(CLUSTER_CLASS_SHARE * NUM_CLASSES))
    return [[(share * group + offset) % NUM_CLASSES for offset in range(share)] for group in range(num_clusters)]


def cluster_members(num_devices: int, num_clusters: int) -> list[np.ndarray]:
    """The devices of each cluster: contiguous, as even as possible (4 devices, K=2: {0,1}, {2,3})."""
    if num_devices < num_clusters:
        raise UsageError(f"clusters:{num_clusters} needs at least {num_clusters} devices, got {num_devices}")
    return np.array_split(np.arange(num_devices), num_clusters)


def _type1(labels: np.ndarray, indices: np.ndarray, num_devices: int) -> list[np.ndarray]:
    """Disjoint classes: device d gets every sample whose class is in its contiguous class group."""
    subset_labels = labels[indices]
    return [np.sort(indices[np.isin(subset_labels, group)]) for group in type1_class_groups(num_devices)]


def _iid(indices: np.ndarray, num_devices: int, rng: np.random.Generator) -> list[np.ndarray]:
    """A uniform random split into near-equal parts (sizes differ by at most one)."""
    return [np.sort(part) for part in np.array_split(rng.permutation(indices), num_devices)]


def _dirichlet_draw(
    labels: np.ndarray, indices: np.ndarray, num_devices: int, alpha: float, rng: np.random.Generator
) -> list[np.ndarray]:
    """One draw: each class's samples split over devices in proportions drawn from Dir(alpha)."""
    parts: list[list[np.ndarray]] = [[] for _ in range(num_devices)]
    subset_labels = labels[indices]
    for cls in range(NUM_CLASSES):
        members = rng.permutation(indices[subset_labels == cls])
        proportions = rng.dirichlet(np.full(num_devices, alpha))
        cuts = (np.cumsum(proportions)[:-1] * len(members)).astype(np.int64)
        for device, chunk in enumerate(np.split(members, cuts)):
            parts[device].append(chunk)
    return [np.sort(np.concatenate(chunks)) for chunks in parts]


def _dirichlet(
    labels: np.ndarray, indices: np.ndarray, num_devices: int, alpha: float, rng: np.random.Generator
) -> list[np.ndarray]:
    """Dirichlet label skew, re-drawn until every device holds at least MIN_DIRICHLET_SAMPLES samples."""
    if len(indices) < MIN_DIRICHLET_SAMPLES * num_devices:
        raise UsageError(
            f"dirichlet needs at least {MIN_DIRICHLET_SAMPLES} samples per device: "
            f"{len(indices)} samples cannot cover {num_devices} devices"
        )
    for _ in range(DIRICHLET_MAX_DRAWS):
        parts = _dirichlet_draw(labels, indices, num_devices, alpha, rng)
        if min(len(part) for part in parts) >= MIN_DIRICHLET_SAMPLES:
            return parts
    raise UsageError(
        f"dirichlet:{alpha} left some device with fewer than {MIN_DIRICHLET_SAMPLES} samples in "
        f"{DIRICHLET_MAX_DRAWS} draws; use a larger alpha, fewer devices or more samples"
    )


def _clusters(
    labels: np.ndarray, indices: np.ndarray, num_devices: int, num_clusters: int, rng: np.random.Generator
) -> list[np.ndarray]:
    """Cluster skew: each class's samples go in equal shares to the clusters holding it, and within a cluster
    in equal random shares to its devices; classes no cluster holds (K < 5) are given to nobody."""
    members = cluster_members(num_devices, num_clusters)
    groups = cluster_class_groups(num_clusters)
    parts: list[list[np.ndarray]] = [[np.zeros(0, dtype=np.int64)] for _ in range(num_devices)]
    subset_labels = labels[indices]
    for cls in range(NUM_CLASSES):
        holders = [group for group, classes in enumerate(groups) if cls in classes]
        if not holders:
            continue
        samples = rng.permutation(indices[subset_labels == cls])
        for group, share in zip(holders, np.array_split(samples, len(holders))):
            for device, piece in zip(members[group], np.array_split(share, len(members[group]))):
                parts[device].append(piece)
    return [np.sort(np.concatenate(chunks)) for chunks in parts]


def partition_indices(
    labels: np.ndarray, spec: str, num_devices: int, rng: np.random.Generator, indices: np.ndarray | None = None
) -> list[np.ndarray]:
    """Splits `indices` (default all samples) over num_devices; the parts are disjoint and sorted, and all but
    clusters:K (which leaves out the classes no cluster holds) cover them.

    type1: disjoint contiguous class groups. type2 and iid: the same uniform random IID split; type2's
    class bias is not made here but arises later from each device's active-learning sampler.
    dirichlet:ALPHA: per-class proportions over devices drawn from Dir(ALPHA); small ALPHA means strong skew.
    clusters:K: CADIS's cluster skew; K contiguous device groups, each holding its own 20% of the classes.
    """
    parsed = parse_partition(spec)
    if num_devices < 1:
        raise UsageError(f"num_devices must be at least 1, got {num_devices}")
    subset = checked_indices(np.asarray(labels), indices)
    if parsed.kind == "type1":
        return _type1(np.asarray(labels), subset, num_devices)
    if parsed.kind == "dirichlet" and parsed.alpha is not None:
        return _dirichlet(np.asarray(labels), subset, num_devices, parsed.alpha, rng)
    if parsed.kind == "clusters" and parsed.clusters is not None:
        return _clusters(np.asarray(labels), subset, num_devices, parsed.clusters, rng)
    return _iid(subset, num_devices, rng)
