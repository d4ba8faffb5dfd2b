# A camera fleet's field changing during a run: the scenes a drift brings, written to each camera once a round commits.
from __future__ import annotations

import io
import sqlite3
import threading
from pathlib import Path

import numpy as np
from PIL import Image

from bench.camera_scenes import SceneClass, SceneSet, pick_items, render_set
from coordinator.storage.store import RunStore
from protocol.files import atomic_write_bytes

DRIFTS = ("lighting", "mix")
DARKER, BLUE = 0.45, np.array([0.8, 0.9, 1.25])  # the lighting drift: a darker scene under bluer light
MIX_CLASSES, MIX_MAJOR, MIX_MINOR = 2, 2, 0.2  # the mix drift: two classes twice as many, the rest a fifth


def drifted(scenes: SceneSet) -> SceneSet:
    """The same scenes under the changed lighting (darker, bluer), as JPEGs."""
    jpegs = []
    for jpeg in scenes.jpegs:
        pixels = np.asarray(Image.open(io.BytesIO(jpeg)).convert("RGB"), dtype=np.float32)
        buffer = io.BytesIO()
        Image.fromarray(np.clip(pixels * DARKER * BLUE, 0, 255).astype(np.uint8)).save(buffer, format="JPEG")
        jpegs.append(buffer.getvalue())
    return SceneSet(jpegs, scenes.labels)


def drift_scenes(
    items: tuple[np.ndarray, np.ndarray],
    classes: tuple[SceneClass, ...],
    per_class: int,
    size: int,
    seed: int,
    stream: int,
    drift: str = "lighting",
) -> SceneSet:
    """The scenes a drift brings, from the (images, labels) items (a stream of its own, so each set differs):
    `lighting`, `per_class` items of each class under the changed lighting; `mix`, the field's class mix changed
    (MIX_CLASSES classes, the same for every camera of a seed, MIX_MAJOR times `per_class` items each, the others a
    MIX_MINOR share of it), under the same light as before: a change the server's balanced test set cannot see."""
    rng = np.random.default_rng([seed, stream])
    if drift == "lighting":
        indices, labels = pick_items(items[1], classes, per_class, rng)
        return drifted(render_set(items[0][indices], labels, size, seed, stream))
    major = set(np.random.default_rng([seed, 7]).permutation(len(classes))[:MIX_CLASSES].tolist())
    chosen, numbers = [], []
    for number, scene_class in enumerate(classes):
        count = per_class * MIX_MAJOR if number in major else max(1, round(per_class * MIX_MINOR))
        found, _ = pick_items(items[1], (scene_class,), count, rng)
        chosen.append(found)
        numbers.append(np.full(count, number, dtype=np.int64))
    order = rng.permutation(sum(len(found) for found in chosen))
    indices, labels = np.concatenate(chosen)[order], np.concatenate(numbers)[order]
    return render_set(items[0][indices], labels, size, seed, stream)


def drift_when_committed(run_dir: Path, after: int, pools: list[tuple[Path, SceneSet]], stop: threading.Event) -> None:
    """Once round `after` is committed, writes each device's drifted scenes into its camera folder (dated now, so
    its agent takes them in as new images)."""
    while not stop.wait(1.0):
        try:
            with RunStore(run_dir, read_only=True) as store:
                committed = store.last_committed_round() or 0
        # the coordinator has not created its store yet (no file, or its tables not yet there)
        except (OSError, sqlite3.Error):
            continue
        if committed >= after:
            for pool, scenes in pools:
                for number, jpeg in enumerate(scenes.jpegs):
                    atomic_write_bytes(pool / f"drift-{number:05d}.jpg", jpeg)
            return
