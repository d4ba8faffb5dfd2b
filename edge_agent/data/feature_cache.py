# A device's cache of frozen-prefix outputs: rows by sample index, each tied to its image and prefix, checked on read.
from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from protocol.files import atomic_write_bytes

log = logging.getLogger(__name__)

FEATURES_FOLDER = "features"
CACHE_FORMAT = "edge-fal-feature-cache"
CACHE_VERSION = 2
GROW_ROWS = 256
TAG_BYTES = DIGEST_BYTES = 32
HALF, SINGLE = np.dtype("<f2"), np.dtype("<f4")
ROW_DTYPES: dict[str, np.dtype] = {"f2": HALF, "f4": SINGLE}
REPORTED_INDICES = 10
MAX_DIM = 1 << 22  # values in a row, far above any prefix's (a meta claiming more is not read)
# The largest magnitude a stored value may have: its square times the widest row (MAX_DIM, 2^22) is 2^102, 2^26
# below float32's largest (2^128), so a head's dot product of a row with weights or another row, a squared
# distance between rows, or a softmax regression step's logits stay finite. A legitimate prefix's outputs are far
# inside (ReLU6 backbones: 6; the float32 cache exists for outputs beyond float16's 65504); a row beyond it, finite
# or not, is never used, as one failing its tag is not.
ROW_LIMIT = 2.0**40
META_BYTES = 4096  # what a meta may take: it holds about 200 (a longer one is not read past this)
READ_RECORDS = 1024  # records read per pread batch (1024 rows of 1280 float16: 2.7 MB)
_UNWRITABLE: set[Path] = set()  # folders this process has already warned cannot be written

Extractor = Callable[[np.ndarray], np.ndarray]
"""Sample indices -> the prefix's output rows (n, D) of those samples: what the cache runs for rows it lacks."""


def content_digests(images: np.ndarray) -> np.ndarray:
    """sha256 of each image's uint8 pixels (the model input the prefix sees), (n, 32) uint8; one image at a time,
    so a memory-mapped stack is never copied whole."""
    digests = np.zeros((len(images), DIGEST_BYTES), dtype=np.uint8)
    for position, image in enumerate(images):
        digests[position] = np.frombuffer(hashlib.sha256(np.ascontiguousarray(image).data).digest(), np.uint8)
    return digests


@dataclass(frozen=True)
class CacheMeta:
    """What the JSON beside the rows says: the key, the row width and type, and how many rows the file was grown to
    (a shorter file was truncated)."""

    key: str
    dim: int
    dtype: np.dtype
    capacity: int = 0

    @property
    def record(self) -> np.dtype:
        """One row's record in the rows file: its tag, then its values."""
        return np.dtype([("tag", np.uint8, (TAG_BYTES,)), ("row", self.dtype, (self.dim,))])

    def to_json(self) -> dict[str, Any]:
        """The meta as JSON-able values."""
        kind = "f2" if self.dtype == HALF else "f4"
        return {"format": CACHE_FORMAT, "version": CACHE_VERSION, "key": self.key, "dim": self.dim} | {
            "dtype": kind,
            "capacity": self.capacity,
        }

    @classmethod
    def from_json(cls, raw: Any, key: str) -> CacheMeta:
        """The meta of `key` read back; ValueError when it is not exactly what to_json writes for that key."""
        if not isinstance(raw, dict) or raw.get("format") != CACHE_FORMAT or raw.get("version") != CACHE_VERSION:
            raise ValueError("not a feature cache meta of this version")
        if raw.get("key") != key:
            raise ValueError("written for another key")
        dim, kind, capacity = raw.get("dim"), raw.get("dtype"), raw.get("capacity")
        if not isinstance(dim, int) or not 1 <= dim <= MAX_DIM or kind not in ROW_DTYPES:
            raise ValueError("bad row width or type")
        if not isinstance(capacity, int) or capacity < 0 or capacity % GROW_ROWS:
            raise ValueError("bad capacity")
        return cls(key, dim, ROW_DTYPES[str(kind)], capacity)


@dataclass(frozen=True)
class Checked:
    """The outcome of checking some indices' stored records: which hold a good row, and the rows ((n, D) when any
    is good, (n, 0) when none is)."""

    good: np.ndarray
    rows: np.ndarray

    @classmethod
    def nothing(cls, count: int) -> Checked:
        """No good row among `count` indices."""
        return cls(np.zeros(count, dtype=bool), np.zeros((count, 0), dtype=HALF))


class FeatureCache:
    """The prefix outputs of one frozen prefix (its `key`), one row per sample index, in `<key>.rows` beside
    `<key>.json` under `folder`.

    Each record is a 32-byte tag and the row (float16; float32 for a prefix whose finite outputs leave float16's
    range): the tag is sha256(key, the image's content digest, the row's bytes), so a row counts only for the image
    and prefix it was computed from, intact. Every row a read returns was checked against its tag and found
    within +-ROW_LIMIT; one that fails (flipped bytes, rows swapped or copied from another image, pool or backbone,
    NaN, inf, or finite values no head survives) is computed again and rewritten, with one warning per read. With
    `width` (the prefix's declared row width), a cache of rows of another width is dropped with one warning.
    Records are read with pread, never memory-mapped (a hole or a file cut short reads as zeros, an unwritten
    record, where a mapping would raise SIGBUS), and the file is grown with posix_fallocate before a meta claims
    the space. A folder that cannot be written (a full disk included) leaves the cache read-only for this process
    (one warning naming it): missing rows are then computed and not kept. A cache of another key in the folder is
    removed on opening.
    """

    def __init__(self, folder: Path, key: str, batch_size: int = 64, width: int | None = None) -> None:
        if not key or not all(character in "0123456789abcdef" for character in key):
            raise ValueError(f"a feature cache key is a hex digest, got {key[:80]!r}")
        if batch_size < 1:
            raise ValueError(f"feature batch size must be at least 1, got {batch_size}")
        self.folder, self.key, self.batch_size, self.width = Path(folder), key, batch_size, width
        self.data_path, self.meta_path = self.folder / f"{key}.rows", self.folder / f"{key}.json"
        self.writable = True
        self._tag_prefix = hashlib.sha256(key.encode())
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            self._remove_other_keys()
        except OSError as error:
            self._read_only(error)

    def rows(self, indices: np.ndarray, digests: np.ndarray, extract: Extractor) -> np.ndarray:
        """Rows (n, D) of these sample indices, in their order, float16 (float32 for a wide-range prefix): cached
        rows that pass their check, the others computed with `extract` now. `digests` are the images' content
        digests (`content_digests`), (n, 32) uint8, in the indices' order."""
        indices, digests = _checked_request(indices, digests)
        meta = self._load_meta()
        checked = self._check(meta, indices, digests)
        missing = np.flatnonzero(~checked.good)
        if not len(missing):
            return checked.rows
        computed, meta = self._compute(meta, indices[missing], digests[missing], extract, restart=True)
        if computed is None:  # the meta did not fit this prefix's rows: the cache started again, every row anew
            computed, _ = self._compute(meta, indices, digests, extract, restart=False)
            assert computed is not None  # a computation that may not restart returns its rows
            return computed
        if len(missing) == len(indices):
            return computed
        out = checked.rows.astype(computed.dtype, copy=True)
        out[missing] = computed
        return out

    def fill(self, indices: np.ndarray, digests: np.ndarray, extract: Extractor) -> None:
        """Computes the rows of these sample indices that are not cached (or fail their check): what a device runs
        ahead of a round for the images that just entered its pool."""
        self.rows(indices, digests, extract)

    def _remove_other_keys(self) -> None:
        """Deletes the rows and meta of every other key (a new prefix makes them useless) and of older versions."""
        for path in self.folder.iterdir():
            if path.suffix in (".rows", ".f16", ".json") and path.stem != self.key and path.is_file():
                log.info("feature cache removed key=%s", path.stem[:12])
                path.unlink(missing_ok=True)
        first_version = self.folder / f"{self.key}.f16"
        if first_version.is_file():  # a cache of version 1 (per-block sha256): its rows are not tied to images
            log.info("feature cache of version 1 removed key=%s", self.key[:12])
            first_version.unlink()
            self.meta_path.unlink(missing_ok=True)

    def _read_only(self, error: OSError) -> None:
        """Stops writing to the folder, with a warning naming it (once per folder and process: a device opens the
        cache every round)."""
        self.writable = False
        if self.folder not in _UNWRITABLE:
            _UNWRITABLE.add(self.folder)
            log.warning(
                "feature cache folder cannot be written, features are computed and not kept folder=%s error=%s",
                *(str(self.folder)[:300], str(error)[:200]),
            )

    def _load_meta(self) -> CacheMeta | None:
        """The meta on disk, or None when there is none; a meta that does not parse (one longer than META_BYTES, or
        nested too deep for the parser, included) drops the cache, with a warning."""
        try:
            if not self.meta_path.is_file():
                return None
            with open(self.meta_path, "rb") as handle:
                raw = handle.read(META_BYTES + 1)
        except OSError as error:
            self._read_only(error)
            return None
        try:
            if len(raw) > META_BYTES:
                raise ValueError(f"longer than {META_BYTES} bytes")
            meta = CacheMeta.from_json(json.loads(raw), self.key)
        except (ValueError, UnicodeDecodeError, RecursionError) as error:
            log.warning("feature cache meta unreadable, rebuilding key=%s error=%s", self.key[:12], str(error)[:200])
            self._drop()
            return None
        if self.width is not None and meta.dim != self.width:
            log.warning(
                "feature cache rows are not of the prefix's width, rebuilding key=%s width=%d prefix=%d",
                *(self.key[:12], meta.dim, self.width),
            )
            self._drop()
            return None
        return self._as_stored(meta)

    def _as_stored(self, meta: CacheMeta) -> CacheMeta:
        """The meta with no more capacity than the rows file holds (a shorter file was truncated: a warning)."""
        try:
            size = self.data_path.stat().st_size if self.data_path.is_file() else 0
        except OSError as error:
            self._read_only(error)
            size = 0
        held = size // meta.record.itemsize // GROW_ROWS * GROW_ROWS
        if held >= meta.capacity:
            return meta
        log.warning("feature cache rows file shorter than its meta says key=%s bytes=%d", self.key[:12], size)
        return CacheMeta(meta.key, meta.dim, meta.dtype, held)

    def _drop(self) -> None:
        """Removes this key's rows and meta (when the folder can be written)."""
        if self.writable:
            try:
                self.meta_path.unlink(missing_ok=True)
                self.data_path.unlink(missing_ok=True)
            except OSError as error:
                self._read_only(error)

    def _read(self, meta: CacheMeta, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The tags (n, 32) and rows (n, D) stored at these ascending unique indices, read with pread a batch of
        records at a time (memory: the result and one batch). A record past the file's end or in a hole reads as
        zeros (an unwritten record); no read can fault, whatever the file's state."""
        tags = np.zeros((len(indices), TAG_BYTES), dtype=np.uint8)
        rows = np.zeros((len(indices), meta.dim), dtype=meta.dtype)
        with open(self.data_path, "rb") as handle:
            for start in range(0, len(indices), READ_RECORDS):
                batch = indices[start : start + READ_RECORDS]
                records = np.zeros(len(batch), dtype=meta.record)
                _pread_runs(handle.fileno(), batch, records)
                tags[start : start + len(batch)], rows[start : start + len(batch)] = records["tag"], records["row"]
        return tags, rows

    def _check(self, meta: CacheMeta | None, indices: np.ndarray, digests: np.ndarray) -> Checked:
        """Which indices' stored rows are theirs (the tag of this key, their image's digest and the row), whole and
        within +-ROW_LIMIT; one warning for those that are stored but fail. Each stored record is read once (memory
        bounded by the file, whatever the meta claims: `_as_stored` caps its capacity at the file's size)."""
        if meta is None or not len(indices):
            return Checked.nothing(len(indices))
        inside = np.flatnonzero(indices < meta.capacity)
        if not len(inside):
            return Checked.nothing(len(indices))
        wanted, first, back = np.unique(indices[inside], return_index=True, return_inverse=True)
        try:
            tags, values = self._read(meta, wanted)
        except OSError as error:
            self._read_only(error)
            return Checked.nothing(len(indices))
        written = np.asarray(tags.any(axis=1))
        tied = written & self._tags_match(tags, values, digests[inside][first], written)
        usable = _usable_rows(values)
        self._report(wanted, values, written & ~tied, tied & ~usable)
        good = np.zeros(len(indices), dtype=bool)
        good[inside] = (tied & usable)[back]
        if not good.any():
            return Checked.nothing(len(indices))
        if np.array_equal(wanted, indices):  # a round's ascending indices: the rows as read
            return Checked(good, values)
        rows = np.zeros((len(indices), meta.dim), dtype=meta.dtype)
        rows[inside] = values[back]
        return Checked(good, rows)

    def _report(self, indices: np.ndarray, rows: np.ndarray, not_theirs: np.ndarray, unusable: np.ndarray) -> None:
        """One warning for the stored rows that failed their check: how many, why (not their tag; theirs but NaN or
        inf; theirs, finite, but beyond +-ROW_LIMIT), and the first indices."""
        failed = not_theirs | unusable
        if failed.any():
            not_finite = int((~np.isfinite(rows[unusable]).all(axis=1)).sum())
            log.warning(
                "feature cache rows failed their check, recomputing key=%s rows=%d not_theirs=%d not_finite=%d "
                "beyond_limit=%d indices=%s",
                *(
                    self.key[:12],
                    int(failed.sum()),
                    int(not_theirs.sum()),
                    not_finite,
                    int(unusable.sum()) - not_finite,
                ),
                indices[failed][:REPORTED_INDICES].tolist(),
            )

    def _tags_match(self, tags: np.ndarray, rows: np.ndarray, digests: np.ndarray, written: np.ndarray) -> np.ndarray:
        """Whether each written row's tag is the one its image's digest and the row give under this key (the bytes
        sliced in place: a round checks 10000 rows)."""
        match = np.zeros(len(rows), dtype=bool)
        tag_bytes, digest_bytes = tags.data.cast("B"), np.ascontiguousarray(digests).data.cast("B")
        row_bytes, size = rows.data.cast("B"), rows.shape[1] * rows.dtype.itemsize
        for position in np.flatnonzero(written).tolist():
            tag = self._tag_prefix.copy()
            tag.update(digest_bytes[position * DIGEST_BYTES : (position + 1) * DIGEST_BYTES])
            tag.update(row_bytes[position * size : (position + 1) * size])
            match[position] = tag.digest() == tag_bytes[position * TAG_BYTES : (position + 1) * TAG_BYTES]
        return match

    def _tag(self, digest: np.ndarray, row: np.ndarray) -> bytes:
        """sha256(key, image content digest, row bytes): what ties a row to its image and this prefix."""
        tag = self._tag_prefix.copy()
        tag.update(digest.tobytes())
        tag.update(np.ascontiguousarray(row).data)
        return tag.digest()

    def _compute(
        self, meta: CacheMeta | None, indices: np.ndarray, digests: np.ndarray, extract: Extractor, restart: bool
    ) -> tuple[np.ndarray | None, CacheMeta | None]:
        """The rows of these indices computed in batches (each sample once), stored, in the cache's row type, and
        the meta after them. With `restart`, rows that do not fit the meta read from disk (another width, values
        beyond float16) start the cache again: (None, the new meta) is returned and the rows are to be computed
        again under it; without, another width is a ValueError."""
        unique, first, inverse = np.unique(indices, return_index=True, return_inverse=True)
        parts: list[np.ndarray] = []
        for start in range(0, len(unique), self.batch_size):
            batch = slice(start, start + self.batch_size)
            rows = np.asarray(extract(unique[batch]))
            if rows.ndim != 2 or len(rows) != len(unique[batch]):
                raise ValueError(f"the prefix gave rows {rows.shape} for {len(unique[batch])} samples")
            if meta is not None and not _fits(meta, rows):
                if not restart or parts:
                    raise ValueError(f"the prefix gave rows {rows.shape}, the cache holds rows of {meta.dim}")
                return None, self._restart(meta, rows)
            meta = meta or self._new_meta(rows)
            parts.append(rows.astype(meta.dtype))
            meta = self._store(meta, unique[batch], digests[first[batch]], parts[-1])
        return np.concatenate(parts)[inverse], meta

    def _new_meta(self, rows: np.ndarray) -> CacheMeta:
        """The meta of an empty cache for rows like these (float16 when they fit it)."""
        return CacheMeta(self.key, int(rows.shape[1]), HALF if _fits_half(rows) else SINGLE)

    def _restart(self, meta: CacheMeta, rows: np.ndarray) -> CacheMeta:
        """Starts this key's cache again for rows like these (another width, or float32 for values beyond float16's
        range; the old rows will all be computed again), with one warning; returns the new meta."""
        fresh = CacheMeta(self.key, int(rows.shape[1]), HALF if _fits_half(rows) and meta.dtype == HALF else SINGLE)
        finite = np.abs(rows[np.isfinite(rows)])
        log.warning(
            "feature cache rows do not fit its meta, starting again key=%s width=%d/%d largest=%.4g rows=%s",
            *(self.key[:12], rows.shape[1], meta.dim, float(finite.max()) if finite.size else 0.0),
            "float16" if fresh.dtype == HALF else "float32",
        )
        self._drop()
        self._write_meta(fresh)
        return fresh

    def _store(self, meta: CacheMeta, indices: np.ndarray, digests: np.ndarray, rows: np.ndarray) -> CacheMeta:
        """Writes the rows within +-ROW_LIMIT with their tags at their indices (growing the file by whole blocks,
        then its meta), synced; returns the meta. Other rows (NaN, inf, beyond the limit) are not kept (a
        warning)."""
        usable = _usable_rows(rows)
        if not usable.all():
            log.warning(
                "feature cache prefix gave rows out of range, not kept key=%s rows=%d indices=%s",
                *(self.key[:12], int((~usable).sum()), indices[~usable][:REPORTED_INDICES].tolist()),
            )
        if not self.writable or not usable.any():
            return meta
        records = np.zeros(int(usable.sum()), dtype=meta.record)
        records["row"] = rows[usable]
        for position, digest in enumerate(digests[usable]):
            records["tag"][position] = np.frombuffer(self._tag(digest, records["row"][position]), np.uint8)
        try:
            grown = self._write_records(meta, indices[usable], records)
        except OSError as error:
            self._read_only(error)
            return meta
        log.info("feature cache extended key=%s rows=%d capacity=%d", self.key[:12], len(records), grown.capacity)
        return grown

    def _write_records(self, meta: CacheMeta, indices: np.ndarray, records: np.ndarray) -> CacheMeta:
        """pwrites the records at their indices and syncs; a file grown past the meta's capacity has its space
        allocated first (`_reserve`) and then gets a new meta, so a meta never claims space the disk lacks."""
        capacity = max(meta.capacity, (int(indices.max()) // GROW_ROWS + 1) * GROW_ROWS)
        size = meta.record.itemsize
        with open(self.data_path, "r+b" if self.data_path.exists() else "w+b") as handle:
            if capacity > meta.capacity:
                _reserve(handle.fileno(), meta.capacity * size, capacity * size)
            for index, record in zip(indices.tolist(), records):
                os.pwrite(handle.fileno(), record.tobytes(), index * size)
            os.fsync(handle.fileno())
        if capacity == meta.capacity:
            return meta
        grown = CacheMeta(meta.key, meta.dim, meta.dtype, capacity)
        self._write_meta(grown)
        return grown

    def _write_meta(self, meta: CacheMeta) -> None:
        """Replaces the meta atomically (a folder that cannot be written turns the cache read-only)."""
        if not self.writable:
            return
        try:
            atomic_write_bytes(self.meta_path, json.dumps(meta.to_json()).encode())
        except OSError as error:
            self._read_only(error)


def _checked_request(indices: np.ndarray, digests: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The indices as int64 and their digests as (n, 32) uint8; ValueError for negatives or mismatched digests."""
    indices = np.asarray(indices, dtype=np.int64)
    digests = np.asarray(digests)
    if len(indices) and int(indices.min()) < 0:
        raise ValueError(f"sample indices must be non-negative, got {int(indices.min())}")
    if digests.dtype != np.uint8 or digests.shape != (len(indices), DIGEST_BYTES):
        raise ValueError(f"content digests must be ({len(indices)}, {DIGEST_BYTES}) uint8, got {digests.shape}")
    return indices, digests


def _fits(meta: CacheMeta, rows: np.ndarray) -> bool:
    """Whether rows fit a cache of this meta: its width, and its row type's range."""
    return rows.shape[1] == meta.dim and (meta.dtype == SINGLE or _fits_half(rows))


def _fits_half(rows: np.ndarray) -> bool:
    """Whether every finite value of the rows stays finite in float16 (|x| below 65520, which rounds to 65504)."""
    with np.errstate(over="ignore"):
        return bool(np.isfinite(rows.astype(HALF))[np.isfinite(rows)].all())


def _usable_rows(rows: np.ndarray) -> np.ndarray:
    """Which rows (n, D) hold values within +-ROW_LIMIT only (NaN and inf are not); for float16, whose finite
    values all are, by their magnitude bits (below 0x7C00, the all-ones exponent of inf and NaN): numpy's isfinite
    on float16 is several times slower on a round's 10000 x 1280."""
    if rows.dtype != HALF:  # reductions, not an elementwise copy of a round's rows (NaN propagates: not usable)
        return (rows.max(axis=1, initial=-np.inf) <= ROW_LIMIT) & (rows.min(axis=1, initial=np.inf) >= -ROW_LIMIT)
    return (np.ascontiguousarray(rows).view(np.uint16) & 0x7FFF).max(axis=1, initial=0) < 0x7C00


def _pread_runs(descriptor: int, indices: np.ndarray, records: np.ndarray) -> None:
    """Reads the records at these ascending indices into `records`, one pread per run of consecutive indices; what
    lies past the file's end is left as it is (zeros)."""
    size = records.dtype.itemsize
    breaks = np.flatnonzero(np.diff(indices) != 1) + 1
    for start, stop in zip([0, *breaks.tolist()], [*breaks.tolist(), len(indices)]):
        view, offset = records[start:stop].data.cast("B"), int(indices[start]) * size
        while len(view):
            count = os.preadv(descriptor, [view], offset)
            if not count:
                break
            view, offset = view[count:], offset + count


def _reserve(descriptor: int, claimed: int, wanted: int) -> None:
    """Allocates the rows file's blocks up to `wanted` bytes from its start (holes an older version left included),
    so no write or read of the rows a grown meta claims can meet a block the disk lacks. When the disk cannot hold
    them (ENOSPC), the file is cut back to the `claimed` bytes the meta already claims, giving back what was
    allocated, and the error is raised: the cache stays at its old capacity."""
    try:
        os.posix_fallocate(descriptor, 0, wanted)
    except OSError:
        os.ftruncate(descriptor, claimed)
        raise
