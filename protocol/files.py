# Crash-safe files: atomic replace with fsync, and named numpy arrays as .npz without pickle.
from __future__ import annotations

import io
import os
import tempfile
import zipfile
from collections.abc import Mapping
from pathlib import Path

import numpy as np


def fsync_directory(directory: Path) -> None:
    """Flushes a directory entry change (a rename) to disk."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_bytes(path: Path | str, data: bytes) -> None:
    """Replaces path with data so that a crash leaves either the old file or the new one, never a mix.

    The parent folder is created if missing, so callers need not prepare it.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, temp_name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temp_name, path)
    except BaseException:
        Path(temp_name).unlink(missing_ok=True)
        raise
    fsync_directory(path.parent)


def save_arrays(path: Path | str, arrays: Mapping[str, np.ndarray]) -> None:
    """Writes named arrays as an .npz archive (no pickled objects), atomically."""
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_STORED) as archive:
        for name, array in arrays.items():
            if not isinstance(name, str) or not name:
                raise ValueError(f"{path}: array names must be non-empty strings, got {name!r}")
            array = np.asarray(array)
            if array.dtype.hasobject:
                raise ValueError(f"{path}: array {name!r} has object dtype, which cannot be saved without pickle")
            with archive.open(f"{name}.npy", "w", force_zip64=True) as member:
                np.lib.format.write_array(member, array, allow_pickle=False)
    atomic_write_bytes(path, buffer.getvalue())


def load_arrays(path: Path | str) -> dict[str, np.ndarray]:
    """Reads an .npz archive written by save_arrays; a corrupt or non-npz file is a ValueError naming it."""
    path = Path(path)
    raw = path.read_bytes()
    try:
        loaded = np.load(io.BytesIO(raw), allow_pickle=False)
        if not isinstance(loaded, np.lib.npyio.NpzFile):
            raise ValueError("a single .npy array, not an .npz archive")
        with loaded:
            return {name: loaded[name] for name in loaded.files}
    except (ValueError, OSError, EOFError, zipfile.BadZipFile) as exc:
        raise ValueError(f"{path}: corrupt or unreadable array archive ({exc})") from exc
