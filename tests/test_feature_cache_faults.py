# The feature cache attacked as a person with shell access would: forged, foreign, NaN rows, huge outputs, no writes.
from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from test_feature_cache import HEAD, SPEC, backbone_rows, export
from test_folder_score import run_score
from tmpfs import PAGE, fill_leaving, free_bytes

from edge_agent.data.feature_cache import ROW_LIMIT, FeatureCache
from edge_agent.data.image_files import InputSpec
from edge_agent.field.folder_pool import folder_pool_of, open_folder_data
from edge_agent.field.parts import PoolFeatures
from edge_agent.learning.bundle import load_bundle
from edge_agent.learning.head_learner import device_prefix
from edge_agent.learning.models import build_model, get_weights
from edge_agent.loop.agent import LatestModel
from protocol import messages
from protocol.tensors import Weights, weights_hash

__all__ = ["backbone_rows"]  # a fixture

POOL = 40
SCORE = ("--passes", "5", "--top", "10", "--seed", "3")
SCALE = 1e6  # the huge backbone's prefix outputs, times the ordinary one's (its tail divides them back)


def pool_folder(folder: Path, seed: int = 0, count: int = POOL) -> np.ndarray:
    """A folder of 16x16 RGB PNGs 000.png... stored uncompressed (so any two files have the same size); returns
    the images, which are the pixels the model sees (the bundle's input size)."""
    images = np.random.default_rng(seed).integers(0, 256, (count, 16, 16, 3), dtype=np.uint8)
    folder.mkdir(parents=True)
    for index, image in enumerate(images):
        Image.fromarray(image).save(folder / f"{index:03d}.png", compress_level=0)
    return images


@pytest.fixture(scope="module")
def weights() -> Weights:
    return get_weights(build_model(SPEC, seed=0))


@pytest.fixture(scope="module")
def bundle(tmp_path_factory: pytest.TempPathFactory, weights: Weights) -> Path:
    folder = tmp_path_factory.mktemp("bundle") / "b"
    export(weights, folder)
    return folder


def scored(bundle: Path, pool: Path, cache: Path | None = None) -> tuple[list[int], list[str]]:
    """`edge-agent score` as a process: the selected indices and the warning lines; it must exit 0."""
    done = run_score(bundle, pool, *SCORE, *(("--cache-dir", str(cache)) if cache else ()))
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)["indices"], [line for line in done.stderr.splitlines() if "WARNING" in line]


def pixels(images: np.ndarray) -> np.ndarray:
    """The model inputs `edge-agent score` decodes a folder's images to, (N, C, H, W) float32 in [0, 1]: what it
    hashes into each image's content digest (an attacker computes them with numpy alone)."""
    return images.transpose(0, 3, 1, 2).astype(np.float32) / 255


class Pool:
    """A pool folder scored once without a cache and once into a clean cache (shared by a module's tests)."""

    def __init__(self, folder: Path, bundle: Path) -> None:
        self.images = pool_folder(folder / "pool")
        self.digests = [hashlib.sha256(image.tobytes()).digest() for image in pixels(self.images)]
        self.folder, self.plain, warnings = folder / "pool", *scored(bundle, folder / "pool")
        self.clean = folder / "clean-cache"
        assert warnings == [] and scored(bundle, self.folder, self.clean) == (self.plain, [])

    def cache(self, tmp_path: Path) -> Path:
        """A copy of the clean cache for one test to damage."""
        return Path(shutil.copytree(self.clean, tmp_path / "cache"))


@pytest.fixture(scope="module")
def pool(tmp_path_factory: pytest.TempPathFactory, bundle: Path) -> Pool:
    return Pool(tmp_path_factory.mktemp("pool"), bundle)


class OnDisk:
    """A cache folder read and rewritten from its layout alone (numpy and hashlib, not the project's code): records
    of a 32-byte tag and the row, tag = sha256(key, sha256 of the image's pixels, row bytes)."""

    def __init__(self, folder: Path) -> None:
        [self.meta_path] = folder.glob("*.json")
        self.meta = json.loads(self.meta_path.read_text())
        self.rows_path = self.meta_path.with_suffix(".rows")
        row = np.dtype("<f2" if self.meta["dtype"] == "f2" else "<f4")
        self.record = np.dtype([("tag", np.uint8, (32,)), ("row", row, (self.meta["dim"],))])

    def records(self) -> np.ndarray:
        """Every record of the rows file (a copy)."""
        return np.fromfile(self.rows_path, dtype=self.record)

    def write(self, records: np.ndarray) -> None:
        """Rewrites the rows file."""
        records.tofile(self.rows_path)

    def tag(self, image: np.ndarray, row: np.ndarray) -> np.ndarray:
        """The tag the attacker computes for a row claimed for this image."""
        return self.digest_tag(hashlib.sha256(np.ascontiguousarray(image).tobytes()).digest(), row)

    def digest_tag(self, digest: bytes, row: np.ndarray) -> np.ndarray:
        """The tag of a row claimed for the image of this content digest (a device's `pool/digests.bin` holds them)."""
        tag = hashlib.sha256(self.meta["key"].encode() + digest + np.ascontiguousarray(row).tobytes()).digest()
        return np.frombuffer(tag, np.uint8)

    def forge(self, rows: np.ndarray, digests: list[bytes]) -> None:
        """Replaces the cache with these rows (their width and type in the meta), each with the valid tag of its
        image's digest: a cache the device could have written, for another prefix."""
        kind = "f2" if rows.dtype == np.float16 else "f4"
        record = np.dtype([("tag", np.uint8, (32,)), ("row", rows.dtype, (rows.shape[1],))])
        records = np.zeros(self.meta["capacity"], dtype=record)
        records["row"][: len(rows)] = rows
        for index, digest in enumerate(digests):
            records["tag"][index] = self.digest_tag(digest, rows[index])
        self.write(records)
        self.meta = {**self.meta, "dim": rows.shape[1], "dtype": kind}
        self.meta_path.write_text(json.dumps(self.meta))


def nan_rows_retagged(disk: OnDisk, images: np.ndarray) -> None:
    """Rows 3 and 17 become NaN and inf, and their tags are recomputed to match (the block hashes rewritten)."""
    records = disk.records()
    for index, value in ((3, np.nan), (17, np.inf)):
        records["row"][index] = value
        records["tag"][index] = disk.tag(pixels(images)[index], records["row"][index])
    disk.write(records)


def nan_rows_as_written(disk: OnDisk, images: np.ndarray) -> None:
    """Rows 5 and 6 become NaN, their tags left as they were."""
    records = disk.records()
    records["row"][5:7] = np.nan
    disk.write(records)


def swapped_rows(disk: OnDisk, images: np.ndarray) -> None:
    """The records (tag and row) of images 2 and 30 trade places, as do those of 11 and 12."""
    records = disk.records()
    records[[2, 30, 11, 12]] = records[[30, 2, 12, 11]]
    disk.write(records)


def tagged_for_another_image(disk: OnDisk, images: np.ndarray) -> None:
    """Image 8's row is copied to image 9 with a tag claiming it for image 8 (as if computed from image 8)."""
    records = disk.records()
    records[9] = records[8]
    disk.write(records)


@pytest.mark.parametrize(
    "tamper",
    [nan_rows_retagged, nan_rows_as_written, swapped_rows, tagged_for_another_image],
    ids=lambda tamper: tamper.__name__,
)
def test_score_with_a_tampered_cache_recomputes_those_rows_warns_once_and_selects_what_no_cache_selects(
    tmp_path: Path, bundle: Path, pool: Pool, tamper: Callable[[OnDisk, np.ndarray], None]
) -> None:
    cache = pool.cache(tmp_path)
    tamper(OnDisk(cache), pool.images)
    selected, warnings = scored(bundle, pool.folder, cache)
    assert selected == pool.plain and len(warnings) == 1, warnings
    assert "feature cache rows failed their check, recomputing" in warnings[0] and len(warnings[0]) < 400
    assert scored(bundle, pool.folder, cache) == (pool.plain, []), "the rows were rewritten"


def test_nan_and_inf_rows_with_valid_tags_are_named_not_finite(tmp_path: Path, bundle: Path, pool: Pool) -> None:
    cache = pool.cache(tmp_path)
    nan_rows_retagged(OnDisk(cache), pool.images)
    selected, warnings = scored(bundle, pool.folder, cache)
    assert selected == pool.plain and "rows=2 not_theirs=0 not_finite=2 beyond_limit=0 indices=[3, 17]" in warnings[0]


@pytest.mark.parametrize("change", [-128, 8], ids=["narrower", "wider"])
def test_a_cache_forged_with_another_width_and_valid_tags_is_rebuilt_with_one_warning(
    tmp_path: Path, bundle: Path, pool: Pool, change: int
) -> None:
    """Rows of another width, each with the tag its image and row give under this key, the meta saying that
    width (what a cache of another backbone, or a person with the layout, leaves): `edge-agent score` crashed
    reshaping them for the tail. Now the width is checked against the prefix graph's output: one warning, every
    row computed again, the selection of no cache; the next run is quiet."""
    cache = pool.cache(tmp_path)
    disk = OnDisk(cache)
    width = disk.meta["dim"] + change
    disk.forge(np.random.default_rng(1).normal(size=(POOL, width)).astype(np.float16), pool.digests)
    selected, warnings = scored(bundle, pool.folder, cache)
    assert selected == pool.plain and len(warnings) == 1 and len(warnings[0]) < 300, warnings
    assert (
        f"rows are not of the prefix's width, rebuilding key={disk.meta['key'][:12]} width={width} prefix=256"
        in (warnings[0])
    )
    assert scored(bundle, pool.folder, cache) == (pool.plain, []) and OnDisk(cache).meta["dim"] == 256


@pytest.mark.parametrize(
    "forged",
    [
        lambda meta: b"[" * 100_000,
        lambda meta: json.dumps({**meta, "padding": " " * 1_000_000}).encode(),
    ],
    ids=["nested-100000-deep", "1-MB-long"],
)
def test_a_meta_forged_nested_too_deep_or_too_long_is_one_warning_and_a_rebuild(
    tmp_path: Path, bundle: Path, pool: Pool, forged: Callable[[dict], bytes]
) -> None:
    """A meta of 100000 '[' (json.loads raised RecursionError, a traceback on every run) or one of 1 MB (read
    whole): the meta is read up to 4 KiB and refused with one bounded warning; the cache is rebuilt."""
    cache = pool.cache(tmp_path)
    disk = OnDisk(cache)
    disk.meta_path.write_bytes(forged(disk.meta))
    selected, warnings = scored(bundle, pool.folder, cache)
    assert selected == pool.plain and len(warnings) == 1 and len(warnings[0]) < 400, warnings
    assert "feature cache meta unreadable, rebuilding" in warnings[0]
    assert scored(bundle, pool.folder, cache) == (pool.plain, [])


def huge_rows_forged(pool: Pool, cache: Path, value: float) -> OnDisk:
    """The cache as float32 with rows 3 and 17 set to +value and -value, every tag valid."""
    disk = OnDisk(cache)
    rows = disk.records()["row"][:POOL].astype(np.float32)
    rows[3], rows[17] = value, -value
    disk.forge(rows, pool.digests)
    return disk


@pytest.mark.parametrize("value", [3e38, 2.0**41], ids=["3e38", "2^41"])
def test_finite_rows_beyond_the_limit_with_valid_tags_are_recomputed_not_scored(
    tmp_path: Path, bundle: Path, pool: Pool, value: float
) -> None:
    """Finite float32 rows of 3e38 (and just past the limit, 2^41) with valid tags: the tail's softmax turned them
    into NaN and `edge-agent score` died on every run. Now they fail their check like a bad tag: one bounded
    warning naming them, recomputed, the selection of no cache, the next run quiet."""
    cache = pool.cache(tmp_path)
    huge_rows_forged(pool, cache, value)
    selected, warnings = scored(bundle, pool.folder, cache)
    assert selected == pool.plain and len(warnings) == 1 and len(warnings[0]) < 300, warnings
    assert "rows=2 not_theirs=0 not_finite=0 beyond_limit=2 indices=[3, 17]" in warnings[0]
    assert scored(bundle, pool.folder, cache) == (pool.plain, [])


def test_rows_at_the_limit_with_valid_tags_are_used_and_only_mislead(tmp_path: Path, bundle: Path, pool: Pool) -> None:
    """Rows of +-2^40 (the limit) with valid tags pass their check: the score runs on them without a warning or a
    traceback, and image 3, the most uncertain without a cache, is now confidently scored and left out (misled,
    as by an edited label)."""
    cache = pool.cache(tmp_path)
    huge_rows_forged(pool, cache, ROW_LIMIT)
    selected, warnings = scored(bundle, pool.folder, cache)
    assert warnings == [] and pool.plain[0] == 3 and 3 not in selected


def test_another_backbones_rows_under_this_key_with_the_meta_edited_are_all_recomputed(
    tmp_path: Path, bundle: Path, pool: Pool
) -> None:
    other = tmp_path / "other-bundle"
    export(get_weights(build_model(SPEC, seed=1)), other)
    scored(other, pool.folder, tmp_path / "foreign")
    cache = pool.cache(tmp_path)
    ours, theirs = OnDisk(cache), OnDisk(tmp_path / "foreign")
    assert ours.meta["key"] != theirs.meta["key"]
    shutil.copyfile(theirs.rows_path, ours.rows_path)
    ours.meta_path.write_text(json.dumps({**theirs.meta, "key": ours.meta["key"]}))
    selected, warnings = scored(bundle, pool.folder, cache)
    assert selected == pool.plain and len(warnings) == 1 and f"rows={POOL} not_theirs={POOL}" in warnings[0], warnings


def test_an_image_replaced_with_the_same_name_size_and_mtime_gets_its_own_features(
    tmp_path: Path, bundle: Path
) -> None:
    """`cp -p` of another picture over 007.png (uncompressed PNGs of one size), its mtime set back as a restore
    does: the cache's key (the folder's path, names, sizes and mtimes) is unchanged, the row is not the new
    image's."""
    pool_folder(tmp_path / "pool")
    pool_folder(tmp_path / "elsewhere", seed=9, count=1)
    scored(bundle, tmp_path / "pool", tmp_path / "cache")
    target = tmp_path / "pool" / "007.png"
    before = target.stat()
    subprocess.run(["cp", "-p", str(tmp_path / "elsewhere" / "000.png"), str(target)], check=True)
    os.utime(target, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert (target.stat().st_size, target.stat().st_mtime_ns) == (before.st_size, before.st_mtime_ns)
    plain, _ = scored(bundle, tmp_path / "pool")
    selected, warnings = scored(bundle, tmp_path / "pool", tmp_path / "cache")
    assert (
        selected == plain
        and len(warnings) == 1
        and "rows=1 not_theirs=1 not_finite=0 beyond_limit=0 indices=[7]" in warnings[0]
    )


@pytest.fixture
def huge_bundle(tmp_path: Path, weights: Weights) -> Path:
    """A real bundle whose frozen prefix outputs reach ~1e6 (conv3 scaled up) while its tail scales them back
    (conv4's weights scaled down): the same model, with finite prefix outputs far beyond float16's 65504."""
    huge = dict(weights)
    huge["conv3.weight"], huge["conv3.bias"] = weights["conv3.weight"] * SCALE, weights["conv3.bias"] * SCALE
    huge["conv4.weight"] = weights["conv4.weight"] / SCALE
    export(huge, tmp_path / "huge")
    return tmp_path / "huge"


def test_a_backbone_beyond_float16s_range_is_cached_in_float32_and_selects_as_without_a_cache(
    tmp_path: Path, huge_bundle: Path, pool: Pool
) -> None:
    """Uncached, the huge bundle selects what the ordinary one does; cached (twice), the same, with no warning; a
    meta edited to say float16 is one warning and every row computed again in float32."""
    plain, _ = scored(huge_bundle, pool.folder)
    assert plain == pool.plain, "the huge bundle is the same model"
    assert scored(huge_bundle, pool.folder, tmp_path / "cache") == (plain, [])
    disk = OnDisk(tmp_path / "cache")
    rows = disk.records()["row"][:POOL]
    assert disk.meta["dtype"] == "f4" and np.isfinite(rows).all() and np.abs(rows).max() > 65504
    assert scored(huge_bundle, pool.folder, tmp_path / "cache") == (plain, [])
    disk.meta_path.write_text(json.dumps({**disk.meta, "dtype": "f2"}))
    selected, warnings = scored(huge_bundle, pool.folder, tmp_path / "cache")
    assert selected == plain and len(warnings) == 2, warnings
    assert "rows failed their check" in warnings[0] and "starting again" in warnings[1] and "float32" in warnings[1]
    assert OnDisk(tmp_path / "cache").meta["dtype"] == "f4"


def test_a_full_tmpfs_costs_the_cache_not_the_device_and_the_cache_comes_back_when_space_does(
    tmp_path: Path, bundle: Path, pool: Pool, tmpfs: Path
) -> None:
    """A tmpfs with five pages left: room for the meta and the first batch of rows, not for the cache's first block
    of 256. The cache grew its file sparse, wrote the meta claiming the block, hit ENOSPC on the next batch, and
    the next process memory-mapped the holes: SIGBUS on every start. Now the block is allocated before a meta
    claims it: no space, no meta, what was allocated given back; each run scores as without a cache with one
    warning naming the disk full, and once space is freed the cache is written and read again."""
    cache, batch = tmpfs / "cache", ("--batch", "16")
    filler = fill_leaving(tmpfs, 5)
    for _ in range(2):  # the second run is a fresh process over what the first left
        done = run_score(bundle, pool.folder, *SCORE, *batch, "--cache-dir", str(cache))
        warnings = [line for line in done.stderr.splitlines() if "WARNING" in line]
        assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr[-2000:]
        assert json.loads(done.stdout)["indices"] == pool.plain and len(warnings) == 1 and len(warnings[0]) < 500
        assert "feature cache folder cannot be written" in warnings[0] and "No space left on device" in warnings[0]
    assert free_bytes(tmpfs) >= 4 * PAGE, "the cache gave back what it allocated"
    filler.unlink()
    assert scored(bundle, pool.folder, cache) == (pool.plain, [])
    assert OnDisk(cache).meta["capacity"] == 256 and scored(bundle, pool.folder, cache) == (pool.plain, [])


def test_a_cache_with_holes_on_a_full_tmpfs_is_read_without_a_fault(
    tmp_path: Path, bundle: Path, pool: Pool, tmpfs: Path
) -> None:
    """What an older version left: a meta claiming 256 rows over a sparse file holding the first 16, on a tmpfs
    filled to the last page (a mapped read of a hole there needs a page: SIGBUS). The holes read as unwritten rows,
    are computed (rewriting them fails: one warning), and the run scores as without a cache."""
    cache = Path(shutil.copytree(pool.clean, tmpfs / "cache"))
    disk = OnDisk(cache)
    first = disk.records()[:16]
    with open(disk.rows_path, "r+b") as handle:
        handle.truncate(0)
        handle.truncate(disk.meta["capacity"] * disk.record.itemsize)
    with open(disk.rows_path, "r+b") as handle:
        handle.write(first.tobytes())
    assert os.stat(disk.rows_path).st_blocks * 512 < os.stat(disk.rows_path).st_size, "the file has holes"
    fill_leaving(tmpfs, 0)
    selected, warnings = scored(bundle, pool.folder, cache)
    assert selected == pool.plain and len(warnings) == 1 and "No space left on device" in warnings[0], warnings


@pytest.fixture
def immutable() -> Iterator[Callable[[Path], None]]:
    """Makes folders immutable with `chattr +i` (root cannot write them either); undone at the end."""
    made: list[Path] = []

    def make(folder: Path) -> None:
        done = subprocess.run(["chattr", "-R", "+i", str(folder)], capture_output=True, text=True)
        if done.returncode:
            pytest.skip(f"chattr +i is not available here: {done.stderr.strip()[:200]}")
        made.append(folder)

    yield make
    for folder in made:
        subprocess.run(["chattr", "-R", "-i", str(folder)], check=True)


def test_a_cache_dir_that_cannot_be_created_scores_without_it_with_one_warning_naming_it(
    tmp_path: Path, bundle: Path, pool: Pool
) -> None:
    (tmp_path / "a-file").write_text("not a folder")
    selected, warnings = scored(bundle, pool.folder, tmp_path / "a-file" / "cache")
    assert selected == pool.plain and len(warnings) == 1
    assert "feature cache folder cannot be written" in warnings[0] and str(tmp_path / "a-file" / "cache") in warnings[0]


def test_an_immutable_cache_is_still_read_and_what_it_lacks_is_computed_without_a_crash(
    tmp_path: Path, bundle: Path, pool: Pool, immutable: Callable[[Path], None]
) -> None:
    """A cache that root cannot write (chattr +i) with two rows turned NaN: its good rows are used, the NaN ones
    computed again and not kept (one warning for each fault, naming the folder), every run the same selection."""
    cache = pool.cache(tmp_path)
    nan_rows_as_written(OnDisk(cache), pool.images)
    immutable(cache)
    for _ in range(2):
        selected, warnings = scored(bundle, pool.folder, cache)
        assert selected == pool.plain and len(warnings) == 2, warnings
        assert "rows=2 not_theirs=2" in warnings[0] and str(cache) in warnings[1]


def replace_keeping_name_size_and_mtime(target: Path, source: Path) -> None:
    """`cp -p source target`, then the target's old mtime set back (a restore, `rsync -t`): name, size, mtime kept."""
    before = target.stat()
    subprocess.run(["cp", "-p", str(source), str(target)], check=True)
    os.utime(target, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert (target.stat().st_size, target.stat().st_mtime_ns) == (before.st_size, before.st_mtime_ns)


@pytest.mark.parametrize("restarted", [False, True], ids=["while-running", "while-stopped"])
def test_a_field_device_notices_a_replaced_image_and_keeps_the_old_label_with_the_old_pixels(
    tmp_path: Path, bundle: Path, weights: Weights, backbone_rows: list[int], restarted: bool
) -> None:
    """A head-only field device with every pool image's features cached and image 7 labelled: 007.png replaced
    with the same name, size and mtime. The new content joins as a new item whose features are computed (one
    backbone image); item 7 keeps its decoded pixels, cached row and label (what the person saw)."""
    images = pool_folder(tmp_path / "camera", count=12)
    pool_folder(tmp_path / "elsewhere", seed=9, count=1)
    state = tmp_path / "state"
    data = open_folder_data(state, tmp_path / "camera", 100, InputSpec(3, 16, 16), 0, num_classes=3)
    features = PoolFeatures(HEAD, data)
    latest = LatestModel(SPEC, weights, messages.Recipe(), load_bundle(bundle), weights_hash(weights))
    features.take_in(latest)
    data.add_labels(np.array([7]), np.array([2]))
    old_row = device_prefix(HEAD, state, weights, latest.bundle).rows(data.samples(np.array([7])))  # type: ignore[union-attr]
    assert sum(backbone_rows) == 12
    replace_keeping_name_size_and_mtime(tmp_path / "camera" / "007.png", tmp_path / "elsewhere" / "000.png")
    if restarted:
        data = open_folder_data(state, tmp_path / "camera", 100, InputSpec(3, 16, 16), 0, num_classes=3)
        features = PoolFeatures(HEAD, data)
    else:
        assert data.refresh() == 1
    pool = folder_pool_of(data)
    assert data.num_samples == 13 and pool.item(12).path == pool.item(7).path == "007.png"
    assert pool.item(12).sha256 != pool.item(7).sha256 and 12 in data.pool_indices().tolist()
    features.take_in(latest)
    assert sum(backbone_rows) == 13, "only the new content runs the backbone (a restart checks the others)"
    backbone_rows.clear()
    prefix = device_prefix(HEAD, state, weights, latest.bundle)
    assert prefix is not None
    rows = prefix.rows(data.samples(np.array([7, 12])))
    assert backbone_rows == [] and np.array_equal(rows[0], old_row[0]) and not np.array_equal(rows[0], rows[1])
    assert np.array_equal(rows[1], prefix.extract(data.images(np.array([12])))[0].astype(np.float16))
    assert np.array_equal(data.images(np.array([7]))[0], images[7]) and data.labels_at(np.array([7, 12])).tolist() == [
        2,
        -1,
    ]
    assert open_folder_data(state, tmp_path / "camera", 100, InputSpec(3, 16, 16), 0, num_classes=3).num_samples == 13


def test_a_pool_stored_before_digests_and_ctimes_were_kept_reopens_without_new_items(tmp_path: Path) -> None:
    """items.jsonl lines without ctime_ns and inode, no digests.bin: the reopened pool hashes each file once (no
    item joins), and computes the digests from images.u8."""
    pool_folder(tmp_path / "camera", count=5)
    data = open_folder_data(tmp_path / "state", tmp_path / "camera", 100, InputSpec(3, 16, 16), 0, num_classes=3)
    digests = data.digests(np.arange(5))
    items = tmp_path / "state" / "pool" / "items.jsonl"
    lines = [json.loads(line) for line in items.read_text().splitlines()]
    items.write_text(
        "".join(
            json.dumps({k: v for k, v in line.items() if k in ("path", "sha256", "size", "mtime_ns")}) + "\n"
            for line in lines
        )
    )
    (tmp_path / "state" / "pool" / "digests.bin").unlink()
    reopened = open_folder_data(tmp_path / "state", tmp_path / "camera", 100, InputSpec(3, 16, 16), 0, num_classes=3)
    assert reopened.num_samples == 5 and np.array_equal(reopened.digests(np.arange(5)), digests)
    assert (tmp_path / "state" / "pool" / "digests.bin").stat().st_size == 5 * 32


@pytest.mark.parametrize(
    "edit",
    [{"dim": 1 << 22}, {"dim": 1 << 30}, {"dim": 7}, {"capacity": 1 << 40}, {"dtype": "f4"}, {"key": "ab13"}],
    ids=lambda edit: "-".join(f"{name}={value}" for name, value in edit.items()),
)
def test_a_meta_edited_to_claim_other_sizes_is_read_within_the_files_size_and_gives_the_same_rows(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, edit: dict
) -> None:
    """A meta claiming huge rows, a huge capacity, another width, type or key: no allocation beyond the file's
    size, a warning, and the rows the prefix gives (exact in float16, so equal whatever the type)."""
    digests = np.random.default_rng(0).integers(0, 256, (40, 32), dtype=np.uint8)

    def extract(indices: np.ndarray) -> np.ndarray:
        return (indices[:, None] + np.arange(16)[None, :]).astype(np.float32) / 8

    first = FeatureCache(tmp_path, "ab12", batch_size=8).rows(np.arange(40), digests, extract)
    meta = tmp_path / "ab12.json"
    meta.write_text(json.dumps({**json.loads(meta.read_text()), **edit}))
    with caplog.at_level(logging.WARNING):
        again = FeatureCache(tmp_path, "ab12", batch_size=8).rows(np.arange(40), digests, extract)
    assert np.array_equal(again, first) and "feature cache" in caplog.text
    assert (tmp_path / "ab12.rows").stat().st_size < 1 << 20


def test_a_cache_of_the_first_version_is_replaced_without_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    (tmp_path / "ab12.f16").write_bytes(b"\0" * 512)
    (tmp_path / "ab12.json").write_text(json.dumps({"format": "edge-fal-feature-cache", "version": 1, "key": "ab12"}))
    with caplog.at_level(logging.WARNING):
        rows = FeatureCache(tmp_path, "ab12").rows(np.arange(3), np.zeros((3, 32), np.uint8), lambda i: np.ones((3, 2)))
    assert rows.tolist() == [[1.0, 1.0]] * 3 and caplog.text == "" and not (tmp_path / "ab12.f16").exists()
