# `fl-coordinator run`: coordinate a fleet of field devices through an external or an embedded broker.
from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

from coordinator.commands.round_console import RoundPrinter, dashboard_for
from coordinator.commands.round_options import add_round_options
from coordinator.commands.run_settings import server_settings, validate_recipe_names
from coordinator.fleet.broker import embedded_broker, embedded_packet_limit
from coordinator.fleet.provision import load_secure_fleet
from coordinator.server import run_server
from protocol.mqtt import parse_broker_url


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The round options, waiting for devices, a provisioned (secured) fleet."""
    add_round_options(parser)
    parser.add_argument("--wait-devices", type=int, default=0, help="wait until this many devices are online")
    parser.add_argument(
        "--seed-labels",
        type=int,
        help="labels each device holds before round 1 (the seeds `partition` dealt): with a strategy that weighs by "
        "samples and no label fractions, a claim above them plus the schedule's labels is refused (default: unknown)",
    )
    parser.add_argument(
        "--relay",
        action="append",
        default=[],
        metavar="DEVICE_ID",
        help="a device of this fleet that is a relay (fl-coordinator relay), once per relay: only a relay's update may "
        "name contributors, each of which counts towards --max-sample-share; any other's is refused as not_relay",
    )
    parser.add_argument(
        "--secure", type=Path, metavar="DIR", help="a folder from `provision`: broker login, ACL, signed updates only"
    )


def run(args: argparse.Namespace) -> int:
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
