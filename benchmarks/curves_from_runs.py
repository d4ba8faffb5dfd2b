# Reads the accuracy-against-labels curve of every run directory's store under a folder (finished or not) as JSON lines.
"""Usage: python benchmarks/curves_from_runs.py DIR [--out FILE]. Each line has the same shape as a
label_efficiency.py progress line, so `label_efficiency.py --from-lines FILE` summarises them; the run's sampler
and seed come from its directory name (PARTITION-SAMPLER-seedN) and its partition from the store's config."""

from __future__ import annotations

import argparse
import json
import re
import sqlite3
from pathlib import Path
from typing import Any

from coordinator.storage.store import RunStore

RUN_NAME = re.compile(r"^(?P<partition>[^-]+)-(?P<sampler>.+)-seed(?P<seed>\d+)$")


def curve_of(store_path: Path) -> dict[str, Any] | None:
    """The committed rounds of one run's store as a run line, or None if its name does not parse or its store
    has no rounds yet."""
    match = RUN_NAME.match(store_path.parent.name)
    if not match:
        return None
    try:
        with RunStore(store_path.parent, read_only=True) as store:
            rounds = store.rounds()
    except sqlite3.OperationalError:
        return None
    return {
        "partition": match["partition"],
        "sampler": match["sampler"],
        "seed": int(match["seed"]),
        "labels": [record.labels for record in rounds],
        "accuracy": [record.accuracy for record in rounds],
    }


def main() -> None:
    """Prints (or writes) one progress line per run store found under the folder."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("folder", type=Path)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    runs = [run for store in sorted(args.folder.glob("*/run.sqlite")) if (run := curve_of(store))]
    lines = "".join(json.dumps({"progress": f"{i + 1}/{len(runs)}", "run": run}) + "\n" for i, run in enumerate(runs))
    if args.out:
        args.out.write_text(lines)
    print(lines, end="")


if __name__ == "__main__":
    main()
