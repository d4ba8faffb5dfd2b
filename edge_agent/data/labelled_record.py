# A device's labelled record: which samples carry which label from which source, and the replay set; one atomic file.
from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from edge_agent.data.image_arrays import check_labels
from protocol.files import load_arrays, save_arrays

LABEL_SOURCES = ("oracle", "seed", "weak", "correction")  # the stored codes are the positions: append only
HUMAN_SOURCES = ("oracle", "seed", "correction")
RECORD_ARRAYS = {"indices", "labels", "sources", "replay", "num_classes", "replay_per_class"}


def source_code(source: str) -> int:
    """The stored code of a label source; ValueError for an unknown one."""
    if source not in LABEL_SOURCES:
        raise ValueError(f"unknown label source {source!r}; known: {', '.join(LABEL_SOURCES)}")
    return LABEL_SOURCES.index(source)


@dataclass(frozen=True)
class LabelledRecord:
    """Labelled indices, their labels and sources (in labelling order), the replay indices, and the settings."""

    indices: np.ndarray
    labels: np.ndarray
    sources: np.ndarray
    replay: np.ndarray
    num_classes: int
    replay_per_class: int

    @classmethod
    def empty(cls, num_classes: int, replay_per_class: int) -> LabelledRecord:
        """Nothing labelled yet."""
        if replay_per_class < 0 or num_classes < 1:
            raise ValueError(f"need replay_per_class >= 0 and num_classes >= 1, got {replay_per_class}, {num_classes}")
        empty = np.zeros(0, dtype=np.int64)
        return cls(empty, empty, empty.astype(np.int8), empty, num_classes, replay_per_class)

    @classmethod
    def load(cls, path: Path, num_samples: int) -> LabelledRecord:
        """The persisted record, checked for consistency with the image count."""
        arrays = load_arrays(path)
        if set(arrays) != RECORD_ARRAYS:
            raise ValueError(f"{path}: expected arrays {sorted(RECORD_ARRAYS)}, found {sorted(arrays)}")
        indices, labels, replay = arrays["indices"], arrays["labels"], arrays["replay"]
        check_labels(labels, len(indices), int(arrays["num_classes"]), str(path))
        check_labels(arrays["sources"], len(indices), len(LABEL_SOURCES), f"{path} (label sources)")
        in_range = indices.size == 0 or (indices.min() >= 0 and indices.max() < num_samples)
        if not in_range or len(np.unique(indices)) != len(indices) or not np.isin(replay, indices).all():
            raise ValueError(f"{path}: labelled or replay indices are inconsistent with {num_samples} images")
        settings = int(arrays["num_classes"]), int(arrays["replay_per_class"])
        return cls(indices, labels, arrays["sources"], replay, *settings)

    def save(self, path: Path) -> None:
        """Writes the whole record as one atomic file."""
        arrays = {"indices": self.indices, "labels": self.labels, "sources": self.sources, "replay": self.replay}
        save_arrays(
            path,
            {
                **arrays,
                "num_classes": np.asarray(self.num_classes, dtype=np.int64),
                "replay_per_class": np.asarray(self.replay_per_class, dtype=np.int64),
            },
        )

    @property
    def human(self) -> np.ndarray:
        """Which entries are human labels (oracle or seed), not weak machine labels."""
        return self.sources != source_code("weak")

    def with_human_labels(self, indices: np.ndarray, labels: np.ndarray, source: str) -> LabelledRecord:
        """The record with these human labels added (replacing weak ones on the same samples) and the replay set
        topped up, first come first served per class."""
        keep = ~np.isin(self.indices, indices)
        codes = np.full(len(indices), source_code(source), dtype=np.int8)
        return LabelledRecord(
            np.concatenate([self.indices[keep], indices]),
            np.concatenate([self.labels[keep], labels]),
            np.concatenate([self.sources[keep], codes]),
            np.concatenate([self.replay, self.replay_additions(indices, labels)]),
            self.num_classes,
            self.replay_per_class,
        )

    def with_corrections(self, indices: np.ndarray, labels: np.ndarray) -> LabelledRecord:
        """The record with these samples' labels corrected by a person (tagged `correction`, at the end of the
        labelling order; -1, none of these, takes a sample out), each sample once, and the replay set kept in line:
        a corrected sample leaves it and joins again under its new class if that class has room."""
        keep, taken = ~np.isin(self.indices, indices), labels >= 0
        codes = np.full(int(taken.sum()), source_code("correction"), dtype=np.int8)
        base = LabelledRecord(
            np.concatenate([self.indices[keep], indices[taken]]),
            np.concatenate([self.labels[keep], labels[taken]]),
            np.concatenate([self.sources[keep], codes]),
            self.replay[~np.isin(self.replay, indices)],
            self.num_classes,
            self.replay_per_class,
        )
        return replace(base, replay=np.concatenate([base.replay, base.replay_additions(indices[taken], labels[taken])]))

    def with_weak_labels(self, indices: np.ndarray, labels: np.ndarray) -> LabelledRecord:
        """The record with every weak label replaced by these."""
        human = self.human
        codes = np.full(len(indices), source_code("weak"), dtype=np.int8)
        return LabelledRecord(
            np.concatenate([self.indices[human], indices]),
            np.concatenate([self.labels[human], labels]),
            np.concatenate([self.sources[human], codes]),
            self.replay,
            self.num_classes,
            self.replay_per_class,
        )

    def replay_additions(self, indices: np.ndarray, labels: np.ndarray) -> np.ndarray:
        """The newly labelled indices that join the replay set, first come first served per class."""
        label_of = dict(zip(self.indices.tolist(), self.labels.tolist()))
        replay_labels = np.asarray([label_of[index] for index in self.replay.tolist()], dtype=np.int64)
        room = self.replay_per_class - np.bincount(replay_labels, minlength=self.num_classes)
        joined = []
        for index, label in zip(indices.tolist(), labels.tolist()):
            if room[label] > 0:
                room[label] -= 1
                joined.append(index)
        return np.asarray(joined, dtype=np.int64)
