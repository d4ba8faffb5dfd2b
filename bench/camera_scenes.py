# Camera-like colour images for benches and tests: Fashion-MNIST items tinted, jittered, on textured backgrounds, as JPEGs.
from __future__ import annotations

import io
from dataclasses import dataclass

import numpy as np
from PIL import Image

from edge_agent.field.folder_oracle import parse_label
from protocol.model_spec import CLASS_NAMES

MIN_SIZE, MAX_SIZE = 32, 512
ITEM_SCALE = (0.5, 0.85)  # the item's side as a share of the frame's
MAX_TILT_DEGREES = 20.0
JPEG_QUALITY = (60, 92)
MIN_TINT_DISTANCE = 100.0  # an item's colour keeps at least this RGB distance from its background's mean


@dataclass(frozen=True)
class SceneClass:
    """A class of a rendered set: the name a fleet gives it and the Fashion-MNIST class its items come from."""

    name: str
    source: int


DEFAULT_CLASSES = (
    SceneClass("boot", 9),
    SceneClass("bag", 8),
    SceneClass("shirt", 0),
    SceneClass("trouser", 1),
    SceneClass("dress", 3),
)


def parse_classes(text: str) -> tuple[SceneClass, ...]:
    """ "name=SOURCE,..." (SOURCE a Fashion-MNIST class number or name) -> classes; ValueError naming the bad entry."""
    classes = []
    for entry in text.split(","):
        name, sep, source = entry.partition("=")
        if not sep or not name.strip() or not name.strip().isprintable():
            raise ValueError(f"class {entry[:40]!r} is not NAME=FASHION_MNIST_CLASS (e.g. boot=9 or boot=Ankle boot)")
        classes.append(SceneClass(name.strip(), parse_label(source, CLASS_NAMES)))
    names, sources = [c.name.lower() for c in classes], [c.source for c in classes]
    if len(classes) < 2 or len(set(names)) < len(names) or len(set(sources)) < len(sources):
        raise ValueError(f"a class list needs at least 2 classes with distinct names and sources, got {text[:80]!r}")
    return tuple(classes)


def _texture(rng: np.random.Generator, size: int) -> np.ndarray:
    """A (size, size) field in [0, 1]: stripes at a random angle and frequency, soft blotches, or a gradient."""
    y, x = np.mgrid[0:size, 0:size].astype(np.float32) / size
    angle, phase = rng.uniform(0, np.pi), rng.uniform(0, 2 * np.pi)
    along = x * np.cos(angle) + y * np.sin(angle)
    kind = rng.integers(3)
    if kind == 0:
        return 0.5 + 0.5 * np.sin(2 * np.pi * rng.uniform(2, 8) * along + phase)
    if kind == 1:
        cells = rng.integers(0, 256, (int(rng.integers(3, 8)),) * 2, dtype=np.uint8)
        return np.asarray(Image.fromarray(cells).resize((size, size), Image.Resampling.BICUBIC), np.float32) / 255
    return (along - along.min()) / max(float(np.ptp(along)), 1e-6)


def _background(rng: np.random.Generator, size: int) -> np.ndarray:
    """(size, size, 3) float32: two random colours mixed by a random texture, plus sensor noise."""
    low, high = rng.uniform(0, 255, (2, 3)).astype(np.float32)
    mix = low + (high - low) * _texture(rng, size)[..., None]
    return mix + rng.normal(0, rng.uniform(2, 10), (size, size, 3)).astype(np.float32)


def _tint(rng: np.random.Generator, backdrop: np.ndarray) -> np.ndarray:
    """A random item colour, moved away from the background's mean colour when the two are too alike."""
    tint = rng.uniform(0, 255, 3).astype(np.float32)
    if np.linalg.norm(tint - backdrop.mean(axis=(0, 1))) < MIN_TINT_DISTANCE:
        tint = (tint + 128) % 256
    return tint


def _place_item(canvas: np.ndarray, item: np.ndarray, rng: np.random.Generator) -> None:
    """Draws the item onto the canvas: scaled, tilted, tinted and shaded by its own pixels, at a random place."""
    size = len(canvas)
    side = int(size * rng.uniform(*ITEM_SCALE))
    tilt = rng.uniform(-MAX_TILT_DEGREES, MAX_TILT_DEGREES)
    glyph = Image.fromarray(item).resize((side, side), Image.Resampling.BILINEAR)
    shade = np.asarray(glyph.rotate(tilt, resample=Image.Resampling.BILINEAR), np.float32)[..., None] / 255
    colour = _tint(rng, canvas) * (0.45 + 0.55 * shade)
    alpha = np.clip(shade * 4, 0, 1)
    top, left = rng.integers(0, size - side + 1, 2)
    region = canvas[top : top + side, left : left + side]
    region[...] = region * (1 - alpha) + colour * alpha


def render_scene(item: np.ndarray, size: int, rng: np.random.Generator) -> bytes:
    """One camera-like RGB JPEG (size x size) of a 28x28 Fashion-MNIST item: textured background, tinted and
    jittered item, a random exposure, JPEG quality drawn from JPEG_QUALITY."""
    if not MIN_SIZE <= size <= MAX_SIZE:
        raise ValueError(f"scene size must lie in {MIN_SIZE}..{MAX_SIZE} pixels, got {size}")
    canvas = _background(rng, size)
    _place_item(canvas, item, rng)
    pixels = np.clip(canvas * rng.uniform(0.8, 1.15), 0, 255).astype(np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels, "RGB").save(buffer, format="JPEG", quality=int(rng.integers(*JPEG_QUALITY)))
    return buffer.getvalue()


@dataclass(frozen=True)
class SceneSet:
    """Rendered scenes: the JPEG bytes of each and its class (an index into the class list), shuffled."""

    jpegs: list[bytes]
    labels: np.ndarray

    def arrays(self) -> np.ndarray:
        """The scenes decoded as uint8 (N, size, size, 3), as a camera folder's files decode at full size."""
        return np.stack([np.asarray(Image.open(io.BytesIO(jpeg)).convert("RGB")) for jpeg in self.jpegs])


def pick_items(
    labels: np.ndarray, classes: tuple[SceneClass, ...], per_class: int, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """(dataset indices, class indices) of per_class distinct items of each class, shuffled together."""
    chosen, classes_of = [], []
    for number, scene_class in enumerate(classes):
        candidates = np.flatnonzero(labels == scene_class.source)
        if per_class > len(candidates):
            raise ValueError(f"class {scene_class.name!r} has {len(candidates)} items, {per_class} were asked for")
        chosen.append(rng.choice(candidates, per_class, replace=False))
        classes_of.append(np.full(per_class, number, dtype=np.int64))
    order = rng.permutation(per_class * len(classes))
    return np.concatenate(chosen)[order], np.concatenate(classes_of)[order]


def render_set(items: np.ndarray, labels: np.ndarray, size: int, seed: int, stream: int) -> SceneSet:
    """Scenes of items (uint8 (N, 28, 28)) with their class labels; scene i draws from the generator seeded with
    (seed, stream, i), so a set is the same for a seed whatever else is rendered."""
    jpegs = [render_scene(item, size, np.random.default_rng([seed, stream, i])) for i, item in enumerate(items)]
    return SceneSet(jpegs, np.asarray(labels, dtype=np.int64))
