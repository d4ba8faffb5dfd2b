# The option groups `run` and the bench's `simulate` share: the run, its rounds, transfers, recipe, methods, data.
from __future__ import annotations

import argparse
from pathlib import Path

from coordinator.asynchronous.intake import AsyncPolicy
from coordinator.commands.method_flags import add_method_choice, add_method_flags, method_kinds
from coordinator.commands.recipe_options import add_recipe_options
from coordinator.intake.round_aggregator import SuspectPolicy
from coordinator.privacy.rounds import DpSettings
from coordinator.rounds.promotion import PromotionGate
from coordinator.rounds.rules import DEFAULT_BATCH
from coordinator.setup.settings import InitSettings, ServerSettings
from coordinator.strategies.aggregate import DEFAULT_MAX_SAMPLE_SHARE
from edge_agent.learning.training import OPTIMIZERS
from protocol.http_edge import HOST_HELP

DEFAULT_MAX_STALENESS = 4


def add_round_options(parser: argparse.ArgumentParser) -> None:
    """Options shared by `run` and `simulate`: the run, the round policy, the recipe, the server data."""
    add_run_options(parser)
    add_serving_options(parser)
    add_async_options(parser)
    add_dp_options(parser)
    add_transfer_options(parser)
    add_recipe_options(parser)
    add_method_options(parser)
    add_server_data_options(parser)


def add_run_options(parser: argparse.ArgumentParser) -> None:
    """The run itself: where it lives, its strategy, when rounds close, its broker, output and dashboard."""
    run = parser.add_argument_group("run")
    run.add_argument("--fleet", help="fleet name (topic prefix fl/<fleet>/)")
    run.add_argument("--run-dir", type=Path, help="where the store, checkpoints and logs go (default runs/<time>)")
    add_method_choice(run, method_kinds()[2])
    run.add_argument(
        "--suspect-threshold",
        type=float,
        default=SuspectPolicy.threshold,
        help="robust z-score of a layer's divergence above which an update is flagged as suspect",
    )
    run.add_argument("--exclude-suspects", action="store_true", help="leave flagged updates out of the aggregate")
    run.add_argument(
        "--secagg-open-fleet-unsafe",
        action="store_true",
        help="run --secure-aggregation on a fleet without per-device logins and identity keys (no --secure): any "
        "client may then advertise keys under an honest device's id and rebuild that device's update",
    )
    run.add_argument(
        "--max-sample-share",
        type=float,
        default=DEFAULT_MAX_SAMPLE_SHARE,
        help="with a strategy that weighs by samples (fedavg, cadis, the server optimisers): the most of a round's "
        "weight one update's claimed samples may carry, per device it sums (the excess is clipped; 1: no cap)",
    )
    run.add_argument("--rounds", type=int, default=10)
    run.add_argument("--min-devices", type=int, default=1, help="fewest updates a round may aggregate")
    run.add_argument("--quorum", type=int, help="updates that close a round early (default: every online device)")
    run.add_argument("--round-timeout", type=float, default=600.0, help="seconds before a round closes anyway")
    run.add_argument("--broker", help="mqtt://HOST:PORT of an external broker (default: an embedded mosquitto)")
    run.add_argument("--json", action="store_true", help="one JSON object per round on stdout, then a summary")
    run.add_argument("--log-level", default="warning")
    run.add_argument("--torch-threads", type=int, help="torch threads of the coordinator process")
    run.add_argument("--no-bundles", action="store_true", help="ship no ONNX bundle with each global model")
    run.add_argument("--dashboard", metavar="[HOST:]PORT", help="serve the live dashboard, JSON API and /metrics")
    run.add_argument(
        "--dashboard-token",
        help="bearer token the API requires (default: none on loopback, else generated into RUN_DIR/dashboard-token)",
    )
    run.add_argument("--dashboard-host", action="append", metavar="NAME", help=HOST_HELP)


def add_serving_options(parser: argparse.ArgumentParser) -> None:
    """When a committed round's model starts serving (the model devices predict with), and what devices publish."""
    serving = parser.add_argument_group("serving version (the promotion gate)")
    serving.add_argument(
        "--promotion-tolerance",
        type=float,
        default=PromotionGate.tolerance_points,
        metavar="POINTS",
        help="a committed round is held when its accuracy fell from the serving model's by more than this many "
        "percentage points beyond doubt (its fall's lower bound at --promotion-confidence, both models scored on "
        "the same test images)",
    )
    serving.add_argument(
        "--promotion-max-class-drop",
        type=float,
        default=PromotionGate.max_class_drop_points,
        metavar="POINTS",
        help="... or one class's recall fell by more than this many percentage points beyond doubt",
    )
    serving.add_argument(
        "--promotion-confidence",
        type=float,
        default=PromotionGate.confidence,
        help="how sure the gate must be of a fall before it holds a round, over the overall and per-class tests "
        "together",
    )
    serving.add_argument(
        "--promotion-field-images",
        type=int,
        default=PromotionGate.field_images,
        metavar="N",
        help="the field set (answered field test queries, --field-test-share) decides once it holds N images; the "
        "server's test set decides before",
    )
    serving.add_argument(
        "--field-test-window",
        type=int,
        default=PromotionGate.field_window,
        metavar="N",
        help="the field set is the newest N answered field test images, so it follows a field that drifts (0: all)",
    )
    serving.add_argument(
        "--publish-predictions",
        action="store_true",
        help="ask devices (in the serving message) to publish their predictions on their predictions topic",
    )


def add_async_options(parser: argparse.ArgumentParser) -> None:
    """Synchronous rounds, or asynchronous ones (FedBuff) for fleets whose stragglers a round should not wait for."""
    rounds = parser.add_argument_group("asynchronous rounds (FedBuff)")
    rounds.add_argument(
        "--mode",
        choices=("sync", "async"),
        default="sync",
        help="async: fold every --buffer arriving updates into a new version (--rounds counts versions)",
    )
    rounds.add_argument("--buffer", type=int, help="async: updates folded into each version (K)")
    rounds.add_argument(
        "--max-staleness",
        type=int,
        help=f"async: versions an update's base model may lag; older: stale (default {DEFAULT_MAX_STALENESS})",
    )
    rounds.add_argument(
        "--async-server-lr",
        type=float,
        help=f"async: server learning rate eta_g (default {AsyncPolicy.server_lr:g})",
    )


def add_dp_options(parser: argparse.ArgumentParser) -> None:
    """What a private run (--dp central or device, set in the recipe) reports its epsilon at, and its budget."""
    dp = parser.add_argument_group("differential privacy (the recipe's --dp flags set the mechanism)")
    dp.add_argument(
        "--dp-delta", type=float, default=DpSettings.delta, help="the delta the spent epsilon is reported at"
    )
    dp.add_argument(
        "--dp-epsilon-budget",
        type=float,
        help="stop (committed, exit 0) before the round that would spend more than this epsilon",
    )


def add_transfer_options(parser: argparse.ArgumentParser) -> None:
    """The broker's packet limit and what the coordinator holds of chunked updates in progress."""
    transfer = parser.add_argument_group("message size and chunked transfer")
    transfer.add_argument(
        "--max-message-bytes",
        type=int,
        help="largest MQTT packet the broker takes: the embedded broker's limit (default 1 MiB), or that of a --broker "
        "that announces none; larger messages travel in chunks",
    )
    transfer.add_argument(
        "--transfer-memory-mb",
        type=int,
        default=ServerSettings.transfer_memory_mb,
        help="memory the coordinator gives chunked updates in progress, all devices together",
    )
    transfer.add_argument(
        "--transfer-timeout",
        type=float,
        default=ServerSettings.transfer_timeout,
        help="seconds without a chunk after which an unfinished chunked update is dropped",
    )


def add_server_data_options(parser: argparse.ArgumentParser) -> None:
    """The server's own data: W0's samples and training, the selection split, the test split."""
    server = parser.add_argument_group("server data")
    server.add_argument("--data-dir", type=Path, help="Fashion-MNIST IDX files (default: the Debian package's)")
    server.add_argument(
        "--model-spec",
        type=Path,
        help="TOML model spec: architecture, input, class names (default: the paper CNN on Fashion-MNIST)",
    )
    server.add_argument(
        "--dataset",
        type=Path,
        help="the fleet's own labelled images as .npz (train_images, train_labels, test_images, test_labels), "
        "shaped as the model spec says, or a folder of class folders or a CSV of path,class, built as "
        "`fl-coordinator dataset` builds it by default; W0, selection and test accuracy come from it",
    )
    server.add_argument(
        "--init-samples",
        type=int,
        default=InitSettings.samples,
        help="W0's class-balanced labelled images (default: every --dataset image outside the selection split; "
        "on Fashion-MNIST the paper's 100)",
    )
    server.add_argument("--init-epochs", type=int, default=InitSettings.epochs)
    server.add_argument("--init-lr", type=float, default=InitSettings.learning_rate)
    server.add_argument("--init-optimizer", default=InitSettings.optimizer, choices=OPTIMIZERS)
    server.add_argument(
        "--validation-samples",
        type=int,
        help="the selection split OptFL/MixFL pick their model on (default: a quarter of --dataset, at most 1000, "
        "for those strategies, none for the others; on Fashion-MNIST the paper's 1000)",
    )
    server.add_argument("--selection-passes", type=int, default=10, help="MC passes of the BNN selection accuracy")
    server.add_argument("--test-samples", type=int, help="evaluate on the first N test images (default: all 10k)")
    server.add_argument("--no-device-eval", action="store_true", help="skip the test accuracy of each device model")
    server.add_argument(
        "--keep-updates",
        action="store_true",
        help="keep every round's accepted updates in RUN_DIR/spool after it commits (default: deleted then)",
    )
    server.add_argument(
        "--spool-batch",
        type=int,
        default=DEFAULT_BATCH,
        help="messages handled per group commit at most: one fsync makes the batch's accepted updates durable "
        f"before any of them is acked (1: one fsync per update; default {DEFAULT_BATCH})",
    )


def add_method_options(parser: argparse.ArgumentParser) -> None:
    """The active-round schedule and participation, then one flag per option the registered methods declare."""
    methods = parser.add_argument_group("active-round schedule and participation")
    methods.add_argument(
        "--participation", type=float, default=1.0, help="fraction R of online devices picked (seeded) to train"
    )
    methods.add_argument(
        "--encoder", type=Path, help="FAST: frozen encoder ONNX file (default: W0's penultimate-layer encoder)"
    )
    add_method_flags(parser)
