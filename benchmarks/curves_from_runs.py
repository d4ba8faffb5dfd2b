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

RUN_NAME = re.compile(r"^(?P<partition>[^-]+)-(?P<sampler>.+)-seed(?P<seed>\d+)$")


def curve_of(store: Path) -> dict[str, Any] | None:
    """The committed rounds of one run's SQLite store as a run line, or None if its name does not parse or its store
    has no rounds yet."""
    match = RUN_NAME.match(store.parent.name)
    if not match:
        return None
    connection = sqlite3.connect(f"file:{store}?mode=ro", uri=True)
    try:
        rows = connection.execute("SELECT labels, accuracy FROM rounds ORDER BY round_id").fetchall()
    except sqlite3.OperationalError:
        return None
    finally:
        connection.close()
    return {
        "partition": match["partition"],
        "sampler": match["sampler"],
        "seed": int(match["seed"]),
        "labels": [labels for labels, _ in rows],
        "accuracy": [accuracy for _, accuracy in rows],
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
