# What a build of the server's data set kept and left out: a bounded summary for a person, every file in a CSV.
from __future__ import annotations

import csv
import io
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

from coordinator.setup.site_dataset import DROPPED, DUPLICATE, TEST, TRAIN, ReportRow
from coordinator.setup.site_images import SiteDataset

REPORT_COLUMNS = ("file", "class", "outcome", "reason")
SHOWN_LINES = 10


def report_path(out: Path) -> Path:
    """Where the per-file report of a data set written to `out` goes: beside it, NAME.report.csv."""
    return out.with_suffix(".report.csv")


def report_csv(rows: Sequence[ReportRow]) -> bytes:
    """Every file the source named, one row each: file, class, outcome (train, test, duplicate, dropped), reason."""
    text = io.StringIO()
    writer = csv.writer(text, lineterminator="\n")
    writer.writerow(REPORT_COLUMNS)
    writer.writerows((row.file, row.class_name, row.outcome, row.reason) for row in rows)
    return text.getvalue().encode()


def headline(site: SiteDataset) -> str:
    """One line: how many images each split kept, and how many files were left out as duplicates or dropped."""
    outcomes = Counter(row.outcome for row in site.rows)
    shape = "x".join(str(side) for side in site.dataset.train_images.shape[1:])
    return (
        f"{outcomes[TRAIN]} training and {outcomes[TEST]} test images at {shape}; left out: duplicates "
        f"{outcomes[DUPLICATE]}, dropped files {outcomes[DROPPED]}"
    )


def summary_lines(site: SiteDataset, class_names: Sequence[str], shown: int = SHOWN_LINES) -> list[str]:
    """The headline, each class's training and test counts, and the files left out with their reasons: at most
    `shown` lines of each, a count for the rest."""
    counts = Counter((row.class_name, row.outcome) for row in site.rows)
    width = min(max(len("class"), *(len(name) for name in class_names)), 40)
    lines = [headline(site), f"  {'class':<{width}}  train  test"]
    lines += [
        f"  {name[:width]:<{width}}  {counts[name, TRAIN]:>5}  {counts[name, TEST]:>4}" for name in class_names[:shown]
    ]
    if len(class_names) > shown:
        lines.append(f"  ... and {len(class_names) - shown} more classes")
    left_out = site.left_out()
    lines += [f"  {row.outcome:<9}  {row.file[:80]}: {row.reason}" for row in left_out[:shown]]
    if len(left_out) > shown:
        lines.append(f"  ... and {len(left_out) - shown} more files left out")
    return lines
