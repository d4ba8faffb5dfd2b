# `edge-agent score --pool DIR` on PNG/JPEG folders, torch unimportable: the selection by file, broken files reported.
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from fleet import WITHOUT_TORCH
from picture_files import broken_files, contents, solid_jpeg
from PIL import Image

from edge_agent.data.image_arrays import ImageDataset
from edge_agent.learning.models import build_model, get_weights
from edge_agent.score_command import score_pool
from export.bundle_writer import ensure_bundle_files

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("bundle")
    ensure_bundle_files(get_weights(build_model(seed=0)), folder)
    return folder


def camera_folder(folder: Path, images: np.ndarray) -> list[str]:
    """Grey PNGs of images as 000.png, 001.png, ..., then two colour JPEGs of camera size; returns the names."""
    folder.mkdir(parents=True)
    names = [f"{index:03d}.png" for index in range(len(images))]
    for name, image in zip(names, images):
        Image.fromarray(image).save(folder / name)
    for name, colour in (("cam-1.jpg", (200, 40, 10)), ("cam-2.jpg", (20, 90, 220))):
        (folder / name).write_bytes(solid_jpeg(colour, 96))
    return names + ["cam-1.jpg", "cam-2.jpg"]


def run_score(bundle: Path, pool: Path, *extra: str) -> subprocess.CompletedProcess:
    """`edge-agent score` in a process where torch cannot be imported."""
    command = [
        sys.executable,
        "-c",
        WITHOUT_TORCH,
        "edge_agent",
        "score",
        "--bundle",
        str(bundle),
        "--pool",
        str(pool),
        "--json",
    ]
    return subprocess.run(command + list(extra), capture_output=True, text=True, timeout=120, cwd=ROOT)


def test_score_over_a_folder_without_torch_names_the_selected_files_and_the_skipped_ones(
    tmp_path: Path, bundle: Path, fashion: ImageDataset
) -> None:
    folder = tmp_path / "camera"
    names = camera_folder(folder, fashion.test_images[:30])
    expected = broken_files(folder)
    before = contents(folder)
    done = run_score(bundle, folder, "--passes", "3", "--top", "7")
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout)
    assert (result["backend"], result["images"], result["selected"], result["skipped"]) == ("onnxruntime", 32, 7, 7)
    assert result["files"] == [sorted(names)[index] for index in result["indices"]]
    assert {entry["file"]: entry["reason"] for entry in result["skipped_files"]}.keys() == expected.keys()
    assert all(expected[entry["file"]] in entry["reason"] for entry in result["skipped_files"])
    assert contents(folder) == before, "scoring a folder moves, changes or deletes nothing"


def test_a_folder_of_pngs_scores_exactly_as_the_same_images_as_an_array(
    tmp_path: Path, bundle: Path, fashion: ImageDataset
) -> None:
    images = fashion.test_images[100:160]
    (tmp_path / "pngs").mkdir()
    for index, image in enumerate(images):
        Image.fromarray(image).save(tmp_path / "pngs" / f"{index:03d}.png")
    np.save(tmp_path / "pool.npy", images)
    from_folder = score_pool(bundle, tmp_path / "pngs", passes=4, top=12, sampler="entropy", seed=5)
    from_array = score_pool(bundle, tmp_path / "pool.npy", passes=4, top=12, sampler="entropy", seed=5)
    assert from_folder["indices"] == from_array["indices"] and from_folder["skipped"] == 0
    assert from_folder["files"] == [f"{index:03d}.png" for index in from_array["indices"]]
    assert "files" not in from_array
    limited = score_pool(bundle, tmp_path / "pngs", passes=2, top=5, sampler="entropy", limit=20)
    assert limited["images"] == 20 and set(limited["files"]) <= {f"{index:03d}.png" for index in range(20)}


def test_a_folder_without_a_readable_image_is_one_line_and_loses_nothing(tmp_path: Path, bundle: Path) -> None:
    folder = tmp_path / "junk"
    folder.mkdir()
    broken_files(folder)
    before = contents(folder)
    done = run_score(bundle, folder)
    assert done.returncode == 2 and done.stdout == ""
    assert "no readable JPEG or PNG image among 7 files" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and len(done.stderr) < 600
    assert contents(folder) == before
