# Camera-like colour scenes and fleets: deterministic, sized and balanced, backgrounds blind to the class, oracle layout.
from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from bench.camera_fleet import (
    ANSWERS_FILE,
    CLASSES_FILE,
    POOL_DIR,
    SERVER_FILE,
    SPEC_FILE,
    FleetSettings,
    answer_queries,
    build_fleet,
    device_dir,
    read_answer_key,
)
from bench.camera_scenes import DEFAULT_CLASSES, SceneClass, parse_classes, pick_items, render_scene, render_set
from edge_agent.data.image_arrays import ImageDataset, load_npz_dataset
from edge_agent.field.folder_oracle import FolderOracle, QueryBook
from edge_agent.field.folder_pool import folder_pool_of, open_folder_data
from protocol.model_spec import load_model_spec

CLASS_NAMES = tuple(c.name for c in DEFAULT_CLASSES)


def test_a_class_list_maps_new_names_to_fashion_mnist_classes_by_number_or_name() -> None:
    assert parse_classes("boot=9, bag = Bag") == (SceneClass("boot", 9), SceneClass("bag", 8))


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("boot", "not NAME=FASHION_MNIST_CLASS"),
        ("=9,bag=8", "not NAME=FASHION_MNIST_CLASS"),
        ("boot=11,bag=8", "neither a class number"),
        ("boot=9", "at least 2 classes"),
        ("boot=9,Boot=8", "distinct names"),
        ("boot=9,shoe=Ankle boot", "distinct names and sources"),
    ],
)
def test_a_bad_class_list_is_one_error_naming_it(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_classes(text)


def test_scenes_are_rgb_jpegs_of_the_size_asked_and_the_same_for_a_seed(fashion: ImageDataset) -> None:
    items, labels = fashion.train_images[:12], np.arange(12) % 3
    first = render_set(items, labels, 96, seed=4, stream=1)
    assert first.jpegs == render_set(items, labels, 96, seed=4, stream=1).jpegs
    assert first.jpegs[0] != render_set(items, labels, 96, seed=5, stream=1).jpegs[0]
    assert render_set(items[3:5], labels[3:5], 96, seed=4, stream=1).jpegs[0] != first.jpegs[3], "i seeds scene i"
    for jpeg in first.jpegs + render_set(items[:2], labels[:2], 64, seed=4, stream=1).jpegs:
        with Image.open(io.BytesIO(jpeg)) as image:
            assert image.format == "JPEG" and image.mode == "RGB" and image.size in ((96, 96), (64, 64))
    assert first.arrays().shape == (12, 96, 96, 3) and first.arrays().dtype == np.uint8
    with pytest.raises(ValueError, match="32..512"):
        render_scene(items[0], 20, np.random.default_rng(0))


def class_dependence(values: np.ndarray, labels: np.ndarray) -> float:
    """The largest one-way ANOVA F statistic over the columns of values grouped by label (about 1 when independent)."""
    groups = [values[labels == label] for label in np.unique(labels)]
    between = sum(len(g) * (g.mean(axis=0) - values.mean(axis=0)) ** 2 for g in groups) / (len(groups) - 1)
    within = sum(((g - g.mean(axis=0)) ** 2).sum(axis=0) for g in groups) / (len(values) - len(groups))
    return float(np.max(between / within))


def test_classes_are_balanced_and_the_background_says_nothing_about_the_class(fashion: ImageDataset) -> None:
    indices, labels = pick_items(fashion.train_labels, DEFAULT_CLASSES, 60, np.random.default_rng(0))
    assert np.bincount(labels).tolist() == [60] * 5 and len(set(indices.tolist())) == 300
    assert all(fashion.train_labels[i] == DEFAULT_CLASSES[c].source for i, c in zip(indices, labels))
    pixels = render_set(fashion.train_images[indices], labels, 64, seed=0, stream=1).arrays().astype(np.float32)
    frame = np.ones((64, 64), dtype=bool)
    frame[3:-3, 3:-3] = False
    border = pixels[:, frame].mean(axis=1)
    assert class_dependence(border, labels) < 3.0, "background colours must not depend on the class"
    assert class_dependence(border + 40.0 * labels[:, None], labels) > 30.0, "the check sees a class-coloured border"
    assert border.std(axis=0).min() > 30, "backgrounds vary in colour"


def test_a_fleet_has_a_pool_per_device_an_answer_key_a_test_set_and_the_class_list(
    tmp_path: Path, fashion: ImageDataset
) -> None:
    settings = FleetSettings(devices=2, per_class=3, test_per_class=2, size=64, seed=1, server_per_class=4)
    summary = build_fleet(tmp_path / "a", settings, fashion)
    assert [d["images"] for d in summary["devices"]] == [15, 15] and summary["test_images"] == 10
    assert summary["server_images"] == 20
    keys = [read_answer_key(device_dir(tmp_path / "a", n) / ANSWERS_FILE, CLASS_NAMES) for n in range(2)]
    for number, key in enumerate(keys):
        pool = device_dir(tmp_path / "a", number) / POOL_DIR
        assert sorted(key) == sorted(path.name for path in pool.iterdir())
        assert np.bincount(list(key.values())).tolist() == [3] * 5
    spec = load_model_spec(tmp_path / "a" / SPEC_FILE).spec
    assert spec.class_names == list(CLASS_NAMES) and spec.image_shape == (64, 64, 3)
    server = load_npz_dataset(tmp_path / "a" / SERVER_FILE, spec.image_shape, spec.num_classes)
    assert server.test_images.shape == (10, 64, 64, 3) and np.bincount(server.test_labels).tolist() == [2] * 5
    assert server.train_images.shape == (20, 64, 64, 3) and np.bincount(server.train_labels).tolist() == [4] * 5
    assert json.loads((tmp_path / "a" / CLASSES_FILE).read_text())["class_names"] == list(CLASS_NAMES)
    build_fleet(tmp_path / "b", settings, fashion)
    files = sorted(p.relative_to(tmp_path / "a") for p in (tmp_path / "a").rglob("*") if p.is_file())
    assert all((tmp_path / "a" / f).read_bytes() == (tmp_path / "b" / f).read_bytes() for f in files), "deterministic"


def test_the_bench_person_answers_a_folder_oracle_from_the_answer_key(tmp_path: Path, fashion: ImageDataset) -> None:
    build_fleet(
        tmp_path / "fleet",
        FleetSettings(devices=1, per_class=2, test_per_class=1, size=64, server_per_class=1),
        fashion,
    )
    device = device_dir(tmp_path / "fleet", 0)
    data = open_folder_data(tmp_path / "state", device / POOL_DIR, pool_cap=100, settle_seconds=0)
    book = QueryBook(tmp_path / "labelling", CLASS_NAMES)
    oracle = FolderOracle(book, data, wait_seconds=0)
    asked = data.pool_indices()[:4]
    oracle.ask(asked)
    key = read_answer_key(device / ANSWERS_FILE, CLASS_NAMES)
    assert answer_queries(book, key) == 4 and book.pending() == []
    indices, labels = oracle.collect()
    assert indices.tolist() == sorted(asked.tolist())
    assert labels.tolist() == [key[folder_pool_of(data).item(int(i)).path] for i in indices]


def test_a_bad_answer_key_line_is_one_error_naming_it(tmp_path: Path) -> None:
    (tmp_path / "answers.csv").write_text("file,label\na.jpg,boot\nb.jpg,hat\n")
    with pytest.raises(ValueError, match=r"answers.csv: line 3: label 'hat' is neither"):
        read_answer_key(tmp_path / "answers.csv", CLASS_NAMES)
    (tmp_path / "answers.csv").write_text("file,label\na.jpg\n")
    with pytest.raises(ValueError, match="line 2 has 1 columns"):
        read_answer_key(tmp_path / "answers.csv", CLASS_NAMES)
