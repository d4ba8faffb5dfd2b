# Image files -> model inputs: JPEG/PNG decoded to the model's shape and normalisation; folders read, broken files skipped.
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

from edge_agent.data.image_arrays import IMAGE_SHAPE, model_input
from protocol.errors import FalError, UsageError
from protocol.manifest import PIXEL_INPUT, BundleManifest

IMAGE_FORMATS = ("JPEG", "PNG")
SKIPPED_SUFFIXES = (".tmp", ".part", ".partial", ".crdownload")
QUARANTINE_DIR = "quarantine"
# Pixels an image may decode to (after a JPEG's draft scaling): a 48 MP photo fits; a header claiming more is
# refused before its pixels are read (PIL itself only warns below 179 MP).
MAX_PIXELS = 50_000_000
MAX_INPUT_SIDE = 4096
REASON_CHARS = 160
SHOWN_SKIPPED = 10
ORIENTATION_TAG = 0x0112  # EXIF: how the camera held the sensor; 5..8 turn the picture a quarter
SIXTEEN_BIT_MODES = ("I;16", "I;16B", "I;16L", "I")  # a 16-bit grey PNG's modes (0..65535)


class UnreadableImageError(FalError, ValueError):
    """A pool file is not a complete JPEG or PNG image of a sane size; `reason` says why in bounded text."""

    def __init__(self, path: Path, reason: str) -> None:
        super().__init__(f"{path}: {reason}")
        self.path = path
        self.reason = reason


@dataclass(frozen=True)
class InputSpec:
    """What the model takes: channels (1 = grayscale, 3 = RGB), height and width of one image, and how a pixel
    becomes an input, (pixel * scale - mean[c]) / std[c] (one mean and std for all channels, or one per channel)."""

    channels: int
    height: int
    width: int
    mean: tuple[float, ...] = (PIXEL_INPUT.mean,)
    std: tuple[float, ...] = (PIXEL_INPUT.std,)
    scale: float = PIXEL_INPUT.scale

    def __post_init__(self) -> None:
        if self.channels not in (1, 3) or not all(1 <= side <= MAX_INPUT_SIDE for side in (self.height, self.width)):
            raise ValueError(
                f"an input is channels (1 or 3) x height x width (1..{MAX_INPUT_SIDE}), got {self.shape_text}"
            )
        for name, values in (("mean", self.mean), ("std", self.std)):
            if len(values) not in (1, self.channels) or not all(math.isfinite(value) for value in values):
                raise ValueError(f"{name} must be 1 or {self.channels} finite numbers, got {list(values)[:4]}")
        if min(self.std) <= 0 or not (math.isfinite(self.scale) and self.scale > 0):
            raise ValueError(f"std and scale must be positive, got std {list(self.std)[:4]}, scale {self.scale}")

    @property
    def shape_text(self) -> str:
        """ "CxHxW", as errors quote it."""
        return f"{self.channels}x{self.height}x{self.width}"

    @property
    def shape(self) -> tuple[int, int, int]:
        """One model input's shape (C, H, W)."""
        return (self.channels, self.height, self.width)

    @property
    def record_shape(self) -> tuple[int, ...]:
        """Shape of one stored uint8 image: (H, W) for grayscale, (H, W, 3) for colour."""
        return (self.height, self.width) if self.channels == 1 else (self.height, self.width, self.channels)

    @property
    def record_bytes(self) -> int:
        """Bytes of one stored image."""
        return math.prod(self.record_shape)

    def describe(self) -> str:
        """The shape and the normalisation in one phrase."""
        return f"{self.shape_text}, (pixel / {1 / self.scale:g} - {list(self.mean)}) / {list(self.std)}"

    def same_as(self, other: InputSpec) -> bool:
        """True when both take the same shape and normalise alike (to float rounding)."""
        close = all(math.isclose(a, b, rel_tol=1e-6) for a, b in zip(self.mean + self.std, other.mean + other.std))
        return (
            self.shape == other.shape
            and (len(self.mean), len(self.std)) == (len(other.mean), len(other.std))
            and close
            and math.isclose(self.scale, other.scale, rel_tol=1e-6)
        )

    @classmethod
    def from_manifest(cls, manifest: BundleManifest, where: str = "manifest") -> InputSpec:
        """The input of a model bundle's manifest (its input_shape and normalisation); ValueError naming `where`."""
        shape = manifest.input_shape
        if len(shape) != 3 or not all(type(side) is int for side in shape):
            raise ValueError(f"{where}: input_shape must be [channels, height, width], got {str(shape)[:80]}")
        norm = manifest.normalisation
        try:
            return cls(shape[0], shape[1], shape[2], _numbers(norm.mean), _numbers(norm.std), float(norm.scale))
        # float() raises ValueError for a manifest's non-numeric normalisation: the bundle's fault, named
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{where}: input_shape or normalisation: {str(exc)[:REASON_CHARS]}") from None


def _numbers(value: Any) -> tuple[float, ...]:
    """A manifest number, or list of numbers, as a tuple of floats; TypeError for anything else."""
    values = value if isinstance(value, list) else [value]
    if not values or not all(isinstance(item, (int, float)) and not isinstance(item, bool) for item in values):
        raise TypeError(f"expected a number or a list of numbers, got {str(value)[:60]}")
    return tuple(float(item) for item in values)


MODEL_INPUT = InputSpec(1, *IMAGE_SHAPE)


def _refusal(image: Image.Image) -> str | None:
    """Why an opened image must not be decoded (not JPEG/PNG, or too many pixels), or None."""
    if image.format not in IMAGE_FORMATS:
        return f"{str(image.format)[:20]} is not JPEG or PNG"
    width, height = image.size
    if width * height > MAX_PIXELS:
        return f"{width}x{height} pixels is more than the {MAX_PIXELS} an image may have (decompression bomb guard)"
    return None


def _upright(image: Image.Image) -> Image.Image:
    """The image as the camera's EXIF orientation says it was held (2..8: mirrored or turned); else as it is,
    without a copy. (A PNG's EXIF is read with its pixels: call it only past the pixel guard.)"""
    return ImageOps.exif_transpose(image) if image.getexif().get(ORIENTATION_TAG) in range(2, 9) else image


def _eight_bit(image: Image.Image) -> Image.Image:
    """A 16-bit grey image scaled to 8-bit grey (65535 -> 255; Pillow's own conversion clips at 255); any other
    image as it is."""
    if image.mode not in SIXTEEN_BIT_MODES:
        return image
    return image.convert("I").point(lambda value: value / 257 + 0.5).convert("L")


def decode_image(path: Path, spec: InputSpec) -> np.ndarray:
    """A JPEG or PNG file -> uint8 array of spec.record_shape: turned upright by its EXIF orientation, a 16-bit
    grey image scaled to 8 bits, converted to L or RGB (CMYK, palette, grey and alpha images alike; alpha is
    dropped), resized bilinearly. Devices and the server's data set decode with it, so both see a photo alike.

    A JPEG is decoded at the smallest draft scale that still covers the target size, so a camera's photo costs
    a fraction of its full resolution; the pixel guard is applied to what would actually be decoded.
    """
    try:
        with Image.open(path) as image:
            mode = "L" if spec.channels == 1 else "RGB"
            if image.format == "JPEG":
                turned = image.getexif().get(ORIENTATION_TAG) in range(5, 9)
                image.draft(mode, (spec.height, spec.width) if turned else (spec.width, spec.height))
            problem = _refusal(image)
            if problem is not None:
                raise UnreadableImageError(path, problem)
            upright = _eight_bit(_upright(image))
            converted = upright.convert(mode).resize((spec.width, spec.height), Image.Resampling.BILINEAR)
            return np.asarray(converted, dtype=np.uint8)
    except UnreadableImageError:
        raise
    except UnidentifiedImageError:
        raise UnreadableImageError(path, "not an image") from None
    except Image.DecompressionBombError as exc:
        raise UnreadableImageError(path, f"decompression bomb guard: {str(exc)[:REASON_CHARS]}") from None
    # Pillow raises ValueError for some broken files: the image's fault, reported as unreadable
    except (OSError, SyntaxError, ValueError) as exc:
        raise UnreadableImageError(path, f"unreadable or truncated image ({str(exc)[:REASON_CHARS]})") from None


def normalise_records(records: np.ndarray, spec: InputSpec) -> np.ndarray:
    """uint8 images (N, *spec.record_shape) -> float32 model inputs (N, C, H, W), normalised per channel.

    For the agent's own input (PIXEL_INPUT: the graphs standardise themselves) this is image_arrays.model_input.
    """
    if records.dtype != np.uint8 or records.shape[1:] != spec.record_shape:
        raise ValueError(f"images are {records.dtype} {records.shape}, expected uint8 (N, {spec.record_shape})")
    scaled = model_input(records) * np.float32(255.0 * spec.scale)
    mean = np.asarray(spec.mean, dtype=np.float32).reshape(-1, 1, 1)
    std = np.asarray(spec.std, dtype=np.float32).reshape(-1, 1, 1)
    return (scaled - mean) / std


def load_image(path: Path, spec: InputSpec) -> np.ndarray:
    """One JPEG or PNG file as a float32 model input (C, H, W); UnreadableImageError says why it cannot be."""
    return normalise_records(decode_image(path, spec)[None], spec)[0]


def folder_files(folder: Path, skip_dirs: set[Path]) -> list[tuple[Path, str, os.stat_result]]:
    """(path, relative POSIX path, stat) of every visible regular file under a folder, by relative path.

    Hidden files and folders, files still being copied (.tmp, .part, ...) and the skip_dirs (resolved paths)
    are left out; a file that vanishes while the folder is walked is simply not listed.
    """
    found = []
    for root, dirs, files in os.walk(folder):
        root_path = Path(root)
        dirs[:] = sorted(d for d in dirs if not d.startswith(".") and (root_path / d).resolve() not in skip_dirs)
        for name in files:
            if name.startswith(".") or name.lower().endswith(SKIPPED_SUFFIXES):
                continue
            path = root_path / name
            try:
                stat = path.stat()
            except FileNotFoundError:
                continue
            found.append((path, path.relative_to(folder).as_posix(), stat))
    return sorted(found, key=lambda entry: entry[1])


@dataclass(frozen=True)
class SkippedFile:
    """A file of a folder that is not a usable image, and why (bounded text); the file itself is left as it is."""

    file: str
    reason: str


@dataclass(frozen=True)
class FolderImages:
    """A folder's images as model inputs, float32 (N, C, H, W), or as raw uint8 records (N, *record_shape), as a
    device's pool keeps them; the file of each row, the files skipped and why."""

    images: np.ndarray
    files: list[str]
    skipped: list[SkippedFile]

    def report(self, selected: np.ndarray) -> dict[str, Any]:
        """The selected rows' files, how many files were skipped, and the first few of them with their reasons."""
        return {
            "files": [self.files[int(index)] for index in selected],
            "skipped": len(self.skipped),
            "skipped_files": [
                {"file": s.file[:REASON_CHARS], "reason": s.reason} for s in self.skipped[:SHOWN_SKIPPED]
            ],
        }


def read_image_folder(folder: Path, spec: InputSpec, limit: int | None = None, raw: bool = False) -> FolderImages:
    """The first `limit` readable images of a folder (all without a limit), in relative-path order, as model inputs
    (`raw`: as the uint8 records a device's pool decodes, which the scorers scale a batch at a time).

    Broken, truncated, oversized and non-image files are skipped with their reason and never touched; the
    quarantine folder of a field device is not read. UsageError when no file at all is a readable image.
    """
    if not folder.is_dir():
        raise UsageError(f"pool folder {folder} does not exist")
    found = folder_files(folder, {(folder / QUARANTINE_DIR).resolve()})
    count = len(found) if limit is None else min(limit, len(found))
    shape, dtype, decode = (spec.record_shape, np.uint8, decode_image) if raw else (spec.shape, np.float32, load_image)
    images = np.empty((count, *shape), dtype=dtype)
    files: list[str] = []
    skipped: list[SkippedFile] = []
    for path, relative, _ in found:
        if len(files) == len(images):
            break
        try:
            images[len(files)] = decode(path, spec)
        except UnreadableImageError as error:
            skipped.append(SkippedFile(relative, error.reason))
            continue
        files.append(relative)
    if not files:
        shown = "; ".join(f"{s.file[:60]}: {s.reason}" for s in skipped[:3])
        raise UsageError(
            f"{folder}: no readable JPEG or PNG image among {len(found)} files ({shown or 'empty folder'})"
        )
    return FolderImages(images[: len(files)], files, skipped)
