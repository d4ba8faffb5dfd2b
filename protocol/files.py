# Crash-safe files: atomic replace with fsync, and named numpy arrays as .npz without pickle.
from __future__ import annotations

import io
import math
import os
import shutil
import tempfile
import zipfile
from collections.abc import Mapping
from pathlib import Path
from typing import IO

import numpy as np

from protocol.errors import UsageError

MAX_DEFLATE_RATIO = 1032  # deflate expands at most ~1032:1, so a member claiming more than that is lying
NPY_HEADER_READERS = {(1, 0): np.lib.format.read_array_header_1_0, (2, 0): np.lib.format.read_array_header_2_0}


class UnreadableFileError(UsageError):
    """A file the program was given or keeps that is not what it should be (not an .npz, pickled objects, a header
    declaring more than the file holds): one line naming the file, for the person to replace or remove it."""


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


def atomic_link(source: Path, path: Path) -> None:
    """Replaces path with the file at source without reading it into memory: a hard link where the file system
    allows one (both names then share the bytes), a streamed copy where it does not; atomic like the writes above."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temp = path.parent / f".{path.name}.{os.getpid()}.link"
    temp.unlink(missing_ok=True)
    try:
        os.link(source, temp)
    except OSError:
        shutil.copyfile(source, temp)
    try:
        os.replace(temp, path)
    except BaseException:
        temp.unlink(missing_ok=True)
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


def npy_declared(member: IO[bytes]) -> tuple[np.dtype, int]:
    """The dtype and data bytes an .npy stream's header declares (the stream is left after the header)."""
    version = np.lib.format.read_magic(member)
    if version not in NPY_HEADER_READERS:
        raise ValueError(f".npy format version {version} is not supported")
    shape, _, dtype = NPY_HEADER_READERS[version](member)
    return dtype, math.prod(shape) * dtype.itemsize


def check_npz_members(path: Path | str, archive: zipfile.ZipFile) -> None:
    """UnreadableFileError naming the file and the array when a member holds Python objects (pickle) or its header declares
    more data than the member holds: read from the headers, before numpy allocates what a header declares."""
    for info in archive.infolist():
        name = info.filename.removesuffix(".npy")[:64]
        try:
            with archive.open(info) as member:
                dtype, declared = npy_declared(member)
                held = info.file_size - member.tell()
        # numpy's .npy header parser and zipfile raise ValueError for a damaged archive: the file's fault, named
        except (ValueError, OSError, EOFError, zipfile.BadZipFile) as error:
            raise UnreadableFileError(f"{path}: array {name!r} is not a readable .npy ({str(error)[:100]})") from None
        if dtype.hasobject:
            raise UnreadableFileError(f"{path}: array {name!r} holds Python objects (pickle), which are never loaded")
        if declared > held or info.file_size > max(info.compress_size, 1) * MAX_DEFLATE_RATIO:
            raise UnreadableFileError(
                f"{path}: array {name!r} declares {declared} bytes of data but holds {max(held, 0)}"
            )


def checked_npz(path: Path | str, source: Path | IO[bytes]) -> np.lib.npyio.NpzFile:
    """np.load of an .npz archive (no pickle) once check_npz_members passed; anything that is not a readable
    .npz is an UnreadableFileError naming `path`."""
    try:
        with zipfile.ZipFile(source) as archive:
            check_npz_members(path, archive)
        if not isinstance(source, Path):
            source.seek(0)
        return np.load(source, allow_pickle=False)
    except (OSError, EOFError, zipfile.BadZipFile) as error:
        raise UnreadableFileError(f"{path}: not a readable .npz ({str(error)[:120]})") from None


def load_arrays(path: Path | str) -> dict[str, np.ndarray]:
    """Reads an .npz archive written by save_arrays; a corrupt or non-npz file is an UnreadableFileError naming it."""
    path = Path(path)
    with checked_npz(path, io.BytesIO(path.read_bytes())) as loaded:
        try:
            return {name: loaded[name] for name in loaded.files}
        # numpy raises ValueError for a damaged member: the file's fault, named
        except (ValueError, OSError, EOFError, zipfile.BadZipFile) as error:
            raise UnreadableFileError(f"{path}: corrupt or unreadable array archive ({str(error)[:120]})") from None
