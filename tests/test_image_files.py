# Image files as model inputs: PNG/JPEG, grey/RGB into any (C, H, W); broken files skipped with reasons, never touched.
from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
from picture_files import broken_files, contents, solid_jpeg
from PIL import Image

from edge_agent.data.image_arrays import ImageDataset, model_input
from edge_agent.data.image_files import (
    MODEL_INPUT,
    InputSpec,
    UnreadableImageError,
    load_image,
    normalise_records,
    read_image_folder,
)
from edge_agent.field.folder_pool import FolderPool
from edge_agent.learning.bundle import load_bundle
from edge_agent.learning.models import build_model, get_weights
from export.bundle_writer import ensure_bundle_files
from protocol.errors import UsageError
from protocol.manifest import BundleManifest, Normalisation

RGB_SPEC = InputSpec(3, 30, 40, mean=(0.1, 0.2, 0.3), std=(0.5, 0.25, 0.125))


def test_a_grey_png_loads_bit_for_bit_as_the_array_pool_normalises_it(tmp_path: Path, fashion: ImageDataset) -> None:
    image = fashion.test_images[0]
    Image.fromarray(image).save(tmp_path / "a.png")
    loaded = load_image(tmp_path / "a.png", MODEL_INPUT)
    assert loaded.dtype == np.float32 and loaded.shape == (1, 28, 28)
    assert np.array_equal(loaded, model_input(image[None])[0])


def test_an_rgb_png_keeps_channel_order_and_normalises_each_channel(tmp_path: Path) -> None:
    rgb = np.zeros((30, 40, 3), dtype=np.uint8)
    rgb[..., 0], rgb[..., 1], rgb[..., 2] = 200, 100, np.arange(40, dtype=np.uint8)[None, :] * 6
    Image.fromarray(rgb).save(tmp_path / "rgb.png")
    loaded = load_image(tmp_path / "rgb.png", RGB_SPEC)
    mean, std = np.array(RGB_SPEC.mean)[:, None, None], np.array(RGB_SPEC.std)[:, None, None]
    assert loaded.shape == (3, 30, 40)
    np.testing.assert_allclose(loaded, (rgb.transpose(2, 0, 1) / 255 - mean) / std, rtol=1e-6, atol=1e-6)
    grey_as_rgb = load_image(_grey_png(tmp_path / "g.png"), InputSpec(3, 8, 8))
    assert grey_as_rgb.shape == (3, 8, 8) and np.array_equal(grey_as_rgb[0], grey_as_rgb[2])


def _grey_png(path: Path) -> Path:
    """A 20x20 grey gradient PNG."""
    Image.fromarray(np.arange(400, dtype=np.uint16).reshape(20, 20).astype(np.uint8)).save(path)
    return path


def test_colour_jpegs_of_camera_size_shrink_to_grey_or_rgb_inputs(tmp_path: Path) -> None:
    (tmp_path / "red.jpg").write_bytes(solid_jpeg((200, 40, 10), 96))
    (tmp_path / "photo.jpg").write_bytes(solid_jpeg((200, 40, 10), 1600))
    for name in ("red.jpg", "photo.jpg"):
        grey = load_image(tmp_path / name, MODEL_INPUT)
        luminance = (0.299 * 200 + 0.587 * 40 + 0.114 * 10) / 255
        assert grey.shape == (1, 28, 28) and abs(float(grey.mean()) - luminance) < 0.05  # pixels / 255
        colour = load_image(tmp_path / name, InputSpec(3, 64, 64, (0.0,), (1.0,)))
        assert colour.shape == (3, 64, 64)
        np.testing.assert_allclose(colour.mean(axis=(1, 2)), np.array([200, 40, 10]) / 255, atol=0.03)


def test_the_folder_pool_stores_what_load_image_gives_for_an_rgb_spec(tmp_path: Path) -> None:
    (tmp_path / "camera").mkdir()
    (tmp_path / "camera" / "red.jpg").write_bytes(solid_jpeg((200, 40, 10), 96))
    Image.fromarray(np.full((50, 60, 3), 77, dtype=np.uint8)).save(tmp_path / "camera" / "grey.png")
    pool = FolderPool(tmp_path / "camera", tmp_path / "store", RGB_SPEC, settle_seconds=0)
    assert pool.scan() == 2 and pool.images().shape == (2, 30, 40, 3)
    files = [tmp_path / "camera" / item.path for item in pool.items]
    assert np.array_equal(
        normalise_records(pool.images(), RGB_SPEC), np.stack([load_image(f, RGB_SPEC) for f in files])
    )
    with pytest.raises(ValueError, match=r"expected uint8 \(N, \(30, 40, 3\)\)"):
        normalise_records(pool.images()[..., 0], RGB_SPEC)


def test_a_folder_read_skips_broken_files_with_reasons_and_leaves_every_file_as_it_was(
    tmp_path: Path, fashion: ImageDataset
) -> None:
    folder = tmp_path / "camera"
    (folder / "sub").mkdir(parents=True)
    (folder / "quarantine").mkdir()
    Image.fromarray(fashion.test_images[0]).save(folder / "a.png")
    (folder / "b.jpg").write_bytes(solid_jpeg((200, 40, 10), 96))
    Image.fromarray(np.full((50, 60, 3), 90, dtype=np.uint8)).save(folder / "sub" / "d.png")
    for ignored in (".hidden.png", "late.jpg.part", "quarantine/q.png"):
        Image.fromarray(fashion.test_images[1]).save(folder / ignored, format="PNG")
    expected = broken_files(folder)
    before = contents(folder)
    read = read_image_folder(folder, MODEL_INPUT)
    assert read.files == ["a.png", "b.jpg", "sub/d.png"] and read.images.shape == (3, 1, 28, 28)
    assert np.array_equal(read.images[0], model_input(fashion.test_images[:1])[0])
    reasons = {skipped.file: skipped.reason for skipped in read.skipped}
    assert set(reasons) == set(expected)
    assert all(expected[name] in reasons[name] and len(reasons[name]) < 250 for name in expected), reasons
    assert contents(folder) == before, "a folder read moves, changes or deletes nothing"
    limited = read_image_folder(folder, MODEL_INPUT, limit=2)
    assert limited.files == ["a.png", "b.jpg"] and [s.file for s in limited.skipped] == ["anim.gif"]


def test_a_folder_without_one_readable_image_is_one_bounded_error(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no readable JPEG or PNG image among 0 files"):
        read_image_folder(tmp_path / "empty", MODEL_INPUT)
    folder = tmp_path / "junk"
    folder.mkdir()
    for number in range(300):
        (folder / f"{number:03d}-{'x' * 200}.jpg").write_text("no picture")
    with pytest.raises(ValueError, match="among 300 files") as raised:
        read_image_folder(folder, MODEL_INPUT)
    assert len(str(raised.value)) < 600 and "\n" not in str(raised.value)
    assert len(list(folder.iterdir())) == 300
    with pytest.raises(UsageError, match="does not exist"):
        read_image_folder(tmp_path / "missing", MODEL_INPUT)


def test_a_broken_file_is_one_unreadable_image_error_naming_it(tmp_path: Path) -> None:
    broken_files(tmp_path)
    with pytest.raises(UnreadableImageError, match=r"cut\.jpg: unreadable or truncated image"):
        load_image(tmp_path / "cut.jpg", RGB_SPEC)


@pytest.fixture(scope="module")
def manifest(tmp_path_factory: pytest.TempPathFactory) -> BundleManifest:
    folder = tmp_path_factory.mktemp("bundle")
    ensure_bundle_files(get_weights(build_model(seed=0)), folder)
    return load_bundle(folder).manifest


def test_the_input_spec_comes_from_a_bundle_manifest_with_one_or_per_channel_statistics(
    manifest: BundleManifest,
) -> None:
    assert InputSpec.from_manifest(manifest) == MODEL_INPUT and InputSpec.from_manifest(manifest).same_as(MODEL_INPUT)
    colour = dataclasses.replace(
        manifest, input_shape=[3, 96, 96], normalisation=Normalisation(1 / 255, [0.4, 0.5, 0.6], [0.2, 0.2, 0.25])
    )
    assert InputSpec.from_manifest(colour) == InputSpec(3, 96, 96, (0.4, 0.5, 0.6), (0.2, 0.2, 0.25))
    assert not InputSpec.from_manifest(colour).same_as(MODEL_INPUT)


@pytest.mark.parametrize(
    ("shape", "norm", "message"),
    [
        ([2, 28, 28], None, "channels \\(1 or 3\\)"),
        ([1, 28], None, "input_shape must be"),
        ([1, 100_000, 100_000], None, "1..4096"),
        ([1, 28, 28], Normalisation(1 / 255, 0.3, 0.0), "std and scale must be positive"),
        ([1, 28, 28], Normalisation(1 / 255, "grey", 0.3), "expected a number"),
        ([3, 28, 28], Normalisation(1 / 255, [0.1, 0.2], 0.3), "mean must be 1 or 3 finite numbers"),
    ],
)
def test_a_manifest_input_the_agent_cannot_read_is_one_error_naming_the_file(
    manifest: BundleManifest, shape: list[int], norm: Normalisation | None, message: str
) -> None:
    bad = dataclasses.replace(manifest, input_shape=shape, normalisation=norm or manifest.normalisation)
    with pytest.raises(ValueError, match=f"^bundle/manifest.json: .*{message}"):
        InputSpec.from_manifest(bad, "bundle/manifest.json")
