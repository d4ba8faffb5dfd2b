# Tests for the data rooms: IDX reading on the real Fashion-MNIST files, atomic I/O, shards, the device store.
from __future__ import annotations

import gzip
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

from bench.shard import Shard, load_shard, open_device_data, save_shard
from edge_agent.data.device_data import LABELS_FILE, STATE_FILE, DeviceData
from edge_agent.data.fashion_mnist import (
    CLASS_NAMES,
    DEFAULT_DATA_DIR,
    DatasetMissingError,
    load_fashion_mnist,
    read_idx,
)
from edge_agent.data.image_arrays import model_input
from edge_agent.learning.models import build_model
from protocol import files
from protocol.errors import UsageError
from protocol.files import atomic_write_bytes, load_arrays, save_arrays

TEST_IMAGES = DEFAULT_DATA_DIR / "t10k-images-idx3-ubyte.gz"
TEST_LABELS = DEFAULT_DATA_DIR / "t10k-labels-idx1-ubyte.gz"


@pytest.fixture(scope="module")
def test_split() -> tuple[np.ndarray, np.ndarray]:
    """The real Fashion-MNIST test split (10000 images), read once per module."""
    return read_idx(TEST_IMAGES), read_idx(TEST_LABELS)


def idx_bytes(array: np.ndarray) -> bytes:
    """A uint8 array encoded as an IDX file, the way the dataset's files are laid out."""
    header = struct.pack(">BBBB", 0, 0, 0x08, array.ndim) + struct.pack(f">{array.ndim}I", *array.shape)
    return header + array.astype(np.uint8).tobytes()


def test_read_idx_real_test_split(test_split):
    images, labels = test_split
    assert images.shape == (10000, 28, 28) and images.dtype == np.uint8
    assert labels.shape == (10000,) and labels.dtype == np.uint8
    assert np.array_equal(np.bincount(labels), np.full(10, 1000))
    assert images.min() == 0 and images.max() == 255
    # The first test image is an ankle boot (class 9) in every published copy of the data set.
    assert labels[0] == 9 and CLASS_NAMES[labels[0]] == "Ankle boot"


def test_read_idx_plain_and_gzip_round_trip(tmp_path, test_split):
    images = test_split[0][:7]
    (tmp_path / "plain-idx3").write_bytes(idx_bytes(images))
    (tmp_path / "zipped-idx3.gz").write_bytes(gzip.compress(idx_bytes(images)))
    assert np.array_equal(read_idx(tmp_path / "plain-idx3"), images)
    assert np.array_equal(read_idx(tmp_path / "zipped-idx3.gz"), images)


def test_read_idx_truncated_file_names_it(tmp_path, test_split):
    path = tmp_path / "cut-images-idx3-ubyte.gz"
    path.write_bytes(gzip.compress(idx_bytes(test_split[0][:5])[:-100]))
    with pytest.raises(ValueError, match="cut-images-idx3-ubyte.gz.*truncated"):
        read_idx(path)


def test_read_idx_rejects_bad_header(tmp_path):
    bad_magic = tmp_path / "bad-magic"
    bad_magic.write_bytes(b"\x01\x00\x08\x01" + struct.pack(">I", 3) + b"abc")
    bad_code = tmp_path / "bad-code"
    bad_code.write_bytes(b"\x00\x00\x07\x01" + struct.pack(">I", 3) + b"abc")
    with pytest.raises(ValueError, match="bad-magic.*magic"):
        read_idx(bad_magic)
    with pytest.raises(ValueError, match="bad-code.*0x07"):
        read_idx(bad_code)


def test_read_idx_corrupt_gzip_names_file(tmp_path):
    path = tmp_path / "broken.gz"
    path.write_bytes(b"\x1f\x8b" + b"not gzip at all")
    with pytest.raises(ValueError, match="broken.gz"):
        read_idx(path)


def test_load_fashion_mnist_real():
    dataset = load_fashion_mnist()
    assert dataset.train_images.shape == (60000, 28, 28)
    assert np.array_equal(np.bincount(dataset.train_labels), np.full(10, 6000))
    assert dataset.test_images.shape == (10000, 28, 28)


def test_missing_data_dir_says_how_to_fix(tmp_path):
    missing = tmp_path / "nowhere"
    with pytest.raises(DatasetMissingError) as caught:
        load_fashion_mnist(missing)
    message = str(caught.value)
    assert isinstance(caught.value, UsageError)
    assert "apt-get install dataset-fashion-mnist" in message and "--data-dir" in message
    assert str(missing / "train-images-idx3-ubyte.gz") in message
    assert "\n" not in message


def test_model_input_scales_pixels_and_the_default_models_standardisation_matches_the_dataset(test_split):
    images = test_split[0]
    out = model_input(images[:2000])
    assert out.shape == (2000, 1, 28, 28) and out.dtype == np.float32
    assert out.min() == 0.0 and out.max() == 1.0
    standardised = build_model().standardise(torch.from_numpy(out)).numpy()
    assert standardised[0, 0, 0, 0] == pytest.approx((0 / 255 - 0.2860) / 0.3530)
    assert abs(float(standardised.mean())) < 0.05 and abs(float(standardised.std()) - 1.0) < 0.05
    colour = np.zeros((2, 8, 8, 3), dtype=np.uint8)
    colour[:, :, :, 2] = 255
    channels_first = model_input(colour)
    assert (
        channels_first.shape == (2, 3, 8, 8)
        and np.all(channels_first[:, 2] == 1.0)
        and np.all(channels_first[:, :2] == 0)
    )
    with pytest.raises(ValueError, match="uint8"):
        model_input(images[:3].astype(np.float32))


def test_atomic_write_replaces_content(tmp_path):
    path = tmp_path / "file.bin"
    atomic_write_bytes(path, b"old")
    atomic_write_bytes(path, b"new content")
    assert path.read_bytes() == b"new content"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file.bin"]


def test_atomic_write_failure_midway_keeps_old_file(tmp_path, monkeypatch):
    path = tmp_path / "file.bin"
    atomic_write_bytes(path, b"old")
    seen_temp_contents = []

    def failing_fsync(fd: int) -> None:
        temps = [p for p in tmp_path.iterdir() if p.name != "file.bin"]
        seen_temp_contents.extend(p.read_bytes() for p in temps)
        raise OSError(5, "simulated I/O error while writing")

    monkeypatch.setattr(files.os, "fsync", failing_fsync)
    with pytest.raises(OSError, match="simulated"):
        atomic_write_bytes(path, b"new data that never lands")
    monkeypatch.undo()
    assert seen_temp_contents == [b"new data that never lands"]  # the failure really came midway
    assert path.read_bytes() == b"old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file.bin"]


def test_save_and_load_arrays_round_trip(tmp_path):
    arrays = {"conv1.weight": np.arange(24, dtype=np.float32).reshape(2, 3, 4), "count": np.int64(7)}
    save_arrays(tmp_path / "a.npz", arrays)
    loaded = load_arrays(tmp_path / "a.npz")
    assert set(loaded) == {"conv1.weight", "count"}
    assert np.array_equal(loaded["conv1.weight"], arrays["conv1.weight"]) and loaded["conv1.weight"].dtype == np.float32
    assert int(loaded["count"]) == 7


def test_save_arrays_refuses_objects_and_keeps_old_file(tmp_path):
    path = tmp_path / "a.npz"
    save_arrays(path, {"x": np.ones(3)})
    with pytest.raises(ValueError, match="object dtype"):
        save_arrays(path, {"x": np.array([{"a": 1}], dtype=object)})
    assert np.array_equal(load_arrays(path)["x"], np.ones(3))


def test_load_arrays_corrupt_file_names_it(tmp_path):
    path = tmp_path / "weights.npz"
    save_arrays(path, {"x": np.arange(1000, dtype=np.int64)})
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    path.write_bytes(bytes(raw))
    with pytest.raises(ValueError, match="weights.npz"):
        load_arrays(path)
    garbage = tmp_path / "garbage.npz"
    garbage.write_bytes(b"this is no archive")
    with pytest.raises(ValueError, match="garbage.npz"):
        load_arrays(garbage)


def test_shard_round_trip_and_validation(tmp_path, test_split):
    images, labels = test_split[0][:50], test_split[1][:50]
    save_shard(tmp_path / "device-0.npz", Shard(images, labels))
    loaded = load_shard(tmp_path / "device-0.npz")
    assert np.array_equal(loaded.images, images) and np.array_equal(loaded.labels, labels)
    assert loaded.seed_images.shape == (0, 28, 28) and len(loaded.seed_labels) == 0
    with pytest.raises(ValueError, match="labels"):
        save_shard(tmp_path / "bad.npz", Shard(images, labels[:49]))
    with pytest.raises(ValueError, match="images"):
        save_shard(tmp_path / "bad.npz", Shard(images.astype(np.float32), labels))
    with pytest.raises(ValueError, match="seeds"):
        save_shard(tmp_path / "bad.npz", Shard(images, labels, images[:3], labels[:2]))
    save_arrays(tmp_path / "odd.npz", {"images": images})
    with pytest.raises(ValueError, match="odd.npz"):
        load_shard(tmp_path / "odd.npz")
    assert not (tmp_path / "bad.npz").exists()


def test_device_data_persists_across_reopen(tmp_path, test_split):
    images, truth = test_split[0][:200], test_split[1][:200]
    device = DeviceData.create(tmp_path / "state", images)
    assert device.num_labelled == 0 and np.array_equal(device.pool_indices(), np.arange(200))
    picked = np.array([150, 3, 77, 20])
    device.add_labels(picked, truth[picked])
    device.set_state("last_round", 4)

    reopened = DeviceData.open(tmp_path / "state")
    indices, labels = reopened.labelled()
    assert indices.tolist() == [150, 3, 77, 20] and np.array_equal(labels, truth[picked])
    assert reopened.get_state("last_round") == 4 and reopened.get_state("absent", "dflt") == "dflt"
    assert np.array_equal(reopened.pool_indices(), np.setdiff1d(np.arange(200), picked))
    assert np.array_equal(reopened.images(np.array([77, 3])), images[[77, 3]])
    assert np.array_equal(reopened.class_counts(), np.bincount(truth[picked], minlength=10))


def test_device_data_open_or_create(tmp_path, test_split):
    images, truth = test_split[0][:60], test_split[1][:60]
    first = DeviceData.open_or_create(tmp_path / "s", images)
    first.add_labels(np.array([5]), truth[[5]])
    again = DeviceData.open_or_create(tmp_path / "s", images)
    assert again.labelled()[0].tolist() == [5]
    with pytest.raises(ValueError, match="holds 60 images but 59"):
        DeviceData.open_or_create(tmp_path / "s", images[:59])
    with pytest.raises(FileExistsError):
        DeviceData.create(tmp_path / "s", images)
    with pytest.raises(FileNotFoundError, match="create it first"):
        DeviceData.open(tmp_path / "never-made")


@pytest.mark.parametrize(
    ("indices", "labels", "message"),
    [
        ([10, 2], [1, 1], "already labelled"),
        ([11, 200], [1, 1], "out of range"),
        ([11, -1], [1, 1], "out of range"),
        ([11, 12], [1, 10], r"\[0, 10\)"),
        ([11, 11], [1, 1], "repeat"),
        ([11, 12], [1], "2 indices but 1 labels"),
    ],
)
def test_add_labels_bad_input_changes_nothing(tmp_path, test_split, indices, labels, message):
    device = DeviceData.create(tmp_path / "state", test_split[0][:200])
    device.add_labels(np.array([2, 3]), np.array([4, 4]))
    labels_file = tmp_path / "state" / LABELS_FILE
    before = labels_file.read_bytes()
    with pytest.raises(ValueError, match=message):
        device.add_labels(np.array(indices), np.array(labels))
    assert labels_file.read_bytes() == before
    for view in (device, DeviceData.open(tmp_path / "state")):
        assert view.labelled()[0].tolist() == [2, 3]
        assert view.replay()[0].tolist() == [2, 3]
        assert len(view.pool_indices()) == 198


def test_replay_set_is_first_come_five_per_class(tmp_path, test_split):
    images, truth = test_split[0][:300], test_split[1][:300]
    device = DeviceData.create(tmp_path / "state", images, replay_per_class=5)
    order = np.random.default_rng(3).permutation(300)
    for batch in np.array_split(order, 7):
        device.add_labels(batch, truth[batch])
    replay_indices, replay_labels = DeviceData.open(tmp_path / "state").replay()
    assert np.array_equal(replay_labels, truth[replay_indices])
    for cls in range(10):
        expected = [int(i) for i in order if truth[i] == cls][:5]
        assert sorted(replay_indices[replay_labels == cls].tolist()) == sorted(expected)
    assert device.num_labelled == 300 and len(device.pool_indices()) == 0


def test_add_labels_is_one_atomic_write(tmp_path, test_split, monkeypatch):
    device = DeviceData.create(tmp_path / "state", test_split[0][:40])

    def failing_replace(source: str, target: Path) -> None:
        raise OSError("disk gone")

    monkeypatch.setattr(files.os, "replace", failing_replace)
    with pytest.raises(OSError, match="disk gone"):
        device.add_labels(np.array([1, 2]), np.array([0, 1]))
    monkeypatch.undo()
    assert device.num_labelled == 0 and len(device.pool_indices()) == 40
    assert DeviceData.open(tmp_path / "state").num_labelled == 0
    device.add_labels(np.array([1, 2]), np.array([0, 1]))
    assert DeviceData.open(tmp_path / "state").labelled()[0].tolist() == [1, 2]


def test_set_state_rejects_non_json_and_keeps_state(tmp_path, test_split):
    device = DeviceData.create(tmp_path / "state", test_split[0][:10])
    device.set_state("last_round", 2)
    with pytest.raises(ValueError, match="'bad'.*JSON"):
        device.set_state("bad", {1, 2})
    assert device.get_state("bad") is None
    assert DeviceData.open(tmp_path / "state").get_state("last_round") == 2


def test_corrupt_state_files_are_named(tmp_path, test_split):
    DeviceData.create(tmp_path / "state", test_split[0][:10])
    (tmp_path / "state" / STATE_FILE).write_text("{not json")
    with pytest.raises(ValueError, match="state.json"):
        DeviceData.open(tmp_path / "state")


def test_seeds_are_labelled_once_as_seed_and_fill_the_replay_set(tmp_path, test_split):
    images, labels = test_split[0], test_split[1]
    seed_at = np.concatenate([np.flatnonzero(labels == c)[:2] for c in range(10)])
    pool = np.setdiff1d(np.arange(60), seed_at)
    shard = Shard(images[pool], labels[pool], images[seed_at], labels[seed_at])
    device = open_device_data(tmp_path / "state", shard)
    assert device.num_labelled == 20 and device.count_labels("seed") == 20 and device.count_labels("oracle") == 0
    assert len(device.pool_indices()) == len(pool)
    replay_indices, replay_labels = device.replay()
    assert np.bincount(replay_labels, minlength=10).tolist() == [2] * 10
    assert set(replay_indices.tolist()) == set(shard.seed_indices.tolist())
    device.add_labels(device.pool_indices()[:5], shard.labels[:5])
    reopened = open_device_data(tmp_path / "state", shard)
    assert reopened.count_labels("seed") == 20 and reopened.count_labels("oracle") == 5
    assert reopened.num_labelled == 25
    with pytest.raises(ValueError, match="unknown label source"):
        reopened.add_labels(reopened.pool_indices()[:1], shard.labels[5:6], source="guess")
    assert reopened.num_labelled == 25


def test_read_idx_with_a_limit_reads_only_the_first_items(tmp_path, test_split):
    images = test_split[0][:6]
    path = tmp_path / "cut-images-idx3-ubyte.gz"
    path.write_bytes(gzip.compress(idx_bytes(images)[:-100]))
    assert np.array_equal(read_idx(path, limit=4), images[:4]), "the cut beyond the limit is never read"
    with pytest.raises(ValueError, match="truncated"):
        read_idx(path, limit=6)
    whole = tmp_path / "whole-idx3.gz"
    whole.write_bytes(gzip.compress(idx_bytes(images)))
    assert np.array_equal(read_idx(whole, limit=100), images)
