# `fl-coordinator provision`: a fleet's broker passwords, ACL, device credentials, HMAC keys (and TLS files).
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from coordinator.fleet.provision import DEFAULT_TLS_HOSTS, provision


def add_arguments(provision_parser: argparse.ArgumentParser) -> None:
    """A fleet's names, where its files go, and TLS."""
    provision_parser.add_argument("--fleet", required=True)
    provision_parser.add_argument("--devices", type=int, required=True)
    provision_parser.add_argument("--out", type=Path, required=True, help="a new folder")
    provision_parser.add_argument("--prefix", default="dev", help="device names are PREFIX-00, PREFIX-01, ...")
    provision_parser.add_argument("--tls", action="store_true", help="also a CA, a broker and client certificates")
    provision_parser.add_argument(
        "--tls-host",
        action="append",
        dest="tls_hosts",
        help="a name or IP the broker certificate is valid for, as devices reach it (repeatable); localhost and "
        "127.0.0.1 always (the coordinator's own connection to an embedded broker)",
    )
    provision_parser.add_argument("--log-level", default="warning")


def run(args: argparse.Namespace) -> int:
    """Writes a fleet's security files and prints where each device's credential file is."""
    secure = provision(
        args.fleet,
        args.devices,
        args.out,
        tls=args.tls,
        prefix=args.prefix,
        tls_hosts=tuple(dict.fromkeys([*(args.tls_hosts or ()), *DEFAULT_TLS_HOSTS])),
    )
    for device in sorted(secure.device_keys):
        print(f"{device} {secure.device_credentials(device)}")
    print(f"coordinator: fl-coordinator run --fleet {secure.fleet} --secure {secure.folder}", file=sys.stderr)
    print(
        f"labelling desk: fl-coordinator labelling serve RUN_DIR --fleet {secure.fleet} "
        f"--credentials {secure.folder / 'labelling.json'} ...",
        file=sys.stderr,
    )
    print(
        f"home assistant bridge: fl-coordinator ha-bridge --broker URL --credentials {secure.folder / 'ha-bridge.json'}"
        f" (Home Assistant's own login: {secure.folder / 'home-assistant.json'})",
        file=sys.stderr,
    )
    return 0
