# Field pools: images a camera writes to a folder -> decoded model inputs in an append-only item store, with quarantine.
from __future__ import annotations

import dataclasses
import json
import logging
import mmap
import os
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from edge_agent.data.device_data import IMAGES_FILE, LABELS_FILE, DeviceData, initialise_store
from edge_agent.data.feature_cache import DIGEST_BYTES, content_digests
from edge_agent.data.image_files import (
    MODEL_INPUT,
    QUARANTINE_DIR,
    InputSpec,
    UnreadableImageError,
    decode_image,
    folder_files,
)
from edge_agent.learning.bundle import file_sha256
from protocol.errors import UsageError
from protocol.model_spec import CLASS_NAMES

log = logging.getLogger(__name__)

DEFAULT_SETTLE_SECONDS = 2.0
SCAN_BATCH = 128  # decoded images a scan holds before it appends them (a first scan of 4000 files held them all)


@dataclass(frozen=True)
class PoolItem:
    """One image of the pool: where it was found (relative path), its file's sha256, and the file's size, mtime,
    ctime and inode when it joined (items stored before ctime and inode were kept read them as 0)."""

    path: str
    sha256: str
    size: int
    mtime_ns: int
    ctime_ns: int = 0
    inode: int = 0

    @property
    def signature(self) -> tuple[int, int, int, int]:
        """What a scan compares a file's stat with: a change in any of these has the file hashed again."""
        return (self.size, self.mtime_ns, self.ctime_ns, self.inode)


def file_signature(stat: os.stat_result) -> tuple[int, int, int, int]:
    """A file's size, mtime, ctime and inode: `cp -p`, `rsync -t` or a restore keep size and mtime but set ctime
    (which no user call can set back) or bring a new inode."""
    return (stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns, stat.st_ino)


class FolderPool:
    """Images found in a folder, decoded once into an append-only store; an item's index never changes.

    Store files: items.jsonl (one PoolItem per line), images.u8 (the decoded images, back to back) and digests.bin
    (each decoded image's content digest, 32 bytes, what the feature cache ties rows to). Images and digests are
    appended and synced before their lines, so a crash leaves at most a tail that the next open cuts off (digests
    missing for stored images are computed from images.u8). Files still being written (modified less than
    settle_seconds ago) wait for a later scan; files that do not decode move to the quarantine folder. A file whose
    size, mtime, ctime or inode changed is hashed again, and new content joins as a new item (the old item keeps
    its decoded image, labels and features). Nothing in the folder is ever deleted.
    """

    ITEMS_FILE = "items.jsonl"
    IMAGES_FILE = "images.u8"
    DIGESTS_FILE = "digests.bin"

    def __init__(
        self,
        pool_dir: Path | str,
        store_dir: Path | str,
        spec: InputSpec = MODEL_INPUT,
        settle_seconds: float = DEFAULT_SETTLE_SECONDS,
        quarantine_dir: Path | str | None = None,
        skip_dirs: tuple[Path, ...] = (),
    ) -> None:
        self.pool_dir = Path(pool_dir)
        if not self.pool_dir.is_dir():
            raise UsageError(f"pool folder {self.pool_dir} does not exist")
        self.store_dir = Path(store_dir)
        self.spec = spec
        self.settle_seconds = settle_seconds
        self.quarantine_dir = Path(quarantine_dir) if quarantine_dir else self.pool_dir / QUARANTINE_DIR
        self._skip_dirs = {path.resolve() for path in (self.quarantine_dir, self.store_dir, *skip_dirs)}
        self.store_dir.mkdir(parents=True, exist_ok=True)
        self.items = self._load_items()
        self._mapping: mmap.mmap | None = None
        self._images = self._map_images()
        self._digests = self._load_digests()
        self._seen = {item.path: item.signature for item in self.items}
        self._hashes = {item.sha256 for item in self.items}

    def __len__(self) -> int:
        return len(self.items)

    def images(self) -> np.ndarray:
        """Every stored image, (N, *record_shape) uint8, memory-mapped read-only."""
        return self._images

    def read(self, indices: np.ndarray) -> np.ndarray:
        """A uint8 copy of the images at these indices. The mapped pages the copy touched then leave the process's
        resident set (they stay in the page cache): reading a pool of camera images once, for the feature cache,
        would otherwise keep all of it resident (27 KB an image at 96 px, 110 MB for a Pi Zero's 4000)."""
        copied = np.take(self._images, indices, axis=0)
        if self._mapping is not None:
            self._mapping.madvise(mmap.MADV_DONTNEED)
        return copied

    def refresh(self) -> int:
        """Scans the folder now (the image-source view of scan); returns how many items joined."""
        return self.scan()

    def digests(self, indices: np.ndarray) -> np.ndarray:
        """The content digests of the decoded images at these indices, (n, 32) uint8 (hashed once, when they joined)."""
        return self._digests[indices]

    def item(self, index: int) -> PoolItem:
        """The pool item at an index."""
        return self.items[index]

    def scan(self, now: float | None = None) -> int:
        """Adds the folder's new, settled JPEG/PNG files to the store (oldest first), SCAN_BATCH at a time, so a scan
        holds at most that many decoded images; returns how many joined."""
        now = time.time() if now is None else now
        joined = 0
        new_items: list[PoolItem] = []
        records: list[np.ndarray] = []
        for path, rel, stat in self._candidates():
            signature = file_signature(stat)
            if self._seen.get(rel) == signature or now - stat.st_mtime < self.settle_seconds:
                continue
            replaced, self._seen[rel] = rel in self._seen, signature
            digest = file_sha256(path)
            if digest in self._hashes:
                log.debug("known image file=%s", rel)
                continue
            try:
                record = decode_image(path, self.spec)
            except UnreadableImageError as error:
                self._quarantine(path, rel, error)
                continue
            if replaced:
                log.info("pool file replaced, its new content joins as a new item file=%s", rel)
            self._hashes.add(digest)
            new_items.append(PoolItem(rel, digest, *signature))
            records.append(record)
            if len(records) == SCAN_BATCH:
                joined += self._append(new_items, records)
                new_items, records = [], []
        joined += self._append(new_items, records)
        if joined:
            log.info("pool grew new=%d items=%d", joined, len(self.items))
        return joined

    def _candidates(self) -> Iterator[tuple[Path, str, os.stat_result]]:
        """(path, relative POSIX path, stat) of every visible regular file, oldest modification first."""
        found = folder_files(self.pool_dir, self._skip_dirs)
        return iter(sorted(found, key=lambda entry: (entry[2].st_mtime_ns, entry[1])))

    def _quarantine(self, path: Path, rel: str, error: UnreadableImageError) -> None:
        """Moves an undecodable file to the quarantine folder (never deleting it) and logs why."""
        target = self.quarantine_dir / rel
        suffix = 0
        while target.exists():
            suffix += 1
            target = self.quarantine_dir / f"{rel}.{suffix}"
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.move(str(path), str(target))
        except OSError as exc:
            log.error("could not quarantine file=%s reason=%s error=%s", rel, error, exc)
            return
        log.warning("quarantined file=%s to=%s reason=%s", rel, target, error)

    def _append(self, items: list[PoolItem], records: list[np.ndarray]) -> int:
        """Appends images and their digests, then their index lines, each synced, and remaps the store; returns how
        many joined (none: nothing written)."""
        if not items:
            return 0
        _append_synced(self.store_dir / self.IMAGES_FILE, b"".join(record.tobytes() for record in records))
        digests = content_digests(np.stack(records))
        _append_synced(self.store_dir / self.DIGESTS_FILE, digests.tobytes())
        lines = "".join(json.dumps(dataclasses.asdict(item), sort_keys=True) + "\n" for item in items)
        _append_synced(self.store_dir / self.ITEMS_FILE, lines.encode())
        self.items.extend(items)
        self._images = self._map_images()
        self._digests = np.concatenate([self._digests, digests])
        return len(items)

    def _load_items(self) -> list[PoolItem]:
        """The stored items; an unfinished last line (a crash mid-append) is cut off."""
        path = self.store_dir / self.ITEMS_FILE
        raw = path.read_bytes() if path.is_file() else b""
        complete = raw[: raw.rfind(b"\n") + 1]
        if len(complete) != len(raw):
            os.truncate(path, len(complete))
        items = []
        for number, line in enumerate(complete.decode().splitlines(), start=1):
            try:
                items.append(PoolItem(**json.loads(line)))
            except (json.JSONDecodeError, TypeError) as exc:
                raise ValueError(f"{path}: line {number} is not a pool item ({exc})") from exc
        return items

    def _map_images(self) -> np.ndarray:
        """The decoded images of the stored items, after cutting off images appended without their index line."""
        path = self.store_dir / self.IMAGES_FILE
        needed = len(self.items) * self.spec.record_bytes
        size = path.stat().st_size if path.is_file() else 0
        if size < needed:
            raise ValueError(f"{path}: {size} bytes, but {len(self.items)} items need {needed}; the store is damaged")
        if size > needed:
            os.truncate(path, needed)
        self._mapping = None
        if not self.items:
            return np.zeros((0, *self.spec.record_shape), dtype=np.uint8)
        with open(path, "rb") as handle:
            self._mapping = mmap.mmap(handle.fileno(), needed, access=mmap.ACCESS_READ)
        return np.frombuffer(self._mapping, dtype=np.uint8).reshape(len(self.items), *self.spec.record_shape)

    def _load_digests(self) -> np.ndarray:
        """The stored images' content digests; a tail past the items is cut off, and digests missing (a store
        written before they were kept, or a crash between the appends) are computed from images.u8 and appended."""
        path = self.store_dir / self.DIGESTS_FILE
        size = path.stat().st_size if path.is_file() else 0
        needed = len(self.items) * DIGEST_BYTES
        if size > needed:
            os.truncate(path, needed)
        kept = size - size % DIGEST_BYTES if size < needed else needed
        digests = np.fromfile(path, np.uint8, kept).reshape(-1, DIGEST_BYTES) if kept else _no_digests()
        if len(digests) < len(self.items):
            if path.is_file():
                os.truncate(path, kept)
            missing = content_digests(self._images[len(digests) :])
            _append_synced(path, missing.tobytes())
            digests = np.concatenate([digests, missing])
        return digests


def _no_digests() -> np.ndarray:
    """An empty (0, 32) digest array."""
    return np.zeros((0, DIGEST_BYTES), dtype=np.uint8)


def _append_synced(path: Path, data: bytes) -> None:
    """Appends bytes to a file and flushes them to disk."""
    with open(path, "ab") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())


POOL_STORE = "pool"


def open_folder_data(
    state_dir: Path | str,
    pool_dir: Path | str,
    pool_cap: int,
    spec: InputSpec = MODEL_INPUT,
    settle_seconds: float = DEFAULT_SETTLE_SECONDS,
    skip_dirs: tuple[Path, ...] = (),
    num_classes: int = len(CLASS_NAMES),
) -> DeviceData:
    """A device's store over a camera folder (its indices are the pool's stable item indices), resumed or started,
    after one scan, for a model of `spec`'s input shape and `num_classes` classes. The unlabelled pool is the newest
    pool_cap items; older unlabelled ones leave the pool index (their files stay where they are)."""
    state_dir = Path(state_dir)
    agents_own = InputSpec(spec.channels, spec.height, spec.width)
    if not spec.same_as(agents_own):
        raise UsageError(f"the agent's models take {agents_own.describe()}; the manifest says {spec.describe()}")
    if pool_cap < 1:
        raise UsageError(f"the pool size cap must be positive, got {pool_cap}")
    if (state_dir / IMAGES_FILE).exists():
        raise UsageError(f"{state_dir} holds a shard's device data; use a fresh state directory for a folder pool")
    pool = FolderPool(pool_dir, state_dir / POOL_STORE, spec, settle_seconds, skip_dirs=(state_dir, *skip_dirs))
    if not (state_dir / LABELS_FILE).is_file():
        initialise_store(state_dir, num_classes=num_classes)
    data = DeviceData(state_dir, pool, pool_cap)
    data.refresh()
    return data


def folder_pool_of(data: DeviceData) -> FolderPool:
    """The folder pool a device's store reads its images from (ValueError for a shard device)."""
    if not isinstance(data.source, FolderPool):
        raise ValueError(f"{data.state_dir} is a shard device, not a folder pool")
    return data.source
