# `fl-coordinator ha-bridge`: a fleet's predictions and presence as Home Assistant sensors (MQTT discovery, JSON).
from __future__ import annotations

import argparse
import sys
import threading
from pathlib import Path

from coordinator.bridge.ha_bridge import HaBridge, bridge_session
from coordinator.bridge.home_assistant import DEFAULT_DISCOVERY_PREFIX, SensorTopics
from coordinator.commands.labelling import desk_login
from protocol import wire
from protocol.credentials import load_credentials
from protocol.errors import UsageError
from protocol.model_spec import load_model_spec
from protocol.mqtt import BrokerAddress, parse_broker_url
from protocol.shutdown import Terminated


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The fleet's broker and login, Home Assistant's discovery prefix, the fleet's classes."""
    parser.add_argument("--broker", required=True, help="mqtt(s)://[USER:PASSWORD@]HOST:PORT of the fleet's broker")
    parser.add_argument("--fleet", help="the fleet (topic prefix fl/<fleet>/; default: the credential file's)")
    parser.add_argument(
        "--credentials",
        type=Path,
        metavar="FILE",
        help="a provisioned fleet's ha-bridge.json (from `provision`): the bridge's own login, TLS files",
    )
    parser.add_argument(
        "--discovery-prefix",
        default=DEFAULT_DISCOVERY_PREFIX,
        help=f"Home Assistant's MQTT discovery prefix (default {DEFAULT_DISCOVERY_PREFIX})",
    )
    parser.add_argument(
        "--model-spec", type=Path, help="the fleet's TOML model spec: a batch naming a class it lacks is refused"
    )
    parser.add_argument(
        "--relay",
        action="append",
        default=[],
        metavar="DEVICE_ID",
        help="a device of this fleet that is a relay (as `run --relay`), once per relay: its site devices' "
        "predictions become cameras of their own, named RELAY/DEVICE",
    )
    parser.add_argument("--log-level", default="warning")


def bridge_login(args: argparse.Namespace) -> tuple[str, BrokerAddress]:
    """(fleet, broker address with the bridge's login): the fleet from --fleet, else the credential file's, which
    must agree with it."""
    broker = parse_broker_url(args.broker)
    if args.credentials is None:
        if not args.fleet:
            raise UsageError("--fleet is required without --credentials")
        return wire.given_identifier("fleet", args.fleet), broker
    fleet = wire.given_identifier("fleet", args.fleet or load_credentials(args.credentials).fleet)
    return fleet, desk_login(broker, args.credentials, fleet)


def run(args: argparse.Namespace) -> int:
    """Bridges the fleet to Home Assistant until SIGTERM or Ctrl-C."""
    fleet, address = bridge_login(args)
    where = SensorTopics(fleet, wire.given_identifier("discovery prefix", args.discovery_prefix))
    class_names = tuple(load_model_spec(args.model_spec).spec.class_names) if args.model_spec else ()
    session = bridge_session(address, where)
    try:
        session.connect()
        relays = tuple(wire.given_identifier("--relay", name) for name in args.relay)
        bridge = HaBridge(session, where, class_names, relays).start()
        print(
            f"bridging fleet {fleet} to Home Assistant: discovery under {where.discovery_prefix}/sensor/, "
            f"states under edge-fal/{fleet}/",
            file=sys.stderr,
            flush=True,
        )
        try:
            threading.Event().wait()
        finally:
            bridge.stop()
    except (KeyboardInterrupt, Terminated):
        pass
    finally:
        session.close()
    return 0
