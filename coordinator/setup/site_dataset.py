# A team's labelled photos as the server's data set, pure: class checks, one copy of each photo, the seeded split.
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from protocol.errors import UsageError
from protocol.wire import shown, shown_names

MIN_CLASS_IMAGES = 5  # a class's images: at least one to test and four to train on
SHOWN_FILE = 80  # characters of a file name an error or a reason quotes
TRAIN, TEST, DUPLICATE, DROPPED = "train", "test", "duplicate", "dropped"


@dataclass(frozen=True)
class ListedFile:
    """One image file a source names: as shown (relative to the folder or the CSV), its path, its class name, and
    its place in the source (what the report is ordered by)."""

    order: int
    file: str
    path: Path
    class_name: str


@dataclass(frozen=True)
class ReportRow:
    """What became of one file of the source: kept for `train` or `test`, left out as a `duplicate` of a photo
    kept, or `dropped`; the reason (one bounded line) when it was not kept."""

    order: int
    file: str
    class_name: str
    outcome: str
    reason: str = ""


@dataclass(frozen=True)
class DecodedFile:
    """A listed file whose image decoded: its class number, the digests of its bytes and of its decoded pixels
    (at the spec's size), and its row in the decoded images."""

    listed: ListedFile
    label: int
    file_digest: str
    pixel_digest: str
    row: int


def dropped(listed: ListedFile, reason: str) -> ReportRow:
    """The report's row of a file left out, and why."""
    return ReportRow(listed.order, listed.file, listed.class_name, DROPPED, reason)


def known_classes(
    files: Sequence[ListedFile], class_names: Sequence[str], ignore_unknown: bool, where: str, spec_name: str
) -> tuple[list[ListedFile], list[ReportRow]]:
    """The files of the spec's classes, and the rows of the others (dropped, with `ignore_unknown`); a UsageError
    naming the first class the spec does not name (and how many files it holds) otherwise."""
    names = set(class_names)
    unknown = [listed for listed in files if listed.class_name not in names]
    if unknown and not ignore_unknown:
        first = unknown[0].class_name
        others = sorted({listed.class_name for listed in unknown} - {first})
        more = f" (and {len(others)} more unknown classes: {shown_names(others, 3)})" if others else ""
        count = sum(listed.class_name == first for listed in unknown)
        raise UsageError(
            f"{where}: class {shown(first)} ({count} files){more} is not a class of {spec_name} "
            f"{shown_names(list(class_names), 5)}; rename it, or leave it out with "
            "`fl-coordinator dataset --ignore-unknown-classes`"
        )
    rows = [dropped(listed, f"class {shown(listed.class_name)} is not in {spec_name}") for listed in unknown]
    return [listed for listed in files if listed.class_name in names], rows


def one_copy_each(decoded: Sequence[DecodedFile]) -> tuple[list[DecodedFile], list[ReportRow]]:
    """Each photo once (the same bytes, or the same pixels at the spec's size: the first in the source's order),
    so no photo lands in both train and test; the rows of the copies left out. A photo given two classes is
    dropped in every copy: its label is in doubt."""
    groups: dict[str, list[DecodedFile]] = {}
    for item in decoded:
        groups.setdefault(item.pixel_digest, []).append(item)
    kept: list[DecodedFile] = []
    rows: list[ReportRow] = []
    for group in groups.values():
        first = group[0]
        classes = sorted({item.listed.class_name for item in group})
        if len(classes) > 1:
            files = shown_names([item.listed.file for item in group], 3, lambda name: shown(name, SHOWN_FILE))
            reason = f"the same photo is labelled {shown_names(classes, 3)} in {files}"
            rows += [dropped(item.listed, reason) for item in group]
            continue
        kept.append(first)
        for item in group[1:]:
            same = "the same file" if item.file_digest == first.file_digest else "the same pixels"
            reason = f"{same} as {shown(first.listed.file, SHOWN_FILE)}, kept once"
            rows.append(ReportRow(item.listed.order, item.listed.file, item.listed.class_name, DUPLICATE, reason))
    return sorted(kept, key=lambda item: item.listed.order), rows


def check_class_counts(
    labels: np.ndarray, class_names: Sequence[str], left_out: Sequence[ReportRow], where: str
) -> None:
    """A UsageError naming the spec's classes with fewer than MIN_CLASS_IMAGES usable images and their counts (and
    the first of the files left out, which may be why): a class without test images has no accuracy, one without
    training images is never learnt."""
    counts = np.bincount(labels, minlength=len(class_names))
    short = [(name, int(count)) for name, count in zip(class_names, counts) if count < MIN_CLASS_IMAGES]
    if not short:
        return
    listed = ", ".join(f"{shown(name)} has {count}" for name, count in short[:3])
    listed += f", and {len(short) - 3} more" if len(short) > 3 else ""
    first = min(left_out, key=lambda row: row.order, default=None)
    why = "" if first is None else f" ({len(left_out)} files left out, first {shown(first.file)}: {first.reason})"
    raise UsageError(
        f"{where}: too few usable images in {len(short)} of the spec's classes ({listed}){why}; a class needs at "
        f"least {MIN_CLASS_IMAGES} (one or more to test, the rest to train on): add images, or remove the class "
        "from the model spec"
    )


def held_out_count(count: int, share: float) -> int:
    """How many of a class's `count` images are test images: its share, rounded, at least one and leaving one."""
    return min(count - 1, max(1, int(count * share + 0.5)))


def stratified_split(labels: np.ndarray, share: float, seed: int) -> np.ndarray:
    """Which rows are test rows (bool, one per label): `share` of each class, drawn with the seed alone, so the
    same images and seed give the same split."""
    rng = np.random.default_rng(seed)
    chosen = np.zeros(len(labels), dtype=bool)
    for cls in np.unique(labels):
        members = np.flatnonzero(labels == cls)
        chosen[rng.permutation(members)[: held_out_count(len(members), share)]] = True
    return chosen


def kept_rows(decoded: Sequence[DecodedFile], is_test: np.ndarray) -> list[ReportRow]:
    """The report's rows of the images kept, each with its split."""
    return [
        ReportRow(item.listed.order, item.listed.file, item.listed.class_name, TEST if test else TRAIN)
        for item, test in zip(decoded, is_test)
    ]
