# `fl-coordinator export`: a run's checkpoint as a verified device bundle (ONNX, MC dropout kept).
from __future__ import annotations

import argparse
from pathlib import Path

from coordinator.storage.store import existing_run, stored_spec
from export.cli import add_bundle_options, export_weights
from protocol.errors import UsageError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The run directory, the checkpoint round, and the bundle's options."""
    parser.add_argument("run_dir", type=Path, metavar="RUN_DIR")
    parser.add_argument("--round", type=int, help="checkpoint round to export (default: the latest)")
    add_bundle_options(parser)
    parser.add_argument("--log-level", default="warning")


def run(args: argparse.Namespace) -> int:
    """Exports a run's checkpoint (the latest, or --round N) as a verified device bundle."""
    with existing_run(args.run_dir) as store:
        round_id = store.checkpoints.latest_round() if args.round is None else args.round
        if round_id is None:
            raise UsageError(f"{args.run_dir} holds no checkpoints yet")
        try:
            weights = store.checkpoints.load(round_id)
        except FileNotFoundError as error:
            raise UsageError(str(error)) from None
        spec = stored_spec(store.config())
    export_weights(weights, f"{args.run_dir} round {round_id}", args, spec)
    return 0
