# Bad files a new user may hand the coordinator (issue #26 item 7): each ends the real command with exit code 2 and
# one short line naming the file and what is wrong, never a traceback, and no file is read past what it declares.
from __future__ import annotations

import subprocess
import sys
import zipfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from edge_agent.data.image_arrays import DATASET_KEYS
from protocol.files import load_arrays

MAX_LINE = 300


def deep_arrays(folder: Path) -> Path:
    """A model spec whose one value is 5000 arrays within each other."""
    path = folder / "deep-arrays.toml"
    path.write_text("[model]\narchitecture = " + "[" * 5000 + "]" * 5000 + "\n")
    return path


def deep_tables(folder: Path) -> Path:
    """A model spec whose one value is 5000 inline tables within each other."""
    path = folder / "deep-tables.toml"
    path.write_text("[model]\narchitecture = " + "{a = " * 5000 + "1" + "}" * 5000 + "\n")
    return path


def a_directory(folder: Path) -> Path:
    """A folder where a file is expected."""
    path = folder / "spec.toml"
    path.mkdir()
    return path


def many_classes(folder: Path) -> Path:
    """A model spec listing 100000 class names."""
    path = folder / "classes.toml"
    path.write_text("[classes]\nnames = [" + ", ".join(f'"c{index}"' for index in range(100_000)) + "]\n")
    return path


def huge_header(folder: Path) -> Path:
    """An .npz whose every array header declares about 10^12 bytes that are not there."""
    path = folder / "huge.npz"
    header = {"descr": "|u1", "fortran_order": False, "shape": (10**12 // 784, 28, 28)}
    with zipfile.ZipFile(path, "w") as archive:
        for key in DATASET_KEYS:
            with archive.open(f"{key}.npy", "w") as member:
                np.lib.format.write_array_header_1_0(member, header)
    return path


def broken_zip(folder: Path) -> Path:
    """A file that starts like a zip archive and is not one."""
    path = folder / "broken.npz"
    path.write_bytes(b"PK\x03\x04" + bytes(100))
    return path


def pickled(folder: Path) -> Path:
    """An .npz holding an object array (which numpy stores as a pickle)."""
    path = folder / "pickled.npz"
    arrays = {key: np.zeros(1) for key in DATASET_KEYS}
    np.savez(path, **{**arrays, "train_images": np.array([{"a": 1}], dtype=object)})
    return path


def command(room: str, *args: str) -> subprocess.CompletedProcess:
    """`python -m ROOM ...` (coordinator or bench) as a user runs it, output captured."""
    return subprocess.run([sys.executable, "-m", room, *args], capture_output=True, text=True, timeout=120)


def assert_one_short_line(result: subprocess.CompletedProcess, words: str) -> None:
    """Exit code 2 and one line under MAX_LINE characters on stderr holding `words`."""
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2, result.stderr[-2000:]
    assert len(lines) == 1 and len(lines[0]) < MAX_LINE, result.stderr[-2000:]
    assert words in lines[0], lines[0]


@pytest.mark.parametrize(
    ("make", "words"),
    [
        (deep_arrays, "deep-arrays.toml: nested too deeply to be a model spec"),
        (deep_tables, "deep-tables.toml: nested too deeply to be a model spec"),
        (a_directory, "spec.toml: cannot read the model spec (Is a directory)"),
        (many_classes, "classes.toml: classes.names is too long: 100000 items, at most 1000"),
    ],
)
def test_a_bad_model_spec_stops_simulate_in_one_line(tmp_path: Path, make: Callable[[Path], Path], words: str) -> None:
    spec = make(tmp_path)
    result = command(
        "bench",
        "simulate",
        "--devices",
        "2",
        "--rounds",
        "1",
        "--run-dir",
        str(tmp_path / "run"),
        "--model-spec",
        str(spec),
    )
    assert_one_short_line(result, words)
    assert not (tmp_path / "run" / "devices").exists()


@pytest.mark.parametrize(
    ("make", "words"),
    [
        (huge_header, "huge.npz: array 'train_images' declares 999999999936 bytes of data but holds 0"),
        (broken_zip, "broken.npz: not a readable .npz (File is not a zip file)"),
        (pickled, "pickled.npz: array 'train_images' holds Python objects (pickle), which are never loaded"),
    ],
)
def test_a_bad_dataset_stops_run_in_one_line(tmp_path: Path, make: Callable[[Path], Path], words: str) -> None:
    dataset = make(tmp_path)
    result = command(
        "coordinator",
        *("run", "--broker", "mqtt://127.0.0.1:1", "--rounds", "1", "--run-dir", str(tmp_path / "run")),
        *("--dataset", str(dataset)),
    )
    assert_one_short_line(result, words)


@pytest.mark.parametrize("make", [huge_header, broken_zip, pickled])
def test_a_device_file_with_the_same_faults_is_one_bounded_error_naming_it(
    tmp_path: Path, make: Callable[[Path], Path]
) -> None:
    path = make(tmp_path)
    with pytest.raises(ValueError) as caught:
        load_arrays(path)
    assert str(caught.value).startswith(str(path)) and len(str(caught.value)) < MAX_LINE + len(str(path))
