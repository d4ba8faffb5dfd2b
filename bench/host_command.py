# `fl-bench host`: the worker a bench spawns to serve many virtual devices in one process (one torch runtime).
from __future__ import annotations

import argparse
import logging
from pathlib import Path

from bench.host import DeviceHost, load_device_entries, route_device_logs
from protocol.shutdown import Terminated, raise_on_sigterm

log = logging.getLogger(__name__)


def add_arguments(host: argparse.ArgumentParser) -> None:
    """The devices file (each device's `fl-bench device` arguments and log file) and where failures go."""
    host.add_argument(
        "--devices",
        required=True,
        type=Path,
        help='JSON {"devices": [{"device_id", "log_file", "argv": [`fl-bench device` arguments]}, ...]}',
    )
    host.add_argument("--exits", type=Path, help="file to append `DEVICE CODE` to for each device that fails")
    host.add_argument("--log-level", default="info")


def run(args: argparse.Namespace) -> int:
    """Starts every listed device, then serves them all until each has left or a stop request arrives."""
    entries = load_device_entries(args.devices)
    host = DeviceHost(route_device_logs(), args.exits)
    raise_on_sigterm()
    try:
        for entry in entries:
            host.add(entry)
        log.info("host serving devices=%d of=%d", len(host.live), len(entries))
        host.serve()
    except Terminated:
        log.info("host stopped devices_left=%d", len(host.live))
    finally:
        host.leave_all()
    return 0
