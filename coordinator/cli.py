# The fl-coordinator command line: `run` (field), `simulate` (bench), `relay` (a site), `partition` (shards),
# `provision` (security), `encoder` (FAST's frozen encoder).
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from bench.simulate import BenchSettings, simulate, write_shards
from coordinator.async_intake import AsyncPolicy
from coordinator.broker import BrokerError, embedded_broker, embedded_packet_limit
from coordinator.dashboard.live import LiveState
from coordinator.dashboard.server import Dashboard, dashboard_token, parse_listen_address
from coordinator.encoder_command import add_encoder_command, command_encoder
from coordinator.method_flags import (
    add_method_choice,
    add_method_flags,
    check_recipe_options,
    chosen_options,
    method_kinds,
    options_table,
)
from coordinator.observer import RoundResult
from coordinator.provision import DEFAULT_TLS_HOSTS, load_secure_fleet, provision
from coordinator.relay import RELAY_STRATEGY, RelaySettings, run_relay
from coordinator.round_aggregator import SuspectPolicy
from coordinator.rounds import DEFAULT_BATCH, RoundPolicy
from coordinator.server import (
    InitSettings,
    ServerSettings,
    load_encoder,
    load_server_data,
    run_server,
)
from coordinator.store import RunStore, stored_spec
from coordinator.strategies import make_strategy
from edge_agent.data.fashion_mnist import DatasetMissingError
from edge_agent.learning.local_rules import LOCAL_RULES, make_local_rule
from edge_agent.learning.lr_schedules import LR_SCHEDULES
from edge_agent.learning.sampling import make_sampler
from edge_agent.learning.training import OPTIMIZERS
from edge_agent.loop.schedule import check_schedule
from export.cli import add_bundle_options, export_weights
from protocol import messages, wire
from protocol.chunks import MIN_PACKET_BYTES
from protocol.credentials import Credentials, load_credentials
from protocol.logs import configure_logging
from protocol.model_spec import DEFAULT_SPEC, SpecFile, load_model_spec
from protocol.mqtt import BrokerUnavailableError, parse_broker_url
from protocol.shutdown import Terminated, raise_on_sigterm
from protocol.update_codec import ENCODINGS, SCALES, UpdateCodec

log = logging.getLogger("coordinator")


def add_round_options(parser: argparse.ArgumentParser) -> None:
    """Options shared by `run` and `simulate`: the run, the round policy, the recipe, the server data."""
    add_run_options(parser)
    add_async_options(parser)
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
        "--max-staleness", type=int, default=4, help="async: versions an update's base model may lag; older: stale"
    )
    rounds.add_argument("--async-server-lr", type=float, default=1.0, help="async: server learning rate eta_g")


def async_policy(args: argparse.Namespace) -> AsyncPolicy | None:
    """The AsyncPolicy of --mode async, or None for synchronous rounds (async-only flags are then an error)."""
    if args.mode == "sync":
        given = [
            flag
            for flag, value in (("--buffer", args.buffer), ("--async-server-lr", args.async_server_lr != 1.0))
            if value
        ]
        if given:
            raise ValueError(f"{', '.join(given)} only apply to --mode async")
        return None
    if args.buffer is None:
        raise ValueError("--mode async needs --buffer K, the updates folded into each version")
    return AsyncPolicy(args.buffer, args.max_staleness, args.async_server_lr)


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


def add_recipe_options(parser: argparse.ArgumentParser) -> None:
    """The round recipe every device follows: sampler, budget, local rule and its training settings."""
    recipe = parser.add_argument_group("round recipe (sent to devices)")
    add_method_choice(recipe, method_kinds()[0])
    recipe.add_argument("--labels-per-acquisition", type=int, default=400)
    recipe.add_argument("--acquisitions-per-round", type=int, default=1)
    add_method_choice(recipe, method_kinds()[1])
    recipe.add_argument("--epochs", type=int, default=5)
    recipe.add_argument("--batch-size", type=int, default=messages.Recipe.batch_size)
    recipe.add_argument("--lr", type=float, default=messages.Recipe.learning_rate)
    recipe.add_argument("--momentum", type=float, default=messages.Recipe.momentum)
    recipe.add_argument("--weight-decay", type=float, default=messages.Recipe.weight_decay)
    recipe.add_argument(
        "--lr-schedule",
        default=messages.Recipe.lr_schedule,
        choices=LR_SCHEDULES,
        help="the learning rate within a round's local training: constant, or cosine from --lr down towards 0 "
        "(restarting each round from the received global model)",
    )
    recipe.add_argument("--mc-passes", type=int, default=10)
    recipe.add_argument("--seed", type=int, default=0)
    add_update_options(recipe)


def add_update_options(recipe: argparse._ArgumentGroup) -> None:
    """The recipe's part that says how devices encode what they send: encoding, scales, top-k, compression."""
    recipe.add_argument(
        "--update-encoding",
        default=messages.Recipe.update_encoding,
        help=f"what devices send: {', '.join(ENCODINGS)} (weights, or their delta from the round's model in fp16 or "
        f"int8; default {messages.Recipe.update_encoding})",
    )
    recipe.add_argument(
        "--update-scales",
        default=messages.Recipe.update_scales,
        help=f"int8-delta's scales: {' or '.join(SCALES)} (one per tensor, or per output channel)",
    )
    recipe.add_argument(
        "--update-top-k",
        type=float,
        default=messages.Recipe.update_top_k,
        metavar="FRACTION",
        help="send only this fraction of each tensor's delta (largest first; the device keeps the rest for later rounds)",
    )
    recipe.add_argument(
        "--update-compression",
        default=messages.Recipe.update_compression,
        choices=wire.COMPRESSIONS,
        help="deflate each update message (lossless; fp16 and int8 deltas shrink by a third to a half again)",
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
        "shaped as the model spec says; W0, selection and test accuracy come from it",
    )
    server.add_argument("--init-samples", type=int, default=InitSettings.samples, help="balanced samples for W0")
    server.add_argument("--init-epochs", type=int, default=InitSettings.epochs)
    server.add_argument("--init-lr", type=float, default=InitSettings.learning_rate)
    server.add_argument("--init-optimizer", default=InitSettings.optimizer, choices=OPTIMIZERS)
    server.add_argument("--validation-samples", type=int, default=1000, help="OptFL/MixFL selection split size")
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
    methods.add_argument("--rounds-per-acquisition", type=int, default=1, help="communication rounds per active round")
    methods.add_argument(
        "--initial-label-fraction", type=float, default=0.0, help="fraction of its data a device labels at first"
    )
    methods.add_argument(
        "--label-fraction", type=float, default=0.0, help="labels per acquisition as a fraction of the device's data"
    )
    methods.add_argument(
        "--encoder", type=Path, help="FAST: frozen encoder ONNX file (default: W0's penultimate-layer encoder)"
    )
    add_method_flags(parser)


def build_parser() -> argparse.ArgumentParser:
    """Arguments of every fl-coordinator subcommand (the method flags come from the registries as they are now)."""
    parser = argparse.ArgumentParser(prog="fl-coordinator", description="Federated active-learning coordinator.")
    commands = parser.add_subparsers(dest="command", required=True)
    add_run_command(commands.add_parser("run", help="coordinate a fleet of field devices"))
    add_simulate_command(commands.add_parser("simulate", help="bench: N real agents on this machine"))
    add_relay_command(
        commands.add_parser("relay", help="coordinate a site's devices and answer the central fleet as one device")
    )
    add_provision_command(
        commands.add_parser(
            "provision", help="write a fleet's broker passwords, ACL, device credentials, HMAC keys (and TLS files)"
        )
    )
    add_partition_command(commands.add_parser("partition", help="write per-device pool shards for separate agents"))
    add_run_dir_commands(commands)
    add_encoder_command(
        commands.add_parser("encoder", help="fit FAST's frozen encoder (PCA) on unlabelled images and write its ONNX")
    )
    return parser


def add_run_command(run: argparse.ArgumentParser) -> None:
    """`run`: the round options, waiting for devices, a provisioned (secured) fleet."""
    add_round_options(run)
    run.add_argument("--wait-devices", type=int, default=0, help="wait until this many devices are online")
    run.add_argument(
        "--secure", type=Path, metavar="DIR", help="a folder from `provision`: broker login, ACL, signed updates only"
    )


def add_simulate_command(simulate_parser: argparse.ArgumentParser) -> None:
    """`simulate`: the round options, the bench's split, and a secured bench."""
    add_round_options(simulate_parser)
    add_bench_options(simulate_parser)
    simulate_parser.add_argument(
        "--secure", action="store_true", help="provision the bench fleet into RUN_DIR/secure and run it secured"
    )
    simulate_parser.add_argument(
        "--tls", action="store_true", help="with --secure: TLS between every client and the broker"
    )
    simulate_parser.add_argument(
        "--workers",
        type=int,
        help="worker processes hosting the virtual devices (default: one per core; more where a worker would host "
        "over 200)",
    )
    simulate_parser.add_argument(
        "--process-per-device",
        action="store_true",
        help="one agent process per device (as many torch runtimes) instead of virtual devices in a few workers",
    )


def add_relay_command(relay: argparse.ArgumentParser) -> None:
    """`relay`: the central broker and who the relay is there, the site broker and fleet, the site round policy."""
    upstream = relay.add_argument_group("upstream (the central fleet, where the relay is one device)")
    upstream.add_argument("--upstream", required=True, help="mqtt(s)://HOST:PORT of the central fleet's broker")
    upstream.add_argument(
        "--credentials", type=Path, help="the relay's device credential file of the central fleet (from provision)"
    )
    upstream.add_argument("--fleet", help="the central fleet (default: the credential file's)")
    upstream.add_argument(
        "--relay-id", help="the relay's device id in the central fleet (default: the credential file's)"
    )
    site = relay.add_argument_group("site (the relay's own devices)")
    site.add_argument("--site-fleet", required=True, help="fleet name of the site's devices (topic prefix fl/<fleet>/)")
    site.add_argument("--broker", help="mqtt://HOST:PORT of the site broker (default: an embedded mosquitto)")
    site.add_argument("--secure", type=Path, metavar="DIR", help="the site fleet's folder from `provision`")
    site.add_argument("--run-dir", type=Path, required=True, help="the relay's store and spool (a restart resumes)")
    site.add_argument("--min-devices", type=int, default=1, help="fewest site updates a site round may aggregate")
    site.add_argument("--quorum", type=int, help="site updates that close a site round early (default: all online)")
    site.add_argument("--round-timeout", type=float, default=600.0, help="seconds before a site round closes anyway")
    site.add_argument("--max-message-bytes", type=int, help="the embedded site broker's packet limit (default 1 MiB)")
    site.add_argument("--no-bundles", action="store_true", help="ship no ONNX bundle to the site devices")
    site.add_argument("--keep-updates", action="store_true", help="keep the site devices' updates after each round")
    relay.add_argument("--log-level", default="warning")


def relay_identity(args: argparse.Namespace, credentials: Credentials | None) -> tuple[str, str]:
    """(relay id, central fleet): the flags, else the credential file's; both must agree with the file's."""
    relay_id = args.relay_id or (credentials.device_id if credentials else None)
    fleet = args.fleet or (credentials.fleet if credentials else None)
    if not relay_id or not fleet:
        raise ValueError("--relay-id and --fleet are required without --credentials")
    if credentials is not None and (relay_id, fleet) != (credentials.device_id, credentials.fleet):
        raise ValueError(
            f"{args.credentials} belongs to device {credentials.device_id!r} of fleet {credentials.fleet!r}, "
            f"not {relay_id!r} of {fleet!r}"
        )
    return relay_id, fleet


def relay_settings(args: argparse.Namespace, credentials: Credentials | None) -> RelaySettings:
    """RelaySettings from parsed arguments: the site side is a FedAvg coordinator's settings (its `rounds` unused:
    the central coordinator decides how many rounds there are)."""
    relay_id, fleet = relay_identity(args, credentials)
    site = ServerSettings(
        run_dir=args.run_dir,
        fleet=wire.check_identifier("site fleet", args.site_fleet),
        strategy=RELAY_STRATEGY,
        policy=RoundPolicy(1, args.min_devices, args.quorum, args.round_timeout),
        ship_bundles=not args.no_bundles,
        secure_dir=args.secure,
        keep_updates=args.keep_updates,
        broker_max_packet_bytes=check_packet_limit(args.max_message_bytes),
    )
    return RelaySettings(relay_id, fleet, site, credentials.hmac_key if credentials else b"")


def add_provision_command(provision_parser: argparse.ArgumentParser) -> None:
    """`provision`: a fleet's names, where its files go, and TLS."""
    provision_parser.add_argument("--fleet", required=True)
    provision_parser.add_argument("--devices", type=int, required=True)
    provision_parser.add_argument("--out", type=Path, required=True, help="a new folder")
    provision_parser.add_argument("--prefix", default="dev", help="device names are PREFIX-00, PREFIX-01, ...")
    provision_parser.add_argument("--tls", action="store_true", help="also a CA, a broker and client certificates")
    provision_parser.add_argument(
        "--tls-host",
        action="append",
        dest="tls_hosts",
        help="a name or IP the broker certificate is valid for (repeatable; default localhost and 127.0.0.1)",
    )
    provision_parser.add_argument("--log-level", default="warning")


def add_partition_command(partition: argparse.ArgumentParser) -> None:
    """`partition`: the bench's split written as shard files."""
    add_bench_options(partition)
    partition.add_argument("--out", type=Path, required=True)
    partition.add_argument("--data-dir", type=Path)
    partition.add_argument("--init-samples", type=int, default=InitSettings.samples)
    partition.add_argument("--validation-samples", type=int, default=1000)
    partition.add_argument("--seed", type=int, default=0)
    partition.add_argument("--log-level", default="warning")


def add_run_dir_commands(commands: argparse._SubParsersAction) -> None:
    """`report`, `export` (both read a run directory) and `methods`."""
    report = commands.add_parser("report", help="write a run's self-contained HTML report")
    report.add_argument("run_dir", type=Path, metavar="RUN_DIR")
    report.add_argument("--out", type=Path, help="where to write it (default RUN_DIR/report.html)")
    report.add_argument("--log-level", default="warning")
    methods = commands.add_parser("methods", help="list the samplers, local rules and strategies with their options")
    methods.add_argument("--markdown", action="store_true", help="the README's table (default: plain text)")
    methods.add_argument("--log-level", default="warning")
    export = commands.add_parser("export", help="write a device bundle (ONNX, MC dropout kept) of a run's checkpoint")
    export.add_argument("run_dir", type=Path, metavar="RUN_DIR")
    export.add_argument("--round", type=int, help="checkpoint round to export (default: the latest)")
    add_bundle_options(export)
    export.add_argument("--log-level", default="warning")


def add_bench_options(parser: argparse.ArgumentParser) -> None:
    """How a simulated fleet's data is split."""
    bench = parser.add_argument_group("bench")
    bench.add_argument("--devices", type=int, default=4)
    bench.add_argument("--partition", default="type1", help="type1, type2, iid, dirichlet:ALPHA or clusters:K")
    bench.add_argument("--pool-size", type=int, default=BenchSettings.pool_size, help="unlabelled pool per device")
    bench.add_argument("--agent-threads", type=int, default=1, help="torch threads per simulated agent")
    bench.add_argument(
        "--agent-profile", type=Path, help="device profile every simulated agent runs with (firmware_configs/*.toml)"
    )
    bench.add_argument(
        "--seed-per-class",
        type=int,
        default=BenchSettings.seed_per_class,
        help="labelled seeds per class from the server's W0 samples given to every device "
        "(its initial replay set; 0 for none)",
    )
    bench.add_argument("--slow-fraction", type=float, default=0.0, help="fraction of the devices made slow (seeded)")
    bench.add_argument("--slow-factor", type=float, default=1.0, help="how many times slower a slow device is")


def bench_settings(args: argparse.Namespace) -> BenchSettings:
    """BenchSettings from parsed arguments."""
    return BenchSettings(
        args.devices,
        args.partition,
        args.pool_size,
        args.agent_threads,
        args.seed,
        args.seed_per_class,
        args.agent_profile,
        getattr(args, "secure", False),
        getattr(args, "tls", False),
        process_per_device=getattr(args, "process_per_device", False),
        workers=getattr(args, "workers", None),
        slow_fraction=args.slow_fraction,
        slow_factor=args.slow_factor,
    )


def round_policy(args: argparse.Namespace) -> RoundPolicy:
    """When rounds close (quorum, minimum, deadline, participation) and how many updates share one fsync."""
    return RoundPolicy(
        args.rounds,
        args.min_devices,
        args.quorum,
        args.round_timeout,
        participation=args.participation,
        batch=args.spool_batch,
    )


def server_settings(args: argparse.Namespace, default_fleet: str) -> ServerSettings:
    """ServerSettings from parsed arguments."""
    fleet = wire.check_identifier("fleet", args.fleet or default_fleet)
    recipe_options, strategy_options = chosen_options(args)
    run_dir = args.run_dir or Path("runs") / f"{time.strftime('%Y%m%d-%H%M%S')}-{fleet}-{args.strategy}"
    spec_file = load_model_spec(args.model_spec) if args.model_spec else SpecFile(DEFAULT_SPEC)
    return ServerSettings(
        run_dir=run_dir,
        fleet=fleet,
        strategy=args.strategy,
        recipe=recipe_from(args, recipe_options),
        policy=round_policy(args),
        init=InitSettings(
            args.init_samples, args.init_epochs, args.init_lr, optimizer=args.init_optimizer, seed=args.seed
        ),
        validation_samples=args.validation_samples,
        selection_passes=args.selection_passes,
        test_samples=args.test_samples,
        evaluate_devices=not args.no_device_eval,
        data_dir=args.data_dir,
        dataset=args.dataset,
        spec=spec_file.spec,
        initial_weights=spec_file.initial_weights,
        torch_threads=args.torch_threads,
        strategy_options=strategy_options,
        suspects=SuspectPolicy(threshold=args.suspect_threshold, exclude=args.exclude_suspects),
        ship_bundles=not args.no_bundles,
        encoder_path=args.encoder,
        keep_updates=args.keep_updates,
        broker_max_packet_bytes=check_packet_limit(args.max_message_bytes),
        transfer_memory_mb=args.transfer_memory_mb,
        transfer_timeout=args.transfer_timeout,
        asynchronous=async_policy(args),
    )


def check_packet_limit(limit: int | None) -> int | None:
    """--max-message-bytes, if given, leaves room for chunks."""
    if limit is not None and limit < MIN_PACKET_BYTES:
        raise ValueError(f"--max-message-bytes must be at least {MIN_PACKET_BYTES}, got {limit}")
    return limit


def recipe_from(args: argparse.Namespace, options: dict[str, float]) -> messages.Recipe:
    """The round recipe devices get, from parsed arguments and the checked method options."""
    return messages.Recipe(
        sampler=args.sampler,
        labels_per_acquisition=args.labels_per_acquisition,
        acquisitions_per_round=args.acquisitions_per_round,
        local_rule=args.local_rule,
        epochs=args.epochs,
        batch_size=args.batch_size,
        learning_rate=args.lr,
        momentum=args.momentum,
        weight_decay=args.weight_decay,
        mc_passes=args.mc_passes,
        seed=args.seed,
        options=options,
        rounds_per_acquisition=args.rounds_per_acquisition,
        initial_label_fraction=args.initial_label_fraction,
        label_fraction=args.label_fraction,
        update_encoding=args.update_encoding,
        update_scales=args.update_scales,
        update_top_k=args.update_top_k,
        update_compression=args.update_compression,
        lr_schedule=args.lr_schedule,
    )


def validate_recipe_names(settings: ServerSettings) -> None:
    """Fails fast, before any process starts, on a sampler, rule, strategy or update encoding nobody knows, a bad
    method parameter, or a strategy that weighs updates by a metric the local rule does not report."""
    make_sampler(settings.recipe.sampler)
    rule = make_local_rule(settings.recipe.local_rule)
    strategy = make_strategy(settings.strategy, **settings.strategy_options)
    check_recipe_options(settings.recipe.sampler, settings.recipe.local_rule, settings.recipe.options)
    missing = sorted(set(strategy.required_metrics) - set(rule.reported_metrics))
    if missing:
        fitting = LOCAL_RULES.select(lambda known: set(missing) <= set(known.reported_metrics))
        raise ValueError(
            f"strategy {strategy.name!r} weighs updates by {', '.join(missing)}, which local rule "
            f"{rule.name!r} does not report; use --local-rule {' or '.join(sorted(fitting))}"
        )
    check_schedule(settings.recipe)
    UpdateCodec.of(settings.recipe)
    if settings.encoder_path is not None:
        load_encoder(settings.encoder_path, settings.spec)


class RoundPrinter:
    """Prints each round as it closes (a JSON line, or a human progress line) and the summary at the end."""

    def __init__(self, as_json: bool, total_rounds: int) -> None:
        self.as_json = as_json
        self.total_rounds = total_rounds
        self.results: list[RoundResult] = []
        self.started = time.monotonic()

    def __call__(self, result: RoundResult) -> None:
        self.results.append(result)
        devices = sorted(result.device_accuracy)
        if self.as_json:
            print(
                json.dumps(
                    {
                        "round": result.round_id,
                        "accuracy": result.accuracy,
                        "device_accuracy": [result.device_accuracy[d] for d in devices],
                        "devices": devices,
                        "labels": result.labels,
                        "divergence": {d: list(layers.values()) for d, layers in sorted(result.divergence.items())},
                        "seconds": round(result.seconds, 3),
                        "rejected": result.rejected,
                        "suspects": result.suspects,
                    }
                ),
                flush=True,
            )
        else:
            local = " ".join(f"{result.device_accuracy[d]:.3f}" for d in devices)
            print(
                f"round {result.round_id:>3}/{self.total_rounds}  global acc {result.accuracy:.4f}  "
                f"devices [{local}]  labels {result.labels}  {result.seconds:.1f}s"
                + (f"  rejected {len(result.rejected)}" if result.rejected else "")
                + (f"  suspects {','.join(sorted(result.suspects))}" if result.suspects else ""),
                flush=True,
            )

    def summary(self, run_dir: Path, report: Path | None = None) -> None:
        """The closing line (JSON) or table (human), naming the run's HTML report when one was written."""
        if not self.results:
            return
        last = self.results[-1]
        summary = {
            "final_accuracy": last.accuracy,
            "best_device_accuracy": max(last.device_accuracy.values(), default=None),
            "rounds": len(self.results),
            "labels": last.labels,
            "seconds": round(time.monotonic() - self.started, 3),
            "run_dir": str(run_dir),
            "report": None if report is None else str(report),
        }
        if self.as_json:
            print(json.dumps({"summary": summary}), flush=True)
            return
        devices = sorted({d for r in self.results for d in r.device_accuracy})
        print()
        print("round  global  " + "  ".join(f"{d:>7}" for d in devices) + "   labels  seconds")
        for r in self.results:
            cells = "  ".join(f"{r.device_accuracy[d]:7.4f}" if d in r.device_accuracy else "      -" for d in devices)
            print(f"{r.round_id:>5}  {r.accuracy:.4f}  {cells}  {r.labels:>7}  {r.seconds:7.1f}")
        print(
            f"\nfinal global accuracy {summary['final_accuracy']:.4f}; {summary['labels']} labels; "
            f"{summary['seconds']:.0f}s; run stored in {run_dir}"
        )
        if report is not None:
            print(f"report: {report}")


@contextlib.contextmanager
def dashboard_for(args: argparse.Namespace, settings: ServerSettings) -> Iterator[LiveState | None]:
    """The live state of a dashboard served for the run's duration if --dashboard asks for one, else None."""
    if args.dashboard is None:
        if args.dashboard_token is not None:
            raise ValueError("--dashboard-token needs --dashboard")
        yield None
        return
    address = parse_listen_address(args.dashboard)
    token = dashboard_token(address, args.dashboard_token, settings.run_dir)
    live = LiveState(settings.policy.rounds)
    with Dashboard(address, settings.run_dir, live, token) as dashboard:
        where = f"{dashboard.url}#token={token}" if token and args.dashboard_token is None else dashboard.url
        print(f"dashboard at {where}", file=sys.stderr, flush=True)
        yield live


def command_run(args: argparse.Namespace) -> int:
    """Coordinates a field fleet through an external or embedded broker."""
    settings = dataclasses.replace(server_settings(args, default_fleet="fleet"), secure_dir=args.secure)
    validate_recipe_names(settings)
    secure = load_secure_fleet(args.secure) if args.secure else None
    printer = RoundPrinter(args.json, settings.policy.rounds)
    with dashboard_for(args, settings) as live:
        if args.broker:
            run_server(
                settings, parse_broker_url(args.broker), printer, wait_for_devices=args.wait_devices, observer=live
            )
        else:
            with embedded_broker(
                settings.run_dir / "broker", secure, embedded_packet_limit(settings.broker_max_packet_bytes)
            ) as broker:
                print(f"embedded broker listening at {broker.address.url}", file=sys.stderr, flush=True)
                run_server(settings, broker.address, printer, wait_for_devices=args.wait_devices, observer=live)
    printer.summary(settings.run_dir)
    return 0


def command_relay(args: argparse.Namespace) -> int:
    """Relays a site: its devices on the site broker (external or embedded), one device upstream."""
    credentials = load_credentials(args.credentials) if args.credentials else None
    settings = relay_settings(args, credentials)
    upstream = parse_broker_url(args.upstream)
    upstream = credentials.apply_to(upstream) if credentials is not None else upstream
    if args.broker:
        run_relay(settings, upstream, parse_broker_url(args.broker))
        return 0
    secure = load_secure_fleet(args.secure) if args.secure else None
    limit = embedded_packet_limit(settings.site.broker_max_packet_bytes)
    with embedded_broker(settings.site.run_dir / "broker", secure, limit) as broker:
        print(f"embedded site broker listening at {broker.address.url}", file=sys.stderr, flush=True)
        run_relay(settings, upstream, broker.address)
    return 0


def command_simulate(args: argparse.Namespace) -> int:
    """The bench: shards, an embedded (or given) broker, N agents (virtual, in workers) and the coordinator."""
    settings = server_settings(args, default_fleet="bench")
    validate_recipe_names(settings)
    if args.quorum is None:
        settings = dataclasses.replace(settings, policy=dataclasses.replace(settings.policy, quorum=args.devices))
    bench = bench_settings(args)
    if bench.workers is not None and bench.workers < 1:
        raise ValueError(f"--workers must be at least 1, got {bench.workers}")
    if bench.secure and args.broker:
        raise ValueError("simulate --secure provisions a fresh fleet and runs its own broker: drop --broker")
    if settings.dataset is not None:
        raise ValueError(
            "simulate deals Fashion-MNIST shards to its bench devices; a fleet with its own images runs with "
            "`fl-coordinator run --model-spec --dataset` and field agents (see benchmarks/camera_bench.py)"
        )
    printer = RoundPrinter(args.json, settings.policy.rounds)
    address = parse_broker_url(args.broker) if args.broker else None
    with dashboard_for(args, settings) as live:
        simulate(settings, bench, printer, address, observer=live)
    printer.summary(settings.run_dir, write_report(settings.run_dir))
    return 0


def write_report(run_dir: Path, out: Path | None = None) -> Path:
    """Writes the run's HTML report (matplotlib is imported here, so other commands start without it)."""
    from coordinator.dashboard.report import write_report as write_html_report

    return write_html_report(run_dir, out)


def command_report(args: argparse.Namespace) -> int:
    """Writes the self-contained HTML report of a run directory and prints its path."""
    print(write_report(args.run_dir, args.out))
    return 0


def command_methods(args: argparse.Namespace) -> int:
    """Prints every registered method with its options: the README's markdown table, or plain lines."""
    if args.markdown:
        print(options_table())
        return 0
    for kind in method_kinds():
        for name, method in kind.registry.items():
            flags = ", ".join(
                f"{o.cli_flag} {o.kind.__name__} = {o.default:g} ({o.range_text})" for o in method.options
            )
            print(f"{kind.label:<11} {name:<17} {method.summary}" + (f"  [{flags}]" if flags else ""))
    return 0


def command_export(args: argparse.Namespace) -> int:
    """Exports a run's checkpoint (the latest, or --round N) as a verified device bundle."""
    if not (args.run_dir / "run.sqlite").is_file():
        raise ValueError(f"{args.run_dir} is not a run directory (no run.sqlite)")
    with RunStore(args.run_dir) as store:
        round_id = store.checkpoints.latest_round() if args.round is None else args.round
        if round_id is None:
            raise ValueError(f"{args.run_dir} holds no checkpoints yet")
        weights = store.checkpoints.load(round_id)
        spec = stored_spec(store.config())
    export_weights(weights, f"{args.run_dir} round {round_id}", args, spec)
    return 0


def command_provision(args: argparse.Namespace) -> int:
    """Writes a fleet's security files and prints where each device's credential file is."""
    secure = provision(
        args.fleet,
        args.devices,
        args.out,
        tls=args.tls,
        prefix=args.prefix,
        tls_hosts=tuple(args.tls_hosts or DEFAULT_TLS_HOSTS),
    )
    for device in sorted(secure.device_keys):
        print(f"{device} {secure.device_credentials(device)}")
    print(f"coordinator: fl-coordinator run --fleet {secure.fleet} --secure {secure.folder}", file=sys.stderr)
    return 0


def command_partition(args: argparse.Namespace) -> int:
    """Writes the bench's per-device shards to a folder, for agents started by hand."""
    settings = ServerSettings(
        run_dir=args.out,
        init=InitSettings(samples=args.init_samples, seed=args.seed),
        validation_samples=args.validation_samples,
        data_dir=args.data_dir,
    )
    bench = bench_settings(args)
    for launch in write_shards(load_server_data(settings), bench, args.out):
        print(f"{launch.device_id} {launch.shard}")
    return 0


COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "run": command_run,
    "simulate": command_simulate,
    "relay": command_relay,
    "partition": command_partition,
    "provision": command_provision,
    "report": command_report,
    "export": command_export,
    "methods": command_methods,
    "encoder": command_encoder,
}


def main(argv: list[str] | None = None) -> int:
    """Entry point of the fl-coordinator console script."""
    args = build_parser().parse_args(argv)
    configure_logging(args.log_level)
    raise_on_sigterm()
    try:
        return COMMANDS[args.command](args)
    except (
        DatasetMissingError,
        BrokerError,
        BrokerUnavailableError,
        ValueError,
        FileNotFoundError,
        FileExistsError,
    ) as error:
        print(f"fl-coordinator: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except Terminated:
        return 143
