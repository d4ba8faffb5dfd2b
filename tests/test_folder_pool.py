# The folder pool on real PNG/JPEG files written here: decoding, quarantine, stable indices, the size cap, crash cuts.
from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from edge_agent.data.fashion_mnist import load_fashion_mnist
from edge_agent.data.image_files import MODEL_INPUT, InputSpec, UnreadableImageError, decode_image
from edge_agent.field import folder_pool
from edge_agent.field.folder_oracle import FolderOracle, QueryBook
from edge_agent.field.folder_pool import FolderPool, folder_pool_of, open_folder_data
from protocol.errors import UsageError


@pytest.fixture(scope="module")
def fashion():
    dataset = load_fashion_mnist()
    return dataset.test_images[:40], dataset.test_labels[:40].astype(np.int64)


def write_png(path: Path, image: np.ndarray, age_seconds: float = 10.0) -> Path:
    """A real PNG of a uint8 image, dated age_seconds ago (so it counts as settled)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(image).save(path, format="PNG")
    stamp = time.time() - age_seconds
    os.utime(path, (stamp, stamp))
    return path


def camera_oracle(folder: Path, images: int) -> FolderOracle:
    """A folder oracle over `images` real Fashion-MNIST PNGs in folder/camera (the first the oldest), with the
    device's state and query book beside them; it answers without waiting."""
    pictures = load_fashion_mnist().test_images
    for i in range(images):
        write_png(folder / "camera" / f"{i}.png", pictures[i], age_seconds=30 - i)
    data = open_folder_data(folder / "state", folder / "camera", pool_cap=10, settle_seconds=0)
    return FolderOracle(QueryBook(folder / "labelling"), data, wait_seconds=0)


def write_jpeg(path: Path, image: np.ndarray) -> Path:
    """A real colour JPEG, twice the size of the grayscale image, as a camera would write it."""
    big = Image.fromarray(image).resize((56, 56), Image.Resampling.BILINEAR).convert("RGB")
    big.save(path, format="JPEG", quality=95)
    stamp = time.time() - 10
    os.utime(path, (stamp, stamp))
    return path


def test_png_decodes_exactly_and_a_colour_jpeg_decodes_to_a_close_grayscale_28x28(tmp_path, fashion):
    images, _ = fashion
    png = decode_image(write_png(tmp_path / "a.png", images[0]), MODEL_INPUT)
    assert png.dtype == np.uint8 and png.shape == (28, 28) and np.array_equal(png, images[0])
    jpeg = decode_image(write_jpeg(tmp_path / "b.jpg", images[1]), MODEL_INPUT)
    assert jpeg.shape == (28, 28)
    error = np.abs(jpeg.astype(int) - images[1].astype(int)).mean()
    assert error < 16, error
    other = np.abs(jpeg.astype(int) - images[2].astype(int)).mean()
    assert other > 4 * error


def test_truncated_png_and_non_image_are_unreadable_and_gif_is_refused(tmp_path, fashion):
    good = write_png(tmp_path / "good.png", fashion[0][0]).read_bytes()
    (tmp_path / "cut.png").write_bytes(good[: len(good) // 2])
    (tmp_path / "notes.txt").write_text("not an image\n")
    Image.fromarray(fashion[0][0]).save(tmp_path / "x.gif", format="GIF")
    with pytest.raises(UnreadableImageError, match="truncated"):
        decode_image(tmp_path / "cut.png", MODEL_INPUT)
    with pytest.raises(UnreadableImageError, match="not an image"):
        decode_image(tmp_path / "notes.txt", MODEL_INPUT)
    with pytest.raises(UnreadableImageError, match="GIF is not JPEG or PNG"):
        decode_image(tmp_path / "x.gif", MODEL_INPUT)


def test_bad_files_are_quarantined_with_a_log_line_and_never_deleted(tmp_path, fashion, caplog):
    images, _ = fashion
    pool_dir = tmp_path / "camera"
    write_png(pool_dir / "0.png", images[0])
    write_jpeg(pool_dir / "1.jpg", images[1])
    (pool_dir / "day2").mkdir()
    truncated = write_jpeg(pool_dir / "day2" / "2.jpg", images[2])
    whole = truncated.read_bytes()
    truncated.write_bytes(whole[: len(whole) // 3])
    (pool_dir / "readme.txt").write_bytes(b"camera notes")
    for path in (truncated, pool_dir / "readme.txt"):
        os.utime(path, (time.time() - 10, time.time() - 10))
    with caplog.at_level(logging.WARNING, logger="edge_agent.field.folder_pool"):
        pool = FolderPool(pool_dir, tmp_path / "store")
        assert pool.scan() == 2
    assert [item.path for item in pool.items] == ["0.png", "1.jpg"]
    quarantine = pool_dir / "quarantine"
    assert (quarantine / "day2" / "2.jpg").read_bytes() == whole[: len(whole) // 3]
    assert (quarantine / "readme.txt").read_bytes() == b"camera notes"
    assert not truncated.exists() and (pool_dir / "0.png").is_file() and (pool_dir / "1.jpg").is_file()
    quarantined = [r.getMessage() for r in caplog.records if "quarantined" in r.getMessage()]
    assert len(quarantined) == 2 and any("day2/2.jpg" in line and "truncated" in line for line in quarantined)
    assert pool.scan() == 0, "the quarantine folder is not scanned again"


def test_new_files_join_with_stable_indices_duplicates_and_unsettled_files_wait(tmp_path, fashion):
    images, _ = fashion
    pool_dir = tmp_path / "camera"
    for i in range(3):
        write_png(pool_dir / f"{i}.png", images[i], age_seconds=30 - i)
    pool = FolderPool(pool_dir, tmp_path / "store", settle_seconds=5)
    assert pool.scan() == 3
    write_png(pool_dir / "copy-of-0.png", images[0])
    fresh = write_png(pool_dir / "fresh.png", images[3], age_seconds=0)
    assert pool.scan() == 0, "a duplicate adds nothing and a file written just now waits"
    os.utime(fresh, (time.time() - 10, time.time() - 10))
    assert pool.scan() == 1
    reopened = FolderPool(pool_dir, tmp_path / "store", settle_seconds=5)
    assert [item.path for item in reopened.items] == ["0.png", "1.png", "2.png", "fresh.png"]
    assert np.array_equal(reopened.images(), images[[0, 1, 2, 3]])
    assert reopened.scan() == 0
    copied = reopened.read(np.array([3, 0]))
    copied[:] = 0  # a copy: the store's mapped pages (released after each read) still read back the images
    assert np.array_equal(reopened.read(np.array([3, 0])), images[[3, 0]])
    assert np.array_equal(reopened.images()[1], images[1])


def test_a_large_scan_appends_a_batch_at_a_time_and_stores_what_one_append_would(tmp_path, fashion, monkeypatch):
    """A first scan of a camera's whole folder once held every decoded image (392 MB at a Pi Zero's 4000): it now
    appends SCAN_BATCH at a time, and the store reads back the same images, digests and order."""
    images, _ = fashion
    pool_dir = tmp_path / "camera"
    for i in range(10):
        write_png(pool_dir / f"{i}.png", images[i], age_seconds=30 - i)
    write_png(pool_dir / "copy.png", images[4], age_seconds=1)  # a duplicate among them joins nowhere
    whole = FolderPool(pool_dir, tmp_path / "whole", settle_seconds=0)
    assert whole.scan() == 10
    monkeypatch.setattr(folder_pool, "SCAN_BATCH", 4)
    held: list[int] = []
    append = FolderPool._append
    monkeypatch.setattr(
        FolderPool, "_append", lambda pool, items, records: held.append(len(records)) or append(pool, items, records)
    )
    batched = FolderPool(pool_dir, tmp_path / "batched", settle_seconds=0)
    assert batched.scan() == 10 and held == [4, 4, 2]
    reopened = FolderPool(pool_dir, tmp_path / "batched", settle_seconds=0)
    assert reopened.items == whole.items and np.array_equal(reopened.images(), images[:10])
    assert np.array_equal(reopened.digests(np.arange(10)), whole.digests(np.arange(10)))


def test_a_crash_mid_append_is_cut_off_on_open(tmp_path, fashion):
    images, _ = fashion
    pool_dir = tmp_path / "camera"
    for i in range(2):
        write_png(pool_dir / f"{i}.png", images[i])
    store = tmp_path / "store"
    FolderPool(pool_dir, store, settle_seconds=0).scan()
    with open(store / FolderPool.IMAGES_FILE, "ab") as handle:
        handle.write(images[5].tobytes())
    with open(store / FolderPool.ITEMS_FILE, "ab") as handle:
        handle.write(b'{"path": "5.png", "sha')
    pool = FolderPool(pool_dir, store, settle_seconds=0)
    assert len(pool) == 2 and np.array_equal(pool.images(), images[:2])
    assert (store / FolderPool.IMAGES_FILE).stat().st_size == 2 * 28 * 28
    (store / FolderPool.IMAGES_FILE).write_bytes(b"")
    with pytest.raises(ValueError, match="damaged"):
        FolderPool(pool_dir, store)


def test_device_data_over_a_folder_caps_the_pool_oldest_out_and_keeps_labels(tmp_path, fashion):
    images, labels = fashion
    pool_dir = tmp_path / "camera"
    for i in range(5):
        write_png(pool_dir / f"{i:02d}.png", images[i], age_seconds=50 - i)
    data = open_folder_data(tmp_path / "state", pool_dir, pool_cap=3, settle_seconds=0)
    assert data.num_samples == 5 and data.pool_indices().tolist() == [2, 3, 4]
    data.add_labels(np.array([4]), labels[[4]])
    assert data.pool_indices().tolist() == [1, 2, 3]
    for i in range(5, 8):
        write_png(pool_dir / f"{i:02d}.png", images[i], age_seconds=10 - i)
    assert data.refresh() == 3
    assert data.pool_indices().tolist() == [5, 6, 7]
    assert np.array_equal(data.images(np.array([6])), images[[6]])
    assert sorted(p.name for p in pool_dir.glob("*.png")) == [f"{i:02d}.png" for i in range(8)]
    reopened = open_folder_data(tmp_path / "state", pool_dir, pool_cap=3, settle_seconds=0)
    assert reopened.labelled()[0].tolist() == [4] and reopened.labelled()[1].tolist() == [labels[4]]
    assert folder_pool_of(reopened).item(4).path == "04.png"


def test_folder_store_refuses_shard_state_and_takes_the_specs_input_shape(tmp_path, fashion):
    from edge_agent.data.device_data import DeviceData

    (tmp_path / "camera").mkdir()
    DeviceData.create(tmp_path / "bench", fashion[0][:3])
    with pytest.raises(ValueError, match="shard's device data"):
        open_folder_data(tmp_path / "bench", tmp_path / "camera", pool_cap=10)
    Image.new("RGB", (64, 48), (200, 40, 10)).save(tmp_path / "camera" / "a.png")
    colour = open_folder_data(tmp_path / "s", tmp_path / "camera", 10, InputSpec(3, 32, 32), 0.0, (), 5)
    assert colour.image_shape == (32, 32, 3) and colour.num_classes == 5 and colour.num_samples == 1
    with pytest.raises(UsageError, match="does not exist"):
        open_folder_data(tmp_path / "s", tmp_path / "missing", pool_cap=10)


def test_folder_store_refuses_a_foreign_normalisation(tmp_path):
    (tmp_path / "camera").mkdir()
    with pytest.raises(ValueError, match=r"1x28x28, \(pixel / 255 - \[0.5\]\) / \[0.5\]"):
        open_folder_data(tmp_path / "s", tmp_path / "camera", 10, InputSpec(1, 28, 28, (0.5,), (0.5,)))
    assert sorted(path.name for path in tmp_path.iterdir()) == ["camera"], "nothing was created"
