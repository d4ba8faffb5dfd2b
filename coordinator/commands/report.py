# `fl-coordinator report`: a run's self-contained HTML report (matplotlib is imported only when one is written).
from __future__ import annotations

import argparse
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The run directory and where the report goes."""
    parser.add_argument("run_dir", type=Path, metavar="RUN_DIR")
    parser.add_argument("--out", type=Path, help="where to write it (default RUN_DIR/report.html)")
    parser.add_argument("--log-level", default="warning")


def write_report(run_dir: Path, out: Path | None = None) -> Path:
    """Writes the run's HTML report (matplotlib is imported here, so other commands start without it)."""
    from coordinator.dashboard.report import write_report as write_html_report

    return write_html_report(run_dir, out)


def run(args: argparse.Namespace) -> int:
    """Writes the self-contained HTML report of a run directory and prints its path."""
    print(write_report(args.run_dir, args.out))
    return 0
