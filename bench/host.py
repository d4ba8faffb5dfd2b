# The bench's device host: many virtual devices in one process, each its own Agent, session, data and log.
from __future__ import annotations

import argparse
import json
import logging
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from bench import device_command
from edge_agent.run_command import OpenedDevice
from protocol.errors import UsageError
from protocol.mqtt import BrokerUnavailableError

log = logging.getLogger(__name__)

SWEEP_SECONDS = 1.0
IDLE_SECONDS = 0.01
MAX_DEVICES_FILE_BYTES = 64 * 1024 * 1024


@dataclass(frozen=True)
class DeviceEntry:
    """One hosted device: its id, its log file, and the `fl-bench device` arguments a process of its own would get."""

    device_id: str
    log_file: Path
    argv: list[str]


def load_device_entries(path: Path) -> list[DeviceEntry]:
    """The devices file: {"devices": [{"device_id", "log_file", "argv"}, ...]}; a UsageError naming what is wrong."""
    if not path.is_file():
        raise UsageError(f"{path}: no such devices file")
    if path.stat().st_size > MAX_DEVICES_FILE_BYTES:
        raise UsageError(f"{path} is larger than {MAX_DEVICES_FILE_BYTES} bytes")
    try:
        listed = json.loads(path.read_text())["devices"]
        return [DeviceEntry(str(d["device_id"]), Path(d["log_file"]), [str(a) for a in d["argv"]]) for d in listed]
    # json raises ValueError for a damaged devices file: the file named
    except (ValueError, KeyError, TypeError) as error:
        raise UsageError(f"{path} is not a devices file: {str(error)[:200]}") from None


class DeviceLogs(logging.Handler):
    """Writes what is logged on the host's thread while it drives a device to that device's own log file; other
    records (paho's network threads, the host itself) go to the worker's handler."""

    def __init__(self, fallback: logging.Handler) -> None:
        super().__init__()
        self.fallback = fallback
        self.setFormatter(fallback.formatter)
        self.current: Path | None = None
        self.thread = threading.get_ident()

    @contextmanager
    def device(self, log_file: Path) -> Iterator[None]:
        """Routes the host thread's records to `log_file` for the enclosed work."""
        self.current = log_file
        try:
            yield
        finally:
            self.current = None

    def emit(self, record: logging.LogRecord) -> None:
        """One record to the current device's file, or to the worker's handler."""
        if self.current is None or record.thread != self.thread:
            self.fallback.handle(record)
            return
        self.write(self.current, self.format(record))

    @staticmethod
    def write(log_file: Path, line: str) -> None:
        """Appends one line to a device's log (opened per line: a worker hosts more devices than it keeps files)."""
        with open(log_file, "a", encoding="utf-8") as stream:
            stream.write(line + "\n")


def route_device_logs() -> DeviceLogs:
    """Puts a DeviceLogs in front of the root logger's handler (set up by configure_logging)."""
    root = logging.getLogger()
    logs = DeviceLogs(root.handlers[0])
    root.handlers = [logs]
    return logs


@dataclass
class HostedDevice:
    """A device the host drives: its entry and its opened agent."""

    entry: DeviceEntry
    opened: OpenedDevice


class DeviceHost:
    """Drives the agents of many devices in turn on one thread, each exactly as a process of its own would run it
    (Agent.start, then Agent.step, then Agent.finish). A device whose agent fails ends alone: its exit code goes to
    the exits file, one `DEVICE CODE` line each, where a bench reads which devices died."""

    def __init__(self, logs: DeviceLogs, exits: Path | None) -> None:
        self.logs = logs
        self.exits = exits
        self.live: list[HostedDevice] = []

    def add(self, entry: DeviceEntry) -> None:
        """Builds, connects and starts one device; a device that cannot start is reported, the others go on."""
        entry.log_file.parent.mkdir(parents=True, exist_ok=True)
        with self.logs.device(entry.log_file):
            try:
                opened = device_command.open_bench_device(device_parser().parse_args(entry.argv))
            except UsageError as error:
                self.ended(entry, 2, f"fl-bench: {error}")
                return
            device = HostedDevice(entry, opened)
            try:
                opened.session.connect()
                opened.agent.start()
            except BrokerUnavailableError as error:
                opened.close()
                self.ended(entry, 2, f"fl-bench: {error}")
                return
        self.live.append(device)

    def serve(self) -> None:
        """Steps every device with a message waiting, and every device once a SWEEP_SECONDS (resends, timeouts),
        until each has left; sleeps briefly when none had anything to do."""
        next_sweep = 0.0
        while self.live:
            now = time.monotonic()
            sweep = now >= next_sweep
            if sweep:
                next_sweep = now + SWEEP_SECONDS
            busy = False
            for device in list(self.live):
                waiting = device.opened.session.has_message()
                if waiting or sweep:
                    busy = busy or waiting
                    self.step(device)
            if not busy:
                time.sleep(IDLE_SECONDS)

    def step(self, device: HostedDevice) -> None:
        """One turn of one device's loop; it leaves when its run is over, and alone if its agent fails."""
        agent = device.opened.agent
        with self.logs.device(device.entry.log_file):
            try:
                done = agent.stop_event.is_set() or agent.step(timeout=0.0)
            except Exception:
                log.exception("agent failed device=%s", device.entry.device_id)
                self.leave(device)
                self.ended(device.entry, 1, "fl-bench: the agent failed (see the traceback above)")
                return
            if done:
                self.leave(device)

    def leave(self, device: HostedDevice) -> None:
        """Says the device is offline and closes its session."""
        self.live.remove(device)
        try:
            device.opened.agent.finish()
        finally:
            device.opened.close()

    def leave_all(self) -> None:
        """Every device still here leaves (a stop request, or the host failing)."""
        for device in list(self.live):
            with self.logs.device(device.entry.log_file):
                self.leave(device)

    def ended(self, entry: DeviceEntry, code: int, message: str) -> None:
        """Notes a device that ended with an error: in its log (as a process's stderr) and in the exits file."""
        self.logs.write(entry.log_file, message[:300])
        if self.exits is not None:
            with open(self.exits, "a", encoding="utf-8") as stream:
                stream.write(f"{entry.device_id} {code}\n")


def device_parser() -> argparse.ArgumentParser:
    """The parser of one hosted device's arguments: those of `fl-bench device`."""
    parser = argparse.ArgumentParser(prog="fl-bench device")
    device_command.add_arguments(parser)
    return parser
