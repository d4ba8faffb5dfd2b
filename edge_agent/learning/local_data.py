# What local training reads: a round's new labels, the replay set, every human label, the pool on demand (no torch).
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

import numpy as np

from edge_agent.data.device_data import DeviceData, Samples
from edge_agent.data.image_arrays import IMAGE_SHAPE
from edge_agent.learning.prior_shift import LABEL_SHARES_KEY
from protocol.model_spec import CLASS_NAMES


def _no_images() -> np.ndarray:
    """An empty uint8 image array."""
    return np.zeros((0, *IMAGE_SHAPE), dtype=np.uint8)


@dataclass(frozen=True)
class LocalData:
    """What a local rule may train on: this acquisition's new labels, the replay set, all human labels, the pool
    (read on demand: only KCFU asks for it), the weak (machine) labels a sampler proposed, and which communication
    round of the active round this is.

    state_dir is the device's private folder, for rules that keep state between rounds (DMLU's personalised model);
    fleet_label_shares the last round announcement's label shares of the fleet (empty: none announced).
    The images fields hold the learner's rows of those samples (`Learner.rows`): raw images, or a head learner's
    cached prefix outputs; the rules only select and join rows.
    """

    new_images: np.ndarray
    new_labels: np.ndarray
    replay_images: np.ndarray
    replay_labels: np.ndarray
    labelled_images: np.ndarray
    labelled_labels: np.ndarray
    unlabelled: Callable[[], np.ndarray]
    state_dir: Path | None = None
    weak_images: np.ndarray = field(default_factory=_no_images)
    weak_labels: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    round_in_active_round: int = 1
    num_classes: int = len(CLASS_NAMES)
    fleet_label_shares: tuple[float, ...] = ()

    def training_set(self) -> tuple[np.ndarray, np.ndarray]:
        """Human labels followed by weak labels: what a rule that trains on 'the labelled set' uses."""
        return (
            np.concatenate([self.labelled_images, self.weak_images]),
            np.concatenate([self.labelled_labels, self.weak_labels]).astype(np.int64),
        )

    def kept_set(self, reservoir: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
        """The training set (every human and weak label), or a class-balanced sample of `reservoir` of it when it
        holds more (reservoir 0: everything): what the kept-labels rule trains on."""
        images, labels = self.training_set()
        if reservoir == 0 or len(labels) <= reservoir:
            return images, labels
        chosen = np.sort(balanced_sample(labels, reservoir, np.random.default_rng(seed)))
        return images[chosen], labels[chosen]

    def new_and_replay(self) -> tuple[np.ndarray, np.ndarray]:
        """This acquisition's new labels followed by the replay set: what the paper's online rule trains on."""
        images = np.concatenate([self.new_images, self.replay_images])
        labels = np.concatenate([self.new_labels, self.replay_labels]).astype(np.int64)
        return images, labels

    def class_counts(self) -> np.ndarray:
        """Human labels per class (n_k of KAFAL)."""
        return np.bincount(np.asarray(self.labelled_labels, dtype=np.int64), minlength=self.num_classes)


def balanced_sample(labels: np.ndarray, size: int, rng: np.random.Generator) -> np.ndarray:
    """`size` positions of `labels` taking the classes in turn (each shuffled), so every class gets an equal share
    until it runs out and the others fill its place."""
    queues = [rng.permutation(np.flatnonzero(labels == label)) for label in np.unique(labels)]
    depth = max((len(queue) for queue in queues), default=0)
    turns = np.full((len(queues), depth), -1, dtype=np.int64)
    for row, queue in enumerate(queues):
        turns[row, : len(queue)] = queue
    interleaved = turns.T.ravel()
    return interleaved[interleaved >= 0][:size]


def training_view(
    data: DeviceData,
    new_indices: np.ndarray,
    new_labels: np.ndarray,
    round_in_active: int,
    rows: Callable[[Samples], np.ndarray] = Samples.images,
) -> LocalData:
    """The training view of the device's data after an acquisition (replay excludes the new batch); the pool is
    read only if the rule asks for it (KCFU), never copied per step otherwise. `rows` gives what the learner trains
    on for samples (their images by default; a head learner's cached prefix outputs), so the images fields hold
    those rows; the four sets are read in one call."""
    labelled_indices, labelled_labels = data.labelled()
    replay_indices, replay_labels = data.replay()
    weak_indices, weak_labels = data.weak_labels()
    keep = ~np.isin(replay_indices, new_indices)
    parts = [new_indices, replay_indices[keep], labelled_indices, weak_indices]
    joined = rows(data.samples(np.concatenate(parts)))
    new, replay, labelled, weak = np.split(joined, np.cumsum([len(part) for part in parts])[:-1])
    return LocalData(
        new_images=new,
        new_labels=new_labels,
        replay_images=replay,
        replay_labels=replay_labels[keep],
        labelled_images=labelled,
        labelled_labels=labelled_labels,
        unlabelled=cache(lambda: rows(data.samples(data.pool_indices()))),
        state_dir=data.state_dir,
        weak_images=weak,
        weak_labels=weak_labels,
        round_in_active_round=round_in_active,
        num_classes=data.num_classes,
        fleet_label_shares=tuple(data.get_state(LABEL_SHARES_KEY, [])),
    )
