# Accepted updates' decoded weights kept out of memory until their round closes, read back as views, never decoded again.
"""A streamed round keeps no tensors in memory (its running sum is all it needs to aggregate), yet its close measures
every update against the new model (divergence) and may score it; an asynchronous round folds its buffered updates
only once the buffer is full. Both read the decoded float32 weights back from a TensorScratch: raw, aligned bytes
appended to an unlinked temporary file beside the spool (written through the page cache, never synced: the spool
holds the durable payloads), mapped one weight set at a time and viewed as read-only arrays, so reading an update
back copies and decodes nothing and memory holds one update at most. The scratch dies with its process: a restarted
coordinator decodes the spooled payloads once more (recovery) and keeps them in a new scratch."""

from __future__ import annotations

import math
import mmap
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
    """Where one tensor of a weight set lies in the scratch file: its name, dtype, shape and byte offset."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int


@dataclass(frozen=True)
class KeptSet:
    """One weight set in the scratch file: the byte span it covers and its tensors in order."""

    start: int
    end: int
    tensors: tuple[KeptTensor, ...]


class TensorScratch:
    """Weight sets by key (a device id), appended raw to an unlinked temporary file in `folder` (made on the first
    put) and read back as read-only views of a private map of their bytes; close() drops the file."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.handle: BinaryIO | None = None
        self.size = 0
        self.sets: dict[str, KeptSet] = {}

    def put(self, key: str, weights: Weights) -> None:
        """Appends a weight set under `key` (a later put under the same key replaces it), in one write call: the
        page cache is the cost of a scratch, and one vectored write of every tensor is a third of one write each."""
        handle = self.file()
        start, tensors, buffers = self.size, [], []
        for name, array in weights.items():
            contiguous = np.asarray(array, order="C")
            buffers.append(bytes(-self.size % ALIGNMENT))
            self.size += -self.size % ALIGNMENT
            tensors.append(KeptTensor(name, contiguous.dtype.str, contiguous.shape, self.size))
            buffers.append(contiguous.reshape(-1).view(np.uint8).data)
            self.size += contiguous.nbytes
        written = os.writev(handle.fileno(), buffers) if buffers else 0
        if written != self.size - start:
            raise OSError(f"scratch write stopped at {written} of {self.size - start} bytes (disk full?)")
        self.sets[key] = KeptSet(start, self.size, tuple(tensors))

    def get(self, key: str) -> Weights:
        """The weight set kept under `key` (KeyError if none): read-only views of a map of its bytes, unmapped once
        the arrays are dropped."""
        kept = self.sets[key]
        if self.handle is None or kept.end == kept.start:
            return {tensor.name: np.zeros(tensor.shape, tensor.dtype) for tensor in kept.tensors}
        first = kept.start - kept.start % mmap.ALLOCATIONGRANULARITY
        region = mmap.mmap(self.handle.fileno(), kept.end - first, access=mmap.ACCESS_READ, offset=first)
        return {
            tensor.name: np.frombuffer(
                region, dtype=tensor.dtype, count=math.prod(tensor.shape), offset=tensor.offset - first
            ).reshape(tensor.shape)
            for tensor in kept.tensors
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
        """Drops the file and what it holds (views already handed out stay valid: their maps keep the pages)."""
        if self.handle is not None:
            self.handle.close()
        self.handle, self.size, self.sets = None, 0, {}
