# Fashion-MNIST: the IDX file reader, the dataset's four files, its class names and its normalisation.
from __future__ import annotations

import gzip
import math
import zlib
from pathlib import Path
from typing import IO, cast

import numpy as np

from edge_agent.data.image_arrays import ImageDataset, check_images, check_labels
from protocol.errors import UsageError
from protocol.model_spec import CLASS_NAMES

DEFAULT_DATA_DIR = Path("/usr/share/datasets/fashion-mnist")

_IDX_DTYPES: dict[int, np.dtype] = {
    0x08: np.dtype(">u1"),
    0x09: np.dtype(">i1"),
    0x0B: np.dtype(">i2"),
    0x0C: np.dtype(">i4"),
    0x0D: np.dtype(">f4"),
    0x0E: np.dtype(">f8"),
}
_FASHION_MNIST_FILES = {
    "train_images": "train-images-idx3-ubyte",
    "train_labels": "train-labels-idx1-ubyte",
    "test_images": "t10k-images-idx3-ubyte",
    "test_labels": "t10k-labels-idx1-ubyte",
}


class DatasetMissingError(UsageError):
    """A dataset file is absent; the message says which one and how to install it (a user's setup: one line)."""

    def __init__(self, path: Path) -> None:
        super().__init__(
            f"Fashion-MNIST file {path} is missing; install it with "
            "`apt-get install dataset-fashion-mnist` or pass --data-dir DIR"
        )
        self.path = path


def _read_exactly(handle: IO[bytes], size: int, path: Path) -> bytes:
    """Up to `size` bytes of an open (possibly gzip) file; a broken gzip stream is a ValueError naming it."""
    try:
        return handle.read(size)
    except (OSError, EOFError, zlib.error) as exc:
        raise UsageError(f"{path}: corrupt gzip stream ({exc})") from exc


def read_idx(path: Path | str, limit: int | None = None) -> np.ndarray:
    """Reads an IDX file (gzip or plain by suffix), checking the header against the data length.

    With `limit`, only the first `limit` items are decompressed and read (the dry run of a big pool file
    then holds only what it scores); the rest of the file is not checked.
    """
    path = Path(path)
    opened = cast(IO[bytes], gzip.open(path, "rb") if path.suffix == ".gz" else open(path, "rb"))  # noqa: SIM115
    with opened as handle:
        magic = _read_exactly(handle, 4, path)
        if len(magic) < 4 or magic[0] != 0 or magic[1] != 0:
            raise UsageError(f"{path}: not an IDX file (bad magic number)")
        dtype_code, ndim = magic[2], magic[3]
        if dtype_code not in _IDX_DTYPES:
            raise UsageError(f"{path}: unknown IDX data type code 0x{dtype_code:02x}")
        if ndim == 0:
            raise UsageError(f"{path}: IDX header declares zero dimensions")
        dims = _read_exactly(handle, 4 * ndim, path)
        if len(dims) < 4 * ndim:
            raise UsageError(f"{path}: truncated IDX header ({4 + len(dims)} bytes, need {4 + 4 * ndim})")
        shape = tuple(int(d) for d in np.frombuffer(dims, dtype=">u4"))
        count = shape[0] if limit is None else min(limit, shape[0])
        dtype = _IDX_DTYPES[dtype_code]
        expected = count * math.prod(shape[1:]) * dtype.itemsize
        raw = _read_exactly(handle, expected, path)
        trailing = limit is None and len(_read_exactly(handle, 1, path)) > 0
    if len(raw) != expected or trailing:
        state = "truncated" if len(raw) < expected else "has trailing bytes"
        raise UsageError(
            f"{path}: IDX data {state}: header {shape} needs {expected} bytes, file has "
            f"{len(raw)}{'+' if trailing else ''}"
        )
    data = np.frombuffer(raw, dtype=dtype).reshape((count, *shape[1:]))
    return data.astype(dtype.newbyteorder("="))


def _find_dataset_file(data_dir: Path, stem: str) -> Path:
    """The gzip or plain copy of a dataset file in data_dir; DatasetMissingError if neither exists."""
    for candidate in (data_dir / f"{stem}.gz", data_dir / stem):
        if candidate.is_file():
            return candidate
    raise DatasetMissingError(data_dir / f"{stem}.gz")


def _check_split(images: np.ndarray, labels: np.ndarray, where: str) -> None:
    """Raises ValueError unless a split has uint8 (N, 28, 28) images and N uint8 labels in 0..9."""
    check_images(images, where)
    if labels.dtype != np.uint8:
        raise UsageError(f"{where}: labels are {labels.dtype}, expected uint8")
    check_labels(labels, len(images), len(CLASS_NAMES), where)


def load_fashion_mnist(data_dir: Path | None = None) -> ImageDataset:
    """Loads the four Fashion-MNIST IDX files from data_dir (default: the Debian package's folder)."""
    data_dir = Path(data_dir) if data_dir is not None else DEFAULT_DATA_DIR
    arrays = {key: read_idx(_find_dataset_file(data_dir, stem)) for key, stem in _FASHION_MNIST_FILES.items()}
    _check_split(arrays["train_images"], arrays["train_labels"], f"{data_dir}: train split")
    _check_split(arrays["test_images"], arrays["test_labels"], f"{data_dir}: test split")
    return ImageDataset(**arrays)
