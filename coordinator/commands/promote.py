# `fl-coordinator promote`: a person makes a committed round's model the serving version, running coordinator or not.
from __future__ import annotations

import argparse
from pathlib import Path

from coordinator.rounds.serving import promote_round, version_name
from coordinator.storage.store import existing_run


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The run directory and the round whose model is to serve."""
    parser.add_argument("run_dir", type=Path, metavar="RUN_DIR")
    parser.add_argument("--round", type=int, required=True, help="the committed round whose model serves (0: W0)")
    parser.add_argument("--log-level", default="warning")


def run(args: argparse.Namespace) -> int:
    """Stores the promotion in the run's store (a running coordinator publishes it within a second or two, a
    stopped one when it starts) and prints one line."""
    with existing_run(args.run_dir) as store:
        event = promote_round(store, args.round)
    print(f"{version_name(event.serving)} serves; devices get it as soon as the run's coordinator publishes it")
    return 0
