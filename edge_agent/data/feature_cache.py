# A device's cache of frozen-prefix outputs: float16 rows by sample index, memory-mapped, checked per block (numpy only).
from __future__ import annotations

import base64
import hashlib
import json
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from protocol.files import atomic_write_bytes

log = logging.getLogger(__name__)

FEATURES_FOLDER = "features"
CACHE_FORMAT = "edge-fal-feature-cache"
CACHE_VERSION = 1
BLOCK_ROWS = 256
ROW_DTYPE = np.dtype("<f2")

Extractor = Callable[[np.ndarray], np.ndarray]
"""Sample indices -> the prefix's output rows (n, D) of those samples: what the cache runs for rows it lacks."""


@dataclass
class CacheMeta:
    """What the JSON beside the rows says: the key, the row width, each block's sha256 and which rows are filled."""

    key: str
    dim: int
    blocks: list[str] = field(default_factory=list)
    present: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=bool))

    def to_json(self) -> dict[str, Any]:
        """The meta as JSON-able values (the filled rows as a base64 bitmap)."""
        bitmap = base64.b64encode(np.packbits(self.present).tobytes()).decode()
        return {"format": CACHE_FORMAT, "version": CACHE_VERSION, "key": self.key, "dim": self.dim} | {
            "block_rows": BLOCK_ROWS,
            "blocks": self.blocks,
            "present": bitmap,
        }

    @classmethod
    def from_json(cls, raw: Any, key: str) -> CacheMeta:
        """The meta of `key` read back; ValueError when it is not exactly what to_json writes for that key."""
        if not isinstance(raw, dict) or raw.get("format") != CACHE_FORMAT or raw.get("version") != CACHE_VERSION:
            raise ValueError("not a feature cache meta of this version")
        if raw.get("key") != key or raw.get("block_rows") != BLOCK_ROWS:
            raise ValueError("written for another key or block size")
        dim, blocks = raw.get("dim"), raw.get("blocks")
        if not isinstance(dim, int) or dim < 1 or not isinstance(blocks, list):
            raise ValueError("bad row width or block list")
        if not all(isinstance(digest, str) and len(digest) == 64 for digest in blocks):
            raise ValueError("bad block digests")
        bits = np.unpackbits(np.frombuffer(base64.b64decode(str(raw.get("present")), validate=True), np.uint8))
        if len(bits) != len(blocks) * BLOCK_ROWS:
            raise ValueError("the row bitmap does not cover the blocks")
        return cls(key, dim, list(blocks), bits.astype(bool))


class FeatureCache:
    """The prefix outputs of one frozen prefix (its `key`), one float16 row per sample index, in `<key>.f16`
    beside `<key>.json` under `folder`.

    Rows are computed once, when first asked for, in batches; the meta (each block's sha256, which rows are
    filled) is rewritten atomically after each batch's rows are synced. Every block a read touches is checked
    against its sha256 first: a block that does not match (flipped bytes, a truncated file) loses its rows,
    which are computed again, with a warning. A cache of another key in the folder is removed on opening.
    """

    def __init__(self, folder: Path, key: str, batch_size: int = 64) -> None:
        if not key or not all(character in "0123456789abcdef" for character in key):
            raise ValueError(f"a feature cache key is a hex digest, got {key[:80]!r}")
        if batch_size < 1:
            raise ValueError(f"feature batch size must be at least 1, got {batch_size}")
        self.folder, self.key, self.batch_size = Path(folder), key, batch_size
        self.folder.mkdir(parents=True, exist_ok=True)
        self.data_path, self.meta_path = self.folder / f"{key}.f16", self.folder / f"{key}.json"
        self._remove_other_keys()

    def rows(self, indices: np.ndarray, extract: Extractor) -> np.ndarray:
        """float16 rows (n, D) of these sample indices, in their order; rows not cached yet are computed with
        `extract` first (each sample's prefix runs once)."""
        indices = np.asarray(indices, dtype=np.int64)
        meta = self.fill(indices, extract)
        if meta is None:
            return np.zeros((0, 0), dtype=ROW_DTYPE)
        return np.array(self._mapped(meta)[indices])

    def fill(self, indices: np.ndarray, extract: Extractor) -> CacheMeta | None:
        """Computes the rows of these sample indices not cached yet, returning the meta (None: nothing cached):
        what `rows` reads, and what a device runs ahead of a round for the images that just entered its pool."""
        indices = np.asarray(indices, dtype=np.int64)
        if len(indices) and int(indices.min()) < 0:
            raise ValueError(f"sample indices must be non-negative, got {int(indices.min())}")
        meta = self._checked_meta(indices)
        return self._fill(meta, np.unique(indices[~_present(meta, indices)]), extract)

    def _remove_other_keys(self) -> None:
        """Deletes the rows and meta of every other key (a new prefix makes them useless)."""
        for path in self.folder.iterdir():
            if path.suffix in (".f16", ".json") and path.stem != self.key and path.is_file():
                log.info("feature cache removed key=%s", path.stem[:12])
                path.unlink(missing_ok=True)

    def _load_meta(self) -> CacheMeta | None:
        """The meta on disk, or None when there is none; a meta that does not parse is dropped with a warning."""
        if not self.meta_path.is_file():
            return None
        try:
            return CacheMeta.from_json(json.loads(self.meta_path.read_bytes()), self.key)
        except (ValueError, UnicodeDecodeError) as error:
            log.warning("feature cache meta unreadable, rebuilding key=%s error=%s", self.key[:12], str(error)[:200])
            self.meta_path.unlink(missing_ok=True)
            self.data_path.unlink(missing_ok=True)
            return None

    def _checked_meta(self, indices: np.ndarray) -> CacheMeta | None:
        """The meta after checking every block the indices touch: a block that fails its sha256 loses its rows."""
        meta = self._load_meta()
        if meta is None or not len(indices):
            return meta
        block_bytes = BLOCK_ROWS * meta.dim * ROW_DTYPE.itemsize
        whole = self.data_path.stat().st_size // block_bytes if self.data_path.is_file() else 0
        touched = np.union1d(indices // BLOCK_ROWS, np.arange(whole, len(meta.blocks)))
        bad = [int(block) for block in touched[touched < len(meta.blocks)] if self._digest(meta, int(block)) is None]
        if bad:
            log.warning("feature cache blocks corrupt, recomputing key=%s blocks=%s", self.key[:12], bad[:10])
            for block in bad:
                meta.present[block * BLOCK_ROWS : (block + 1) * BLOCK_ROWS] = False
            with open(self.data_path, "a+b") as handle:
                os.ftruncate(handle.fileno(), max(os.fstat(handle.fileno()).st_size, len(meta.blocks) * block_bytes))
            self._write_meta(meta, bad)
        return meta

    def _digest(self, meta: CacheMeta, block: int) -> str | None:
        """The block's sha256 when the file holds it whole and it matches the meta's; None otherwise."""
        actual = self._block_sha256(meta.dim, block)
        return actual if actual == meta.blocks[block] else None

    def _block_sha256(self, dim: int, block: int) -> str | None:
        """sha256 of a block's bytes as the file holds them, None when the file ends before the block does."""
        size = BLOCK_ROWS * dim * ROW_DTYPE.itemsize
        if not self.data_path.is_file():
            return None
        with open(self.data_path, "rb") as handle:
            handle.seek(block * size)
            data = handle.read(size)
        return hashlib.sha256(data).hexdigest() if len(data) == size else None

    def _fill(self, meta: CacheMeta | None, missing: np.ndarray, extract: Extractor) -> CacheMeta | None:
        """Computes the missing rows in batches, syncing each batch's rows before its meta; logs each batch."""
        for start in range(0, len(missing), self.batch_size):
            batch = missing[start : start + self.batch_size]
            rows = np.asarray(extract(batch))
            if rows.ndim != 2 or len(rows) != len(batch) or (meta is not None and rows.shape[1] != meta.dim):
                raise ValueError(f"the prefix gave rows {rows.shape} for {len(batch)} samples")
            meta = meta or CacheMeta(self.key, int(rows.shape[1]))
            self._write_rows(meta, batch, rows.astype(ROW_DTYPE))
            log.info(
                "feature cache extended key=%s rows=%d/%d cached=%d",
                *(self.key[:12], start + len(batch), len(missing), int(meta.present.sum())),
            )
        return meta

    def _write_rows(self, meta: CacheMeta, indices: np.ndarray, rows: np.ndarray) -> None:
        """Writes rows at their indices (growing the file by whole blocks), syncs, then records them in the meta."""
        blocks = int(indices.max()) // BLOCK_ROWS + 1
        row_bytes = meta.dim * ROW_DTYPE.itemsize
        grown = max(blocks, len(meta.blocks))
        with open(self.data_path, "r+b" if self.data_path.exists() else "w+b") as handle:
            os.ftruncate(handle.fileno(), max(os.fstat(handle.fileno()).st_size, grown * BLOCK_ROWS * row_bytes))
            for index, row in zip(indices.tolist(), rows):
                os.pwrite(handle.fileno(), row.tobytes(), index * row_bytes)
            os.fsync(handle.fileno())
        meta.blocks += [""] * (grown - len(meta.blocks))
        meta.present = np.concatenate([meta.present, np.zeros(grown * BLOCK_ROWS - len(meta.present), dtype=bool)])
        meta.present[indices] = True
        self._write_meta(meta, sorted({int(index) // BLOCK_ROWS for index in indices.tolist()}))

    def _write_meta(self, meta: CacheMeta, changed: list[int]) -> None:
        """Rehashes the changed blocks from the file and replaces the meta atomically."""
        for block in changed:
            meta.blocks[block] = self._block_sha256(meta.dim, block) or ""
        atomic_write_bytes(self.meta_path, json.dumps(meta.to_json()).encode())

    def _mapped(self, meta: CacheMeta) -> np.ndarray:
        """The rows file as a read-only (rows, dim) float16 memory map."""
        return np.memmap(self.data_path, dtype=ROW_DTYPE, mode="r", shape=(len(meta.present), meta.dim))


def _present(meta: CacheMeta | None, indices: np.ndarray) -> np.ndarray:
    """Which of the indices have a cached row."""
    if meta is None:
        return np.zeros(len(indices), dtype=bool)
    inside = indices < len(meta.present)
    return inside & meta.present[np.where(inside, indices, 0)]
