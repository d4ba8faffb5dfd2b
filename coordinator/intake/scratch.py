# Accepted updates' decoded weights kept out of memory until their round closes, read back as views, never decoded again.
"""A streamed round keeps no tensors in memory (its running sum is all it needs to aggregate), yet its close measures
every update against the new model (divergence) and may score it; an asynchronous round folds its buffered updates
only once the buffer is full. Both read the decoded float32 weights back from a TensorScratch: raw, aligned bytes
appended to an unlinked temporary file beside the spool (written through the page cache, never synced: the spool
holds the durable payloads), read back with one call per weight set and viewed as read-only arrays, so reading an
update back decodes nothing and memory holds one update at a time. The scratch dies with its process: a restarted
coordinator decodes the spooled payloads once more (recovery) and keeps them in a new scratch."""

from __future__ import annotations

import math
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np

from protocol.tensors import Weights

ALIGNMENT = 64  # every tensor starts on a 64-byte boundary of the file (aligned views, whatever the dtype)


@dataclass(frozen=True)
class KeptTensor:
    """Where one tensor of a weight set lies, from the set's start: its name, dtype, shape and byte offset."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int


Layout = tuple[KeptTensor, ...]


def layout_of(weights: Weights) -> tuple[Layout, int]:
    """Each tensor's place in a weight set written from an aligned start (every one aligned too), and the set's
    byte length."""
    tensors, size = [], 0
    for name, array in weights.items():
        size += -size % ALIGNMENT
        tensors.append(KeptTensor(name, array.dtype.str, tuple(array.shape), size))
        size += array.nbytes
    return tuple(tensors), size


class TensorScratch:
    """Weight sets by key (a device id), appended raw to an unlinked temporary file in `folder` (made on the first
    put) and read back as read-only views of their bytes; close() drops the file. The sets of a round share one
    layout, kept once."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.handle: BinaryIO | None = None
        self.size = 0
        self.sets: dict[str, tuple[int, Layout, int]] = {}  # key -> (start, layout, length)
        self.layouts: dict[Layout, Layout] = {}

    def put(self, key: str, weights: Weights) -> None:
        """Appends a weight set under `key` (a later put under the same key replaces it), in one write call: the
        page cache is the cost of a scratch, and one vectored write of every tensor is a third of one write each."""
        handle = self.file()
        layout, length = layout_of(weights)
        layout = self.layouts.setdefault(layout, layout)
        start = self.size + -self.size % ALIGNMENT
        buffers: list[bytes | memoryview] = []
        position = self.size
        for kept, array in zip(layout, weights.values()):
            buffers.append(bytes(start + kept.offset - position))
            buffers.append(np.ascontiguousarray(array).reshape(-1).view(np.uint8).data)
            position = start + kept.offset + array.nbytes
        written = os.writev(handle.fileno(), buffers)
        if written != start + length - self.size:
            raise OSError(f"scratch write stopped at {written} of {start + length - self.size} bytes (disk full?)")
        self.size = start + length
        self.sets[key] = (start, layout, length)

    def get(self, key: str) -> Weights:
        """The weight set kept under `key` (KeyError if none): read-only views of one buffer its bytes are read into
        with one call (a file map per set cost more in page faults and unmapping, and a map of the whole file would
        count every page read in the process's resident memory)."""
        start, layout, length = self.sets[key]
        buffer = np.empty(length, dtype=np.uint8)
        if self.handle is not None and length:
            read = os.preadv(self.handle.fileno(), [buffer.data], start)
            if read != length:
                raise OSError(f"scratch read stopped at {read} of {length} bytes")
        buffer.setflags(write=False)
        return {
            kept.name: np.frombuffer(buffer, dtype=kept.dtype, count=math.prod(kept.shape), offset=kept.offset).reshape(
                kept.shape
            )
            for kept in layout
        }

    def file(self) -> BinaryIO:
        """The scratch file, created unlinked on first use."""
        if self.handle is None:
            self.folder.mkdir(parents=True, exist_ok=True)
            self.handle = tempfile.TemporaryFile(dir=self.folder)  # noqa: SIM115 (closed by close())
        return self.handle

    def __enter__(self) -> TensorScratch:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """Drops the file and what it holds (views already handed out stay valid: they own their buffers)."""
        if self.handle is not None:
            self.handle.close()
        self.handle, self.size, self.sets = None, 0, {}
