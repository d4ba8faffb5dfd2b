# `fl-bench simulate`: N real agents on this machine (virtual devices in a few workers) against an embedded (or
# given) broker and the coordinator, with the round options of `fl-coordinator run`.
from __future__ import annotations

import argparse
import dataclasses

from bench.bench_options import add_bench_options, bench_settings
from bench.simulate import simulate
from coordinator.commands.report import write_report
from coordinator.commands.round_console import RoundPrinter, dashboard_for
from coordinator.commands.round_options import add_round_options
from coordinator.commands.run_settings import server_settings, validate_recipe_names
from protocol.errors import UsageError
from protocol.mqtt import parse_broker_url


def add_arguments(simulate_parser: argparse.ArgumentParser) -> None:
    """The round options, the bench's split, and a secured bench."""
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


def run(args: argparse.Namespace) -> int:
    """The bench: shards, an embedded (or given) broker, N agents (virtual, in workers) and the coordinator."""
    settings = server_settings(args, default_fleet="bench")
    validate_recipe_names(settings)
    if args.quorum is None:
        settings = dataclasses.replace(settings, policy=dataclasses.replace(settings.policy, quorum=args.devices))
    bench = bench_settings(args)
    if bench.workers is not None and bench.workers < 1:
        raise UsageError(f"--workers must be at least 1, got {bench.workers}")
    if bench.secure and args.broker:
        raise UsageError("simulate --secure provisions a fresh fleet and runs its own broker: drop --broker")
    if settings.dataset is not None:
        raise UsageError(
            "simulate deals Fashion-MNIST shards to its bench devices; a fleet with its own images runs with "
            "`fl-coordinator run --model-spec --dataset` and field agents (see benchmarks/camera_bench.py)"
        )
    printer = RoundPrinter(args.json, settings.policy.rounds)
    address = parse_broker_url(args.broker) if args.broker else None
    with dashboard_for(args, settings) as live:
        simulate(settings, bench, printer, address, observer=live)
    printer.summary(settings.run_dir, write_report(settings.run_dir))
    return 0
