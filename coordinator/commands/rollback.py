# `fl-coordinator rollback`: a person makes the version that served before the current one serve again.
from __future__ import annotations

import argparse
from pathlib import Path

from coordinator.rounds.serving import roll_back, version_name
from coordinator.storage.store import existing_run


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The run directory."""
    parser.add_argument("run_dir", type=Path, metavar="RUN_DIR")
    parser.add_argument("--log-level", default="warning")


def run(args: argparse.Namespace) -> int:
    """Stores the rollback in the run's store (a running coordinator publishes it within a second or two, a stopped
    one when it starts) and prints one line."""
    with existing_run(args.run_dir) as store:
        event = roll_back(store)
    print(
        f"{version_name(event.serving)} serves again (was {version_name(event.round_id)}); devices get it as soon as "
        "the run's coordinator publishes it"
    )
    return 0
