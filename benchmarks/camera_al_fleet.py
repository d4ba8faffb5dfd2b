# The camera_al benchmark's fleets: balanced or class-imbalanced pools of rendered scenes, embedded once and cached.
"""A camera fleet for benchmarks/camera_al.py: Fashion-MNIST's ten classes (or a class list of the fleet's own,
NAME=SOURCE as bench camera_fleet takes it) rendered by bench.camera_scenes as RGB JPEG scenes, every device's pool
and a separate balanced test set, embedded once by the zoo's EfficientNet-Lite0 with ImageNet weights (pixels / 255,
1280 pooled features; on the GPU when torch sees one) and cached under the work folder, keyed by the fleet and the
spec's hash.

The balanced fleet holds per_class scenes of every class on each device. A class-imbalanced fleet keeps the pool's
size (per_class x C per device) with class frequencies falling from the commonest class to the rarest, geometrically
by a ratio (commonest : rarest) or as a power law of the class's rank (a long tail: share ~ rank^-alpha), in an
order of commonness drawn with the fleet's seed: it keeps the balanced fleet's scenes where a class needs no more,
and renders new scenes of Fashion-MNIST items the balanced fleet does not show for the common classes, so only
those are embedded anew. Its test set is the balanced fleet's.
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bench.camera_scenes import SceneClass, pick_items, render_set
from edge_agent.data.fashion_mnist import load_fashion_mnist
from edge_agent.data.image_arrays import model_input
from edge_agent.learning.efficientnet import FEATURES
from edge_agent.learning.pretrained_backbone import initial_model
from edge_agent.learning.split_model import SplitDropoutModel
from protocol.files import load_arrays, save_arrays
from protocol.model_spec import CLASS_NAMES, ModelSpec, spec_hash

TEN_CLASSES = tuple(SceneClass(name, source) for source, name in enumerate(CLASS_NAMES))
EXTRA_STREAM = 1000  # render streams of the imbalanced fleet's new scenes (the balanced fleet's are 1..devices + 1)


def progress(text: str) -> None:
    """One progress line on stderr."""
    print(f"[camera_al {time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)


def lite0_spec(size: int, classes: tuple[SceneClass, ...] = TEN_CLASSES) -> ModelSpec:
    """The pretrained spec the fleet runs: EfficientNet-Lite0, ImageNet weights, head-only, on the fleet's classes
    (the ten by default; the backbone, and so the cached features, are the same for any)."""
    return ModelSpec(
        architecture="efficientnet-lite0",
        channels=3,
        height=size,
        width=size,
        mean=[0.5] * 3,
        std=[0.5] * 3,
        class_names=[scene.name for scene in classes],
        trainable="head",
        pretrained="imagenet",
    )


@dataclass(frozen=True)
class FleetShape:
    """The camera fleet: devices, scenes per class on each device and in the test set, input size, fleet seed, and
    its classes (Fashion-MNIST's ten by default)."""

    devices: int
    per_class: int
    test_per_class: int
    size: int
    seed: int = 0
    classes: tuple[SceneClass, ...] = TEN_CLASSES


def fleet_key(shape: FleetShape, *parts: Any) -> str:
    """The cache's key: a hash of the fleet's description (its classes only when not the ten) and the backbone's
    spec hash."""
    described = {key: value for key, value in asdict(shape).items() if key != "classes"}
    if shape.classes != TEN_CLASSES:
        described["classes"] = [[scene.name, scene.source] for scene in shape.classes]
    return hashlib.sha256(json.dumps([described, *parts, spec_hash(lite0_spec(shape.size))]).encode()).hexdigest()[:16]


def pool_items(shape: FleetShape, train_labels: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.random.Generator]:
    """The balanced pools' Fashion-MNIST items (training split) and classes, and the generator that draws the test's."""
    rng = np.random.default_rng([shape.seed, 0])
    indices, labels = pick_items(train_labels, shape.classes, shape.per_class * shape.devices, rng)
    return indices, labels, rng


def render_fleet(shape: FleetShape) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """(images, labels) per device, then the test set last: scenes of distinct Fashion-MNIST items (training split
    for the pools, test split for the test set), each class dealt evenly over the devices."""
    dataset = load_fashion_mnist()
    indices, labels, rng = pool_items(shape, dataset.train_labels)
    shares = [
        np.concatenate([np.flatnonzero(labels == c)[d :: shape.devices] for c in range(len(shape.classes))])
        for d in range(shape.devices)
    ]
    sets = [
        render_set(dataset.train_images[indices[share]], labels[share], shape.size, shape.seed, number + 1)
        for number, share in enumerate(shares)
    ]
    test_indices, test_labels = pick_items(dataset.test_labels, shape.classes, shape.test_per_class, rng)
    sets.append(render_set(dataset.test_images[test_indices], test_labels, shape.size, shape.seed, shape.devices + 1))
    return [scenes.arrays() for scenes in sets], [scenes.labels for scenes in sets]


def extract(model: SplitDropoutModel, images: np.ndarray, what: str, batch: int = 64) -> np.ndarray:
    """The backbone's pooled features (float32 (N, 1280)) of raw uint8 images, a batch at a time on the model's
    device, with progress."""
    out = np.empty((len(images), FEATURES), dtype=np.float32)
    device = next(model.parameters()).device
    with torch.no_grad():
        for start in range(0, len(images), batch):
            inputs = torch.from_numpy(model_input(images[start : start + batch])).to(device)
            out[start : start + batch] = model.prefix(inputs).cpu().numpy()
            if start % (batch * 8) == 0:
                progress(f"features {what}: {min(start + batch, len(images))}/{len(images)}")
    return out


def embed_sets(images: list[np.ndarray], size: int) -> tuple[list[np.ndarray], dict[str, Any]]:
    """Every set's features (on the GPU when torch sees one), and how many images that took at how many
    milliseconds each."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = initial_model(lite0_spec(size), 0).eval().to(device)
    started = time.perf_counter()
    features = [extract(model, stack, f"set {number}") for number, stack in enumerate(images)]
    count = sum(len(stack) for stack in images)
    seconds = time.perf_counter() - started
    return features, {"images": count, "ms_per_image": 1000 * seconds / max(count, 1), "device": device}


def fleet_features(shape: FleetShape, work: Path) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """{"features_N", "labels_N"} per device N and the test set (N = devices), from the cache when it holds this
    fleet under this backbone, else rendered and embedded (and cached); with the extraction's timing."""
    path = work / f"features-{fleet_key(shape)}.npz"
    if path.is_file():
        progress(f"features from the cache {path}")
        return load_arrays(path), {"cache": str(path), "cached": True}
    images, labels = render_fleet(shape)
    features, timing = embed_sets(images, shape.size)
    arrays = {f"features_{n}": stack for n, stack in enumerate(features)}
    arrays.update({f"labels_{n}": truth for n, truth in enumerate(labels)})
    work.mkdir(parents=True, exist_ok=True)
    save_arrays(path, arrays)
    return arrays, {"cache": str(path), "cached": False, **timing}


@dataclass(frozen=True)
class ClassMix:
    """How a pool's classes are mixed: `geometric` (commonest : rarest = `value`, 1 is balanced) or `long-tail`
    (the class of rank r, 1 the commonest, holds a share ~ r^-value)."""

    kind: str
    value: float

    @property
    def balanced(self) -> bool:
        """Whether every class is as common as every other."""
        return self.kind == "geometric" and self.value == 1

    def shares(self, classes: int) -> np.ndarray:
        """Each rank's share of the pool, commonest first."""
        if self.kind == "geometric":
            return self.value ** (-np.arange(classes) / (classes - 1))
        return (1.0 + np.arange(classes)) ** -self.value

    def key(self) -> list[Any]:
        """What the cache's key holds of the mix (the geometric ratio alone, as before long tails existed)."""
        return [self.value] if self.kind == "geometric" else [self.kind, self.value]


def mix_counts(pool: int, mix: ClassMix, classes: int, seed: int) -> np.ndarray:
    """Scenes per class (by class index) in a pool of `pool`: frequencies falling by the mix from the commonest
    class to the rarest (largest remainders keep the sum), the order of commonness drawn with `seed`."""
    share = mix.shares(classes)
    exact = pool * share / share.sum()
    ranked = np.floor(exact).astype(np.int64)
    ranked[np.argsort(ranked - exact)[: pool - int(ranked.sum())]] += 1
    counts = np.empty(classes, dtype=np.int64)
    counts[np.random.default_rng([seed, 2]).permutation(classes)] = ranked
    return counts


def extra_scenes(shape: FleetShape, counts: np.ndarray) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """(images, labels) per device for the classes that need more than per_class scenes: training-split items that
    no balanced pool shows, dealt over the devices and rendered on their own streams."""
    dataset = load_fashion_mnist()
    used, _, _ = pool_items(shape, dataset.train_labels)
    missing, rng = np.maximum(counts - shape.per_class, 0), np.random.default_rng([shape.seed, 3])
    fresh = [
        rng.choice(np.setdiff1d(np.flatnonzero(dataset.train_labels == scene.source), used), n * shape.devices, False)
        for scene, n in zip(shape.classes, missing)
    ]
    classes = np.repeat(np.arange(len(shape.classes)), missing)
    images, labels = [], []
    for device in range(shape.devices):
        items = np.concatenate([chosen[device :: shape.devices] for chosen in fresh])
        scenes = render_set(dataset.train_images[items], classes, shape.size, shape.seed, EXTRA_STREAM + device)
        images.append(scenes.arrays())
        labels.append(scenes.labels)
    return images, labels


def kept_positions(labels: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Positions in a balanced pool of the first min(count, held) scenes of every class."""
    return np.concatenate([np.flatnonzero(labels == c)[:count] for c, count in enumerate(counts)])


def imbalanced_features(shape: FleetShape, mix: ClassMix, work: Path) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """The class-imbalanced fleet's arrays (as fleet_features names them, each pool shuffled), from its cache or
    built from the balanced fleet's and the new scenes' features; with the pools' class counts."""
    classes = len(shape.classes)
    counts = mix_counts(shape.per_class * classes, mix, classes, shape.seed)
    path = work / f"features-imbalanced-{fleet_key(shape, *mix.key())}.npz"
    info: dict[str, Any] = {"cache": str(path), "cached": path.is_file(), "pool_class_counts": counts.tolist()}
    if path.is_file():
        progress(f"features from the cache {path}")
        return load_arrays(path), info
    base, _ = fleet_features(shape, work)
    images, labels = extra_scenes(shape, counts)
    features, timing = embed_sets(images, shape.size)
    arrays = {key: base[key] for key in (f"features_{shape.devices}", f"labels_{shape.devices}")}  # the test set
    for device in range(shape.devices):
        kept = kept_positions(base[f"labels_{device}"], counts)
        pool = np.concatenate([base[f"features_{device}"][kept], features[device]])
        truth = np.concatenate([base[f"labels_{device}"][kept], labels[device]])
        order = np.random.default_rng([shape.seed, 4, device]).permutation(len(truth))
        arrays[f"features_{device}"], arrays[f"labels_{device}"] = pool[order], truth[order]
    save_arrays(path, arrays)
    return arrays, {**info, **timing}


def mixed_features(shape: FleetShape, mix: ClassMix, work: Path) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """The fleet's arrays and how they were made: balanced, or class-imbalanced by the mix."""
    return fleet_features(shape, work) if mix.balanced else imbalanced_features(shape, mix, work)


def extraction_ms(size: int, count: int = 64) -> float:
    """Milliseconds per image of the backbone in torch fp32 on this machine (random pixels, after a warm-up)."""
    model = initial_model(lite0_spec(size), 0).eval()
    images = torch.rand(count, 3, size, size)
    with torch.no_grad():
        model.prefix(images[:8])
        started = time.perf_counter()
        model.prefix(images)
    return round(1000 * (time.perf_counter() - started) / count, 2)


def redealt(fleet: dict[str, np.ndarray], devices: int, alpha: float, seed: int) -> dict[str, np.ndarray]:
    """The same scenes dealt to the devices unevenly by class (non-IID): each class's scenes of all the pools split
    over the devices in Dirichlet(alpha) proportions drawn with `seed` (small alpha: a class lives on few devices),
    each pool shuffled; the test set is kept. The pools' sizes then differ."""
    rng = np.random.default_rng([seed, 5])
    features = np.concatenate([fleet[f"features_{n}"] for n in range(devices)])
    labels = np.concatenate([fleet[f"labels_{n}"] for n in range(devices)])
    owners = np.empty(len(labels), dtype=np.int64)
    for c in np.unique(labels):
        rows = rng.permutation(np.flatnonzero(labels == c))
        cuts = np.round(np.cumsum(rng.dirichlet(np.full(devices, alpha)))[:-1] * len(rows)).astype(np.int64)
        for device, part in enumerate(np.split(rows, cuts)):
            owners[part] = device
    dealt = {key: fleet[key] for key in (f"features_{devices}", f"labels_{devices}")}
    for device in range(devices):
        mine = rng.permutation(np.flatnonzero(owners == device))
        dealt[f"features_{device}"], dealt[f"labels_{device}"] = features[mine], labels[mine]
    return dealt
