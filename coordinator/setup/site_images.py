# A team's labelled photos read: a class-folder tree or a CSV of path,class, each file decoded as devices decode it.
from __future__ import annotations

import csv
import hashlib
import io
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from coordinator.setup.site_dataset import (
    DROPPED,
    DUPLICATE,
    DecodedFile,
    ListedFile,
    ReportRow,
    check_class_counts,
    dropped,
    kept_rows,
    known_classes,
    one_copy_each,
    stratified_split,
)
from edge_agent.data.image_arrays import ImageDataset
from edge_agent.data.image_files import InputSpec, UnreadableImageError, decode_image, folder_files
from protocol.errors import UsageError
from protocol.model_spec import ModelSpec
from protocol.wire import shown

DEFAULT_TEST_SHARE = 0.2
DEFAULT_SEED = 0
CSV_HEADER = ["path", "class"]


@dataclass(frozen=True)
class SiteDataset:
    """The server's data set built from a team's photos, and the report's row of every file the source named."""

    dataset: ImageDataset
    rows: list[ReportRow]

    def left_out(self) -> list[ReportRow]:
        """The rows of the files not kept (duplicates and dropped files), in the source's order."""
        return [row for row in self.rows if row.outcome in (DUPLICATE, DROPPED)]


def is_image_source(path: Path) -> bool:
    """True for what `build_site_dataset` reads (a folder, or a .csv file), False for anything else (an .npz)."""
    return path.is_dir() or path.suffix.lower() == ".csv"


def list_folder(folder: Path) -> tuple[list[ListedFile], list[ReportRow]]:
    """Every visible file under a folder of class folders (its class: the first folder of its path), in path
    order; a file outside any class folder is dropped."""
    files: list[ListedFile] = []
    rows: list[ReportRow] = []
    for order, (path, relative, _) in enumerate(folder_files(folder, set())):
        class_name, _, rest = relative.partition("/")
        listed = ListedFile(order, relative, path, class_name if rest else "")
        if rest:
            files.append(listed)
        else:
            rows.append(dropped(listed, "not in a class folder (one folder per class name)"))
    return files, rows


def list_csv(table: Path) -> tuple[list[ListedFile], list[ReportRow]]:
    """Every row of a CSV of path,class (paths relative to the CSV; an optional header row `path,class`); a row
    that is not two non-empty fields is dropped with its line number."""
    try:
        text = table.read_text(encoding="utf-8-sig")
        lines = list(csv.reader(io.StringIO(text)))
    except (OSError, UnicodeDecodeError, csv.Error) as error:
        raise UsageError(f"{table}: not a readable CSV of path,class ({str(error)[:120]})") from None
    files: list[ListedFile] = []
    rows: list[ReportRow] = []
    for number, fields in enumerate(lines, start=1):
        fields = [field.strip() for field in fields]
        if not any(fields) or (number == 1 and [field.lower() for field in fields] == CSV_HEADER):
            continue
        if len(fields) != 2 or not all(fields):
            given = shown(",".join(fields))
            rows.append(ReportRow(number, f"(line {number})", "", DROPPED, f"not path,class: {given}"))
            continue
        files.append(ListedFile(number, fields[0], table.parent / fields[0], fields[1]))
    return files, rows


def list_source(source: Path) -> tuple[list[ListedFile], list[ReportRow]]:
    """The files a folder tree or a CSV names; a UsageError for anything else or for a source naming no file."""
    if source.is_dir():
        files, rows = list_folder(source)
    elif source.suffix.lower() == ".csv" and source.is_file():
        files, rows = list_csv(source)
    else:
        raise UsageError(f"{source}: not a folder of class folders nor a CSV file of path,class")
    if not files:
        raise UsageError(f"{source}: names no image file in a class ({len(rows)} files or rows left out)")
    return files, rows


def file_digest(path: Path) -> str:
    """sha256 of a file's bytes, read in chunks."""
    with path.open("rb") as handle:
        return hashlib.file_digest(handle, "sha256").hexdigest()


def decode_files(
    files: list[ListedFile], spec: InputSpec, class_names: list[str]
) -> tuple[np.ndarray, list[DecodedFile], list[ReportRow]]:
    """Each file decoded to the spec's uint8 record (as a device decodes its camera's images) with its digests;
    the rows of the files that cannot be read or are not JPEG/PNG images, with the reason."""
    labels = {name: label for label, name in enumerate(class_names)}
    records = np.empty((len(files), *spec.record_shape), dtype=np.uint8)
    decoded: list[DecodedFile] = []
    rows: list[ReportRow] = []
    for listed in files:
        try:
            digest = file_digest(listed.path)
            records[len(decoded)] = decode_image(listed.path, spec)
        except UnreadableImageError as error:
            rows.append(dropped(listed, error.reason))
            continue
        except OSError as error:
            rows.append(dropped(listed, f"cannot be read ({str(error.strerror)[:80]})"))
            continue
        row = len(decoded)
        pixels = hashlib.sha256(records[row].tobytes()).hexdigest()
        decoded.append(DecodedFile(listed, labels[listed.class_name], digest, pixels, row))
    return records[: len(decoded)], decoded, rows


def input_of(spec: ModelSpec) -> InputSpec:
    """The uint8 record a spec's images are decoded to; a UsageError for an input no image file gives."""
    try:
        return InputSpec(spec.channels, spec.height, spec.width)
    except ValueError as error:
        raise UsageError(f"the model spec's input cannot be read from image files: {error}") from None


def build_site_dataset(
    source: Path, spec: ModelSpec, spec_name: str, share: float, seed: int, ignore_unknown: bool = False
) -> SiteDataset:
    """The server's data set from a folder tree or a CSV: the spec's classes only, each photo once, a seeded
    class-stratified test split of `share`; a UsageError where the data would mislead a run (a class the spec does
    not name, a class with too few images)."""
    if not 0.0 < share < 1.0:
        raise UsageError(f"--test-share must lie strictly between 0 and 1, got {share}")
    listed, rows = list_source(source)
    files, unknown = known_classes(listed, spec.class_names, ignore_unknown, str(source), spec_name)
    records, decoded, unreadable = decode_files(files, input_of(spec), spec.class_names)
    unique, duplicates = one_copy_each(decoded)
    left_out = rows + unknown + unreadable + duplicates
    labels = np.array([item.label for item in unique], dtype=np.int64)
    check_class_counts(labels, spec.class_names, left_out, str(source))
    is_test = stratified_split(labels, share, seed)
    images = records[[item.row for item in unique]]
    dataset = ImageDataset(images[~is_test], labels[~is_test], images[is_test], labels[is_test])
    return SiteDataset(dataset, sorted(left_out + kept_rows(unique, is_test), key=lambda row: row.order))
