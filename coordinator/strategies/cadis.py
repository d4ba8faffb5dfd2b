# CADIS clustering: classifier-update similarity, its running mean over rounds, the Q matrix, cluster weights, state.
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from coordinator.strategies.aggregate import normalised
from protocol.tensors import Weights

CADIS_INITIAL_THRESHOLD = 0.975
CADIS_THRESHOLD_CAP = 0.985
CADIS_THRESHOLD_GROWTH = 1.0005
# The least share of the Q values' variance a two-way cut must explain to count as two groups: the best cut of a
# single normal distribution explains 2/pi ~ 0.64 of it, two well-separated groups nearly all.
SPLIT_MIN_SEPARABILITY = 0.8


def classifier_tensor(weights: Weights) -> str:
    """The final dense classifier's weight ("penultimate layer" in CADIS): the last 2-D tensor named *weight."""
    names = [name for name, array in weights.items() if array.ndim == 2 and name.endswith("weight")]
    if not names:
        raise ValueError("the model has no 2-D weight tensor to serve as the classifier layer")
    return names[-1]


def pairwise_cosine(vectors: np.ndarray) -> np.ndarray:
    """s_ij = cos(v_i, v_j) for the rows of vectors, s_ii = 1; a pair with a zero vector has similarity 0."""
    vectors = np.asarray(vectors, dtype=np.float64)
    norms = np.linalg.norm(vectors, axis=1)
    safe = np.where(norms > 0.0, norms, 1.0)
    unit = vectors / safe[:, None]
    similarity = np.clip(unit @ unit.T, -1.0, 1.0)
    np.fill_diagonal(similarity, 1.0)
    return similarity


def classifier_similarity(global_weights: Weights, client_weights: Sequence[Weights], layer: str) -> np.ndarray:
    """CADIS's Eq. 11: cosine similarity of the clients' classifier-weight changes vec(W_i - W_g)."""
    reference = global_weights[layer].astype(np.float64).ravel()
    return pairwise_cosine(
        np.stack([weights[layer].astype(np.float64).ravel() - reference for weights in client_weights])
    )


def accumulate_similarity(
    sums: np.ndarray, counts: np.ndarray, members: Sequence[int], similarity: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Eq. 12 as sums and counts: every pair (i, j) of this round's members gains s_ij and one observation."""
    index = np.ix_(members, members)
    sums, counts = sums.copy(), counts.copy()
    sums[index] += similarity
    counts[index] += 1
    return sums, counts


def with_devices(
    devices: Sequence[str], sums: np.ndarray, counts: np.ndarray, device_ids: Sequence[str]
) -> tuple[list[str], np.ndarray, np.ndarray]:
    """The device list and matrices grown (zero rows and columns) for the devices not seen before."""
    new = [device for device in dict.fromkeys(device_ids) if device not in devices]
    pad = ((0, len(new)), (0, len(new)))
    return list(devices) + new, np.pad(sums, pad), np.pad(counts, pad)


def running_similarity(sums: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """S_ij = sum_ij / T_ij on observed pairs (T_ij > 0), 0 elsewhere."""
    return np.divide(sums, counts, out=np.zeros_like(sums, dtype=np.float64), where=counts > 0)


def q_matrix(similarity: np.ndarray, observed: np.ndarray) -> np.ndarray:
    """Q_ij = (S_ij - m) / (M - m) on observed pairs, clipped to [0, 1], 0 elsewhere; m, M the observed min, max.

    With every observed value equal (M = m) the observed pairs get Q = 1. No abs(): strongly negative
    similarities stay at the bottom (the reference code's abs() lifts them).
    """
    values = similarity[observed]
    if values.size == 0:
        return np.zeros_like(similarity, dtype=np.float64)
    low, high = float(values.min()), float(values.max())
    scaled = np.ones_like(similarity, dtype=np.float64) if high <= low else (similarity - low) / (high - low)
    return np.where(observed, np.clip(scaled, 0.0, 1.0), 0.0)


def cluster_sizes(q: np.ndarray, threshold: float) -> np.ndarray:
    """|C(k)| = #{j : Q_kj >= tau} over every client seen so far (Eq. 13; k itself counts, Q_kk = 1)."""
    return (np.asarray(q) >= threshold).sum(axis=1)


def cadis_coefficients(num_samples: Sequence[float] | np.ndarray, sizes: Sequence[int] | np.ndarray) -> np.ndarray:
    """w_k = (n_k / |C(k)|) / sum_j (n_j / |C(j)|): each cluster weighs by its mass, not by its head count."""
    counts = np.asarray(num_samples, dtype=np.float64)
    members = np.asarray(sizes, dtype=np.float64)
    if counts.shape != members.shape or np.any(members < 1):
        raise ValueError(f"need one cluster size >= 1 per client, got {list(members)} for {len(counts)} clients")
    return normalised(counts / members)


def otsu_cut(values: np.ndarray) -> tuple[float, float] | None:
    """(threshold, separability) of the two-way cut of the values that maximises the between-group variance
    (Otsu): the threshold halfway between the groups, the separability the share of the total variance the cut
    explains; None for fewer than two distinct values."""
    x = np.sort(np.asarray(values, dtype=np.float64).ravel())
    if x.size < 2 or x[0] == x[-1]:
        return None
    n = x.size
    left = np.arange(1, n)
    left_mean = np.cumsum(x)[:-1] / left
    right_mean = (x.sum() - np.cumsum(x)[:-1]) / (n - left)
    between = (left / n) * ((n - left) / n) * (left_mean - right_mean) ** 2
    best = int(np.argmax(between))
    return float((x[best] + x[best + 1]) / 2.0), float(between[best] / x.var())


def split_threshold(q: np.ndarray, observed: np.ndarray) -> float:
    """tau from the data: Otsu's cut of the observed pairs' Q values when they fall into two clear groups
    (separability >= SPLIT_MIN_SEPARABILITY), else 1.0 (only identical updates group: no clusters)."""
    pairs = np.triu(np.asarray(observed, dtype=bool), k=1)
    cut = otsu_cut(np.asarray(q)[pairs])
    return cut[0] if cut is not None and cut[1] >= SPLIT_MIN_SEPARABILITY else 1.0


def next_threshold(threshold: float, step: int) -> float:
    """tau_{t+1} = min(tau_t * 1.0005^t, 0.985): the clustering threshold rises every round up to the cap."""
    return min(threshold * CADIS_THRESHOLD_GROWTH**step, CADIS_THRESHOLD_CAP)


@dataclass
class CadisState:
    """What CADIS carries from round to round: the devices in matrix order, the similarity sums and observation
    counts of every pair, the threshold tau and the step t, and whether tau comes from the data each round
    (`split`, see split_threshold) instead of the paper's rising schedule. Values only change through `observed`."""

    threshold: float = CADIS_INITIAL_THRESHOLD
    step: int = 0
    devices: list[str] = field(default_factory=list)
    sums: np.ndarray = field(default_factory=lambda: np.zeros((0, 0)))
    counts: np.ndarray = field(default_factory=lambda: np.zeros((0, 0), dtype=np.int64))
    split: bool = False

    def observed(
        self, global_weights: Weights, device_ids: Sequence[str], client_weights: Sequence[Weights]
    ) -> tuple[CadisState, np.ndarray, str, float]:
        """(next state, each client's cluster size |C(k)|, the classifier layer, the tau used): Eq. 11-13 with
        this round's similarities added; tau is the state's (risen for the next round) or, with `split`, this
        round's cut of Q."""
        layer = classifier_tensor(global_weights)
        similarity = classifier_similarity(global_weights, client_weights, layer)
        devices, sums, counts = with_devices(self.devices, self.sums, self.counts, device_ids)
        members = [devices.index(device) for device in device_ids]
        sums, counts = accumulate_similarity(sums, counts, members, similarity)
        q = q_matrix(running_similarity(sums, counts), counts > 0)
        tau = split_threshold(q, counts > 0) if self.split else self.threshold
        following = CadisState(
            next_threshold(self.threshold, self.step), self.step + 1, devices, sums, counts, self.split
        )
        return following, cluster_sizes(q, tau)[members], layer, tau

    def to_json(self) -> dict[str, Any]:
        """Devices in matrix order, similarity sums and counts, the current tau and step."""
        return {
            "devices": list(self.devices),
            "sums": self.sums.tolist(),
            "counts": self.counts.tolist(),
            "threshold": self.threshold,
            "step": self.step,
            "split": self.split,
        }

    @classmethod
    def from_json(cls, state: dict[str, Any]) -> CadisState:
        """Restores to_json(); a malformed state is a ValueError that says what is wrong."""
        try:
            devices = [str(device) for device in state["devices"]]
            sums = np.asarray(state["sums"], dtype=np.float64).reshape(len(devices), len(devices))
            counts = np.asarray(state["counts"], dtype=np.int64).reshape(len(devices), len(devices))
            threshold, step = float(state["threshold"]), int(state["step"])
            split = bool(state.get("split", False))  # states stored before the option have none
        # float(), int() and numpy raise ValueError for a malformed stored state: the store's damage, not a device's
        except (KeyError, TypeError, ValueError) as error:
            raise ValueError(f"stored cadis state is malformed: {str(error)[:200]}") from None
        if len(set(devices)) != len(devices) or np.any(counts < 0) or step < 0:
            raise ValueError("stored cadis state is malformed: repeated devices or negative counts")
        return cls(threshold, step, devices, sums, counts, split)
