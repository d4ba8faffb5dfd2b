# The command-line options of a field device (folder pool, folder oracle, label page, stream acquisition); no torch.
from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from edge_agent.field.folder_pool import DEFAULT_SETTLE_SECONDS
from protocol.errors import UsageError
from protocol.model_spec import DEFAULT_SPEC, ModelSpec, load_model_spec

LABELLING_MODES = ("device", "central")


def add_field_arguments(run: argparse.ArgumentParser) -> None:
    """The options of a field device's folder pool (given by --pool-dir): its model spec, the folder oracle, the
    label page, stream acquisition."""
    field = run.add_argument_group("field device")
    field.add_argument(
        "--model-spec",
        type=Path,
        help="the fleet's TOML model spec: input shape and class names (default: the paper CNN on Fashion-MNIST)",
    )
    field.add_argument(
        "--oracle-dir", type=Path, help="where queries are copied and labels.csv is read (default STATE_DIR/labelling)"
    )
    field.add_argument(
        "--answer-wait",
        type=float,
        default=120.0,
        help="seconds an acquisition waits for answers before training on what is answered",
    )
    field.add_argument("--label-ui", metavar="[HOST:]PORT", help="serve the labelling page (loopback by default)")
    field.add_argument(
        "--labelling",
        choices=LABELLING_MODES,
        default="device",
        help="where people answer queries: on the device only (its page, labels.csv), or also in the fleet's central "
        "queue (`central`: each query's image leaves the device for the coordinator's labelling page)",
    )
    field.add_argument(
        "--query-image-side",
        type=int,
        metavar="PIXELS",
        help="--labelling central: send each query image downscaled to at most this side, as PNG (default: the file "
        "as captured)",
    )
    field.add_argument("--scan-interval", type=float, default=5.0, help="seconds between scans of the pool folder")
    field.add_argument(
        "--settle-seconds",
        type=float,
        default=DEFAULT_SETTLE_SECONDS,
        help="a file joins once unmodified this long (cameras may still be writing it)",
    )
    field.add_argument(
        "--stream",
        action="store_true",
        help="score each new image on arrival with the recipe's sampler (MC dropout, the newest global model) and ask "
        "for it when its score passes the budget's threshold",
    )
    field.add_argument(
        "--repredict",
        action="store_true",
        help="a new serving model predicts every image the device holds again (default: only images not predicted yet)",
    )
    field.add_argument("--labels-per-hour", type=float, default=30.0, help="--stream's labelling budget")
    field.add_argument(
        "--label-burst",
        type=float,
        help="--stream: most labels asked at once (default: a quarter hour's budget, at least 1)",
    )


@dataclass(frozen=True)
class FieldSettings:
    """A field device's folder pool, folder oracle, label page and stream acquisition, as the command line set them."""

    pool_dir: Path
    model_spec: Path | None = None
    oracle_dir: Path | None = None
    answer_wait: float = 120.0
    label_ui: str | None = None
    scan_interval: float = 5.0
    settle_seconds: float = DEFAULT_SETTLE_SECONDS
    stream: bool = False
    labels_per_hour: float = 30.0
    label_burst: float | None = None
    labelling: str = "device"
    query_image_side: int | None = None
    repredict: bool = False

    def spec(self) -> ModelSpec:
        """The fleet's model spec from --model-spec (the paper CNN's without it)."""
        return load_model_spec(self.model_spec).spec if self.model_spec else DEFAULT_SPEC


def field_settings(args: argparse.Namespace) -> FieldSettings:
    """FieldSettings from parsed `edge-agent run` arguments (with --pool-dir)."""
    if args.query_image_side is not None and not 8 <= args.query_image_side <= 4096:
        raise UsageError(f"--query-image-side must be 8..4096 pixels, got {args.query_image_side}")
    return FieldSettings(
        pool_dir=args.pool_dir,
        model_spec=args.model_spec,
        oracle_dir=args.oracle_dir,
        answer_wait=args.answer_wait,
        label_ui=args.label_ui,
        scan_interval=args.scan_interval,
        settle_seconds=args.settle_seconds,
        stream=args.stream,
        labels_per_hour=args.labels_per_hour,
        label_burst=args.label_burst,
        labelling=args.labelling,
        query_image_side=args.query_image_side,
        repredict=args.repredict,
    )
