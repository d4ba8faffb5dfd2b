# A field device's parts: the folder pool, the folder oracle, the label page, and the work between rounds.
from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from edge_agent.folder_oracle import FolderOracle, QueryBook
from edge_agent.folder_pool import DEFAULT_SETTLE_SECONDS, MODEL_INPUT, FolderDeviceData, InputSpec
from edge_agent.label_ui import LabelServer, parse_listen_address
from edge_agent.profile import load_profile

if TYPE_CHECKING:
    from edge_agent.models import Weights

DEFAULT_POOL_CAP = 20000


class FieldWork:
    """Rescans the pool folder every scan_interval seconds (the agent calls tick on every loop turn)."""

    def __init__(self, data: FolderDeviceData, scan_interval: float) -> None:
        self.data = data
        self.scan_interval = scan_interval
        self._next_scan = 0.0

    def tick(self, weights: Weights | None, round_id: int) -> None:
        """Scans the folder when the interval has passed."""
        if time.monotonic() < self._next_scan:
            return
        self._next_scan = time.monotonic() + self.scan_interval
        self.data.refresh()


def add_field_arguments(run: argparse.ArgumentParser) -> None:
    """The options of a field device (a folder pool, the folder oracle, the label page, stream acquisition)."""
    field = run.add_argument_group("field device")
    field.add_argument("--pool-dir", type=Path, help="folder of JPEG/PNG images (a camera's); new files join the pool")
    field.add_argument("--profile", type=Path, help="a firmware_configs/*.toml device profile (pool size cap)")
    field.add_argument("--manifest", type=Path,
                       help="a model bundle's manifest.json giving the input shape (default: the paper CNN's 1x28x28)")
    field.add_argument("--oracle-dir", type=Path,
                       help="where queries are copied and labels.csv is read (default STATE_DIR/labelling)")
    field.add_argument("--answer-wait", type=float, default=120.0,
                       help="seconds an acquisition waits for answers before training on what is answered")
    field.add_argument("--label-ui", metavar="[HOST:]PORT", help="serve the labelling page (loopback by default)")
    field.add_argument("--scan-interval", type=float, default=5.0, help="seconds between scans of the pool folder")
    field.add_argument("--settle-seconds", type=float, default=DEFAULT_SETTLE_SECONDS,
                       help="a file joins once unmodified this long (cameras may still be writing it)")


@dataclass
class FieldParts:
    """What a field agent runs with: its data, oracle, between-round work and (optional) label page."""

    data: FolderDeviceData
    oracle: FolderOracle
    work: FieldWork
    label_server: LabelServer | None


def _input_spec(manifest_path: Path | None) -> InputSpec:
    """The model's input from a bundle manifest, or the paper CNN's."""
    if manifest_path is None:
        return MODEL_INPUT
    try:
        manifest = json.loads(manifest_path.read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{manifest_path}: unreadable manifest ({exc})") from exc
    return InputSpec.from_manifest(manifest, str(manifest_path))


def open_field(args: argparse.Namespace, state_dir: Path) -> FieldParts:
    """Opens the folder pool and the folder oracle for `edge-agent run --pool-dir`; starts the label page if asked."""
    pool_cap = load_profile(args.profile).pool_size_cap if args.profile else DEFAULT_POOL_CAP
    oracle_dir = args.oracle_dir or state_dir / "labelling"
    listen = parse_listen_address(args.label_ui) if args.label_ui else None
    data = FolderDeviceData.open_folder(state_dir, args.pool_dir, pool_cap, _input_spec(args.manifest),
                                        args.settle_seconds, skip_dirs=(oracle_dir,))
    book = QueryBook(oracle_dir)
    oracle = FolderOracle(book, data, args.answer_wait)
    server = LabelServer(book, *listen).start() if listen else None
    return FieldParts(data, oracle, FieldWork(data, args.scan_interval), server)
