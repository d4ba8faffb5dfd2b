# `fl-coordinator relay`: coordinate a site's devices and answer the central fleet as one device.
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from coordinator.fleet.broker import embedded_broker, embedded_packet_limit
from coordinator.fleet.provision import load_secure_fleet
from coordinator.relay import RELAY_STRATEGY, RelaySettings, run_relay
from coordinator.rounds.rules import RoundPolicy
from coordinator.setup.settings import ServerSettings
from protocol import wire
from protocol.chunks import given_packet_limit
from protocol.credentials import Credentials, load_credentials
from protocol.errors import UsageError
from protocol.mqtt import parse_broker_url


def add_arguments(relay: argparse.ArgumentParser) -> None:
    """The central broker and who the relay is there, the site broker and fleet, the site round policy."""
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
        raise UsageError("--relay-id and --fleet are required without --credentials")
    if credentials is not None and (relay_id, fleet) != (credentials.device_id, credentials.fleet):
        raise UsageError(
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
        fleet=wire.given_identifier("site fleet", args.site_fleet),
        strategy=RELAY_STRATEGY,
        policy=RoundPolicy(1, args.min_devices, args.quorum, args.round_timeout),
        ship_bundles=not args.no_bundles,
        secure_dir=args.secure,
        keep_updates=args.keep_updates,
        broker_max_packet_bytes=given_packet_limit(args.max_message_bytes),
    )
    if credentials is None:
        return RelaySettings(relay_id, fleet, site)
    return RelaySettings(relay_id, fleet, site, credentials.hmac_key, credentials.identity)


def run(args: argparse.Namespace) -> int:
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
