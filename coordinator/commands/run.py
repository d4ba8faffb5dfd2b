# `fl-coordinator run`: coordinate a fleet of field devices through an external or an embedded broker.
from __future__ import annotations

import argparse
import dataclasses
import functools
from collections.abc import Callable
from pathlib import Path

from coordinator.commands.labelling import add_field_test_share, checked_share, with_labelling
from coordinator.commands.round_console import RoundPrinter, dashboard_of
from coordinator.commands.round_options import add_round_options
from coordinator.commands.run_settings import server_settings, validate_recipe_names
from coordinator.dashboard.server import parse_listen_address
from coordinator.fleet.broker import LOCAL_CLIENT_HOSTS, EmbeddedBroker, embedded_broker, embedded_packet_limit
from coordinator.fleet.provision import load_secure_fleet
from coordinator.server import run_server
from coordinator.setup.server_data import evaluation_line, load_server_data, split_line
from coordinator.setup.settings import check_fleet_logins
from protocol.errors import UsageError
from protocol.mqtt import BrokerAddress, parse_broker_url


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
    parser.add_argument(
        "--labelling",
        action="store_true",
        help="keep the fleet's labelling queue (RUN_DIR/labelling) and serve its page at /label on the dashboard: "
        "devices run with --labelling central send their queried images there",
    )
    add_field_test_share(parser)
    parser.add_argument(
        "--broker-listen",
        metavar="[HOST:]PORT",
        help="where the embedded broker listens (0.0.0.0:1883: every address, for devices on other machines; "
        "default: a free loopback port); with --secure, its login, ACL and TLS",
    )


def run(args: argparse.Namespace) -> int:
    """Coordinates a field fleet through an external or embedded broker. The server's data is loaded and split
    before any broker starts, so a start that fails on it leaves nothing behind."""
    settings = dataclasses.replace(server_settings(args, default_fleet="fleet"), secure_dir=args.secure)
    validate_recipe_names(settings)
    check_fleet_logins(settings)
    if args.broker and args.broker_listen:
        raise UsageError("--broker-listen sets up the embedded broker; with --broker HOST the run uses that one")
    listen = parse_listen_address(args.broker_listen, "--broker-listen") if args.broker_listen else None
    secure = load_secure_fleet(args.secure) if args.secure else None
    printer = RoundPrinter(args.json, settings.policy.rounds)
    data = load_server_data(settings)
    printer.say(split_line(settings, data))
    printer.say(evaluation_line(settings, data))
    if args.labelling and args.dashboard is None:
        raise UsageError("--labelling needs --dashboard: the labelling page is served there")
    with dashboard_of(args, settings) as dashboard:
        serve: Callable[[BrokerAddress], object] = functools.partial(
            run_server,
            settings,
            on_round=printer,
            data=data,
            wait_for_devices=args.wait_devices,
            observer=None if dashboard is None else dashboard.server.live,
            say=printer.say,
        )
        if args.labelling and dashboard is not None:
            serve = with_labelling(serve, settings, dashboard, checked_share(args.field_test_share))
        if args.broker:
            serve(parse_broker_url(args.broker))
        else:
            with embedded_broker(
                settings.run_dir / "broker",
                secure,
                embedded_packet_limit(settings.broker_max_packet_bytes),
                None if listen is None else (listen.host, listen.port),
            ) as broker:
                for line in broker_lines(broker, listen is not None and not listen.loopback):
                    printer.say(line)
                serve(broker.address)
    printer.summary(settings.run_dir)
    return 0


def broker_lines(broker: EmbeddedBroker, reachable: bool) -> list[str]:
    """What a person needs to know of the embedded broker: where it listens and the --broker devices use, or
    that only this machine can reach it; off loopback without a login, that anyone on the network may publish."""
    listening = broker.listening
    lines = [f"embedded broker listening at {listening.url}"]
    if not reachable:
        lines.append("devices on this machine only: give --broker-listen 0.0.0.0:PORT for devices on other machines")
        return lines
    if listening.host in LOCAL_CLIENT_HOSTS:
        scheme = "mqtts" if listening.tls else "mqtt"
        lines.append(
            f"devices connect with --broker {scheme}://HOST:{listening.port}, HOST being this machine's name or address"
        )
    else:
        lines.append(f"devices connect with --broker {listening.url}")
    if not broker.extra_config:
        lines.append(
            "warning: no broker login: anyone who reaches this port may publish to the fleet; on a network you do "
            "not trust, run `fl-coordinator provision` and --secure DIR"
        )
    return lines
