# `fl-coordinator dataset`: a team's photo folders or CSV into the server's .npz, every bad input reported or refused.
from __future__ import annotations

import csv
import logging
import subprocess
import sys
import zlib
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from coordinator.setup.server_data import load_server_data
from coordinator.setup.settings import ServerSettings
from coordinator.setup.site_dataset import MIN_CLASS_IMAGES
from coordinator.setup.site_images import SiteDataset, build_site_dataset
from coordinator.setup.site_report import summary_lines
from edge_agent.data.image_arrays import load_npz_dataset
from edge_agent.data.image_files import InputSpec, decode_image, read_image_folder
from protocol.errors import UsageError
from protocol.model_spec import ModelSpec, load_model_spec

CLASSES = ["cat", "dog", "bird", "fish", "frog"]
SIDE = 16
SPEC_TOML = f"""[model]
architecture = "rgb-cnn"
[input]
channels = 3
height = {SIDE}
width = {SIDE}
mean = [0.5, 0.5, 0.5]
std = [0.25, 0.25, 0.25]
[classes]
names = {CLASSES!r}
""".replace("'", '"')
PER_CLASS = 6


@pytest.fixture
def spec_file(tmp_path: Path) -> Path:
    """A 16x16 RGB spec of five classes, as a team writes it."""
    path = tmp_path / "site.toml"
    path.write_text(SPEC_TOML)
    return path


@pytest.fixture
def spec(spec_file: Path) -> ModelSpec:
    """The spec the file holds."""
    return load_model_spec(spec_file).spec


def photo(seed: int, size: tuple[int, int] = (40, 30)) -> Image.Image:
    """A distinct RGB photo (smooth colour bands, so JPEG keeps it distinct at the spec's size) of width x height."""
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (4, 4, 3), dtype=np.uint8)
    return Image.fromarray(blocks).resize(size, Image.Resampling.NEAREST)


def photo_tree(root: Path, per_class: int = PER_CLASS, classes: list[str] = CLASSES) -> Path:
    """A folder of class folders, JPEGs and PNGs alternating, every photo distinct."""
    for name in classes:
        (root / name).mkdir(parents=True)
        for number in range(per_class):
            suffix = "jpg" if number % 2 else "png"
            photo(zlib.crc32(name.encode()) + number).save(root / name / f"{number:02d}.{suffix}", quality=95)
    return root


def build(source: Path, spec: ModelSpec, seed: int = 0, ignore_unknown: bool = False) -> SiteDataset:
    """The data set with the default test share."""
    return build_site_dataset(source, spec, "site.toml", 0.2, seed, ignore_unknown)


def outcomes(site: SiteDataset) -> dict[str, tuple[str, str]]:
    """file -> (outcome, reason) of the report."""
    return {row.file: (row.outcome, row.reason) for row in site.rows}


def kept_image(site: SiteDataset, match: Callable[[np.ndarray], bool]) -> np.ndarray:
    """The one kept image (train or test) for which match holds."""
    data = site.dataset
    found = [image for image in np.concatenate([data.train_images, data.test_images]) if match(image)]
    assert len(found) == 1, len(found)
    return found[0]


def near(colour: tuple[int, int, int], tolerance: float = 6) -> Callable[[np.ndarray], bool]:
    """True for an image whose every pixel is within tolerance of one colour."""
    return lambda image: bool(np.abs(image.astype(int) - np.array(colour)).max() <= tolerance)


def test_a_good_folder_builds_the_same_arrays_on_two_runs_and_another_split_with_another_seed(
    tmp_path: Path, spec: ModelSpec
) -> None:
    tree = photo_tree(tmp_path / "photos")
    first, again, other = build(tree, spec), build(tree, spec), build(tree, spec, seed=1)
    for key in ("train_images", "train_labels", "test_images", "test_labels"):
        assert getattr(first.dataset, key).tobytes() == getattr(again.dataset, key).tobytes()
    assert first.dataset.train_images.shape == (PER_CLASS * 5 - 5, SIDE, SIDE, 3)
    assert np.bincount(first.dataset.test_labels).tolist() == [1] * 5  # a fifth of 6, one a class
    assert np.bincount(first.dataset.train_labels).tolist() == [PER_CLASS - 1] * 5
    assert first.dataset.test_labels.tolist() == other.dataset.test_labels.tolist()
    assert first.dataset.test_images.tobytes() != other.dataset.test_images.tobytes()
    assert {outcome for outcome, _ in outcomes(first).values()} == {"train", "test"}
    assert len(first.rows) == PER_CLASS * 5


def test_a_csv_of_path_and_class_builds_what_the_folder_builds_and_drops_malformed_rows(
    tmp_path: Path, spec: ModelSpec
) -> None:
    tree = photo_tree(tmp_path / "photos")
    table = tmp_path / "labels.csv"
    rows = [["path", "class"]]
    rows += [[f"photos/{p.relative_to(tree).as_posix()}", p.parent.name] for p in sorted(tree.rglob("*.*"))]
    rows += [["photos/cat/00.png"], ["", "cat"], ["photos/cat/missing.jpg", "cat"]]
    with table.open("w", newline="") as handle:
        csv.writer(handle).writerows(rows)
    from_csv, from_folder = build(table, spec), build(tree, spec)
    assert from_csv.dataset.train_images.tobytes() == from_folder.dataset.train_images.tobytes()
    assert from_csv.dataset.test_labels.tolist() == from_folder.dataset.test_labels.tolist()
    found = outcomes(from_csv)
    last = len(rows)
    assert found[f"(line {last - 2})"] == ("dropped", "not path,class: 'photos/cat/00.png'")
    assert found[f"(line {last - 1})"] == ("dropped", "not path,class: ',cat'")
    assert found["photos/cat/missing.jpg"] == ("dropped", "cannot be read (No such file or directory)")


def test_a_corrupt_or_non_image_file_is_dropped_with_its_reason(tmp_path: Path, spec: ModelSpec) -> None:
    tree = photo_tree(tmp_path / "photos")
    good = (tree / "cat" / "01.jpg").read_bytes()
    (tree / "cat" / "cut.jpg").write_bytes(good[: len(good) // 3])
    (tree / "dog" / "notes.png").write_text("not a picture")
    (tree / "loose.jpg").write_bytes(good)
    site = build(tree, spec)
    found = outcomes(site)
    assert found["cat/cut.jpg"][0] == "dropped" and "truncated" in found["cat/cut.jpg"][1]
    assert found["dog/notes.png"] == ("dropped", "not an image")
    assert found["loose.jpg"] == ("dropped", "not in a class folder (one folder per class name)")
    assert len(site.dataset.train_labels) + len(site.dataset.test_labels) == PER_CLASS * 5


def test_a_class_the_spec_does_not_name_is_refused_by_name_unless_ignored(tmp_path: Path, spec: ModelSpec) -> None:
    tree = photo_tree(tmp_path / "photos")
    photo_tree(tree, 3, ["dgo"])
    with pytest.raises(
        UsageError, match=r"class 'dgo' \(3 files\) is not a class of site.toml \['cat', 'dog', "
    ) as refused:
        build(tree, spec)
    assert str(refused.value).endswith(
        "rename it, or leave it out with `fl-coordinator dataset --ignore-unknown-classes`"
    )
    site = build(tree, spec, ignore_unknown=True)
    assert outcomes(site)["dgo/00.png"] == ("dropped", "class 'dgo' is not in site.toml")
    assert len(site.dataset.train_labels) + len(site.dataset.test_labels) == PER_CLASS * 5


@pytest.mark.parametrize(("frogs", "count"), [(0, 0), (2, 2)])
def test_a_spec_class_with_no_or_too_few_images_is_refused_with_its_count_and_the_minimum(
    tmp_path: Path, spec: ModelSpec, frogs: int, count: int
) -> None:
    tree = photo_tree(tmp_path / "photos", classes=CLASSES[:4])
    if frogs:
        photo_tree(tree, frogs, ["frog"])
    with pytest.raises(UsageError, match=rf"\('frog' has {count}\); a class needs at least {MIN_CLASS_IMAGES} "):
        build(tree, spec)


def test_dropped_files_that_leave_a_class_short_are_named_in_the_refusal(tmp_path: Path, spec: ModelSpec) -> None:
    tree = photo_tree(tmp_path / "photos", per_class=MIN_CLASS_IMAGES)
    (tree / "frog" / "00.png").write_bytes(b"broken")
    with pytest.raises(UsageError, match=r"'frog' has 4\) \(1 files left out, first 'frog/00.png': not an image\)"):
        build(tree, spec)


def test_the_same_photo_twice_is_kept_once_and_never_in_both_splits(tmp_path: Path, spec: ModelSpec) -> None:
    tree = photo_tree(tmp_path / "photos")
    (tree / "cat" / "copy.png").write_bytes((tree / "cat" / "00.png").read_bytes())
    Image.open(tree / "cat" / "02.png").save(tree / "cat" / "again.png", compress_level=1)  # other bytes, same pixels
    (tree / "dog" / "cat-or-dog.png").write_bytes((tree / "cat" / "04.png").read_bytes())
    site = build(tree, spec)
    found = outcomes(site)
    assert found["cat/copy.png"] == ("duplicate", "the same file as 'cat/00.png', kept once")
    assert found["cat/again.png"] == ("duplicate", "the same pixels as 'cat/02.png', kept once")
    doubt = "the same photo is labelled ['cat', 'dog'] in ['cat/04.png', 'dog/cat-or-dog.png']"
    assert found["cat/04.png"] == found["dog/cat-or-dog.png"] == ("dropped", doubt)
    kept = np.concatenate([site.dataset.train_images, site.dataset.test_images])
    assert len({image.tobytes() for image in kept}) == len(kept) == PER_CLASS * 5 - 1


def test_a_cmyk_jpeg_becomes_its_rgb_colours(tmp_path: Path, spec: ModelSpec) -> None:
    tree = photo_tree(tmp_path / "photos")
    Image.new("RGB", (64, 48), (200, 40, 90)).convert("CMYK").save(tree / "cat" / "print.jpg", quality=95)
    assert Image.open(tree / "cat" / "print.jpg").mode == "CMYK"
    site = build(tree, spec)
    assert outcomes(site)["cat/print.jpg"][0] in ("train", "test")
    kept_image(site, near((200, 40, 90)))


def test_a_16_bit_png_is_scaled_to_8_bits_not_clipped(tmp_path: Path, spec: ModelSpec) -> None:
    tree = photo_tree(tmp_path / "photos")
    levels = np.full((30, 40), 128 * 257, dtype=np.uint16)
    levels[:, 20:] = 64 * 257
    Image.fromarray(levels).save(tree / "fish" / "deep.png")
    assert Image.open(tree / "fish" / "deep.png").mode == "I;16"
    image = kept_image(build(tree, spec), lambda image: bool(np.all(image[:, : SIDE // 2 - 1] == 128)))
    assert np.all(image[:, SIDE // 2 + 1 :] == 64)


def test_an_exif_rotated_jpeg_is_turned_upright_as_the_device_reads_it(tmp_path: Path, spec: ModelSpec) -> None:
    tree = photo_tree(tmp_path / "photos")
    sideways = np.zeros((60, 40, 3), dtype=np.uint8)  # as the sensor stored it: red on top, blue below
    sideways[:30], sideways[30:] = (250, 0, 0), (0, 0, 250)
    exif = Image.Exif()
    exif[0x0112] = 6  # held turned: the picture is the sensor's turned a quarter clockwise
    Image.fromarray(sideways).save(tree / "bird" / "turned.jpg", exif=exif, quality=95)
    site = build(tree, spec)
    upright = kept_image(site, lambda image: bool(image[SIDE // 2, 1, 2] > 200 and image[SIDE // 2, -2, 0] > 200))
    assert upright[1, 1, 2] > 200 and upright[-2, 1, 2] > 200  # blue down the whole left side
    device = InputSpec(spec.channels, spec.height, spec.width)
    assert np.array_equal(read_image_folder(tree / "bird", device, raw=True).images[-1], upright)
    assert np.array_equal(decode_image(tree / "bird" / "turned.jpg", device), upright)


def test_grey_palette_and_alpha_images_become_rgb(tmp_path: Path, spec: ModelSpec) -> None:
    tree = photo_tree(tmp_path / "photos")
    Image.new("L", (30, 30), 77).save(tree / "frog" / "grey.png")
    Image.new("RGB", (30, 30), (10, 220, 30)).convert("P", palette=Image.Palette.ADAPTIVE).save(
        tree / "frog" / "palette.png"
    )
    Image.new("RGBA", (30, 30), (240, 200, 10, 128)).save(tree / "frog" / "alpha.png")
    Image.new("LA", (30, 30), (150, 40)).save(tree / "frog" / "grey-alpha.png")
    site = build(tree, spec)
    for name in ("grey", "palette", "alpha", "grey-alpha"):
        assert outcomes(site)[f"frog/{name}.png"][0] in ("train", "test")
    for colour in ((77, 77, 77), (10, 220, 30), (240, 200, 10), (150, 150, 150)):
        kept_image(site, near(colour, 0))


def test_run_takes_a_photo_folder_as_its_dataset_and_logs_what_it_left_out(
    tmp_path: Path, spec: ModelSpec, caplog: pytest.LogCaptureFixture
) -> None:
    tree = photo_tree(tmp_path / "photos")
    (tree / "cat" / "copy.png").write_bytes((tree / "cat" / "00.png").read_bytes())
    with caplog.at_level(logging.INFO, logger="coordinator.setup.server_data"):
        data = load_server_data(ServerSettings(tmp_path / "run", spec=spec, dataset=tree))
    assert data.dataset.test_images.tobytes() == build(tree, spec).dataset.test_images.tobytes()
    assert "left out: duplicates 1, dropped files 0" in caplog.text
    assert "count=1 first=cat/copy.png reason=the same file as 'cat/00.png', kept once" in caplog.text


def fl_coordinator(*args: str | Path) -> subprocess.CompletedProcess:
    """`fl-coordinator ARGS` as a person runs it."""
    command = [sys.executable, "-m", "coordinator", *map(str, args)]
    return subprocess.run(command, capture_output=True, text=True, timeout=60)


def test_the_command_writes_the_npz_the_coordinator_loads_and_a_report_of_every_file(
    tmp_path: Path, spec_file: Path, spec: ModelSpec
) -> None:
    tree = photo_tree(tmp_path / "photos")
    for number in range(4):
        (tree / "dog" / f"bad{number}.jpg").write_bytes(b"broken")
    out = tmp_path / "site.npz"
    result = fl_coordinator("dataset", "--images", tree, "--model-spec", spec_file, "--out", out, "--shown", "2")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == f"wrote {out}: 25 training and 5 test images at 16x16x3; left out: duplicates 0, dropped files 4"
    assert lines[1:5] == [
        "  class  train  test",
        "  cat        5     1",
        "  dog        5     1",
        "  ... and 3 more classes",
    ]
    assert lines[5:] == [
        "  dropped    dog/bad0.jpg: not an image",
        "  dropped    dog/bad1.jpg: not an image",
        "  ... and 2 more files left out",
        f"every file and why it was kept or left out: {tmp_path / 'site.report.csv'}",
    ]
    loaded, built = load_npz_dataset(out, spec.image_shape, spec.num_classes), build(tree, spec).dataset
    assert loaded.train_images.tobytes() == built.train_images.tobytes()
    assert loaded.test_labels.tolist() == built.test_labels.tolist()
    with (tmp_path / "site.report.csv").open() as handle:
        report = list(csv.DictReader(handle))
    assert len(report) == PER_CLASS * 5 + 4
    assert report[0] == {"file": "bird/00.png", "class": "bird", "outcome": "train", "reason": ""}
    assert {"file": "dog/bad3.jpg", "class": "dog", "outcome": "dropped", "reason": "not an image"} in report


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"--test-share": "1.5"}, "--test-share must lie strictly between 0 and 1, got 1.5"),
        ({"--images": "nowhere"}, "nowhere: not a folder of class folders nor a CSV file of path,class"),
        ({"--model-spec": "none.toml"}, "none.toml: no such model spec file"),
        ({"--images": "{tree}/cat"}, "cat: names no image file in a class (1 files or rows left out)"),
        ({}, "too few usable images in 5 of the spec's classes ('cat' has 1, 'dog' has 1, 'bird' has 1, and 2 more)"),
    ],
)
def test_the_commands_usage_errors_are_one_line_and_exit_2_writing_nothing(
    tmp_path: Path, spec_file: Path, change: dict[str, str], message: str
) -> None:
    tree = photo_tree(tmp_path / "photos", per_class=1)
    flags = {"--images": str(tree), "--model-spec": str(spec_file), "--out": str(tmp_path / "site.npz")}
    flags |= {flag: value.format(tree=tree) for flag, value in change.items()}
    result = fl_coordinator("dataset", *[word for pair in flags.items() for word in pair])
    assert result.returncode == 2 and result.stdout == ""
    assert len(result.stderr.strip().splitlines()) == 1 and message in result.stderr, result.stderr
    assert not (tmp_path / "site.npz").exists() and not (tmp_path / "site.report.csv").exists()


def test_the_summary_is_bounded_however_many_classes_the_spec_names(tmp_path: Path) -> None:
    names = [f"class-{number}" for number in range(30)]
    spec = ModelSpec("rgb-cnn", 3, SIDE, SIDE, [0.5] * 3, [0.25] * 3, names)
    site = build(photo_tree(tmp_path / "photos", MIN_CLASS_IMAGES, names), spec)
    lines = summary_lines(site, names, 3)
    assert len(lines) == 2 + 3 + 1 and lines[-1] == "  ... and 27 more classes"
