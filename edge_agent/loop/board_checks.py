# What `edge-agent doctor` checks on a board before the agent starts: each check is a function giving one Verdict.
from __future__ import annotations

import importlib.metadata
import os
import platform
import signal
import ssl
import struct
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import paho.mqtt.client as paho

from protocol.mqtt import BrokerAddress

MIN_PYTHON = (3, 11)
CLOCK_FLOOR = 1767225600.0
"""2026-01-01 00:00 UTC, before this release: a clock before it is surely wrong, and TLS checks certificates' dates."""
PROBE_SECONDS = 300.0
BROKER_SECONDS = 10.0
RUNTIME_FIX = "pip install --upgrade 'onnxruntime>=1.17,!=1.21.0'"
LOGIN_HINT = " (check the login and password of --credentials, or the broker's password file)"
SIXTY_FOUR_BIT = "install the 64-bit OS (Raspberry Pi OS 64-bit, arm64): onnxruntime publishes no 32-bit ARM wheel"


@dataclass(frozen=True)
class Verdict:
    """One check's outcome: its name, whether the board passes it, and one line saying what was found."""

    name: str
    ok: bool
    line: str

    def __str__(self) -> str:
        return f"{'ok  ' if self.ok else 'FAIL'} {self.name}: {self.line}"


def python_check(version: tuple[int, ...], machine: str, pointer_bits: int) -> Verdict:
    """The interpreter: at least Python 3.11, on a 64-bit OS (a 32-bit one has no onnxruntime wheel)."""
    found = f"Python {'.'.join(map(str, version[:3]))} on {machine} ({pointer_bits}-bit)"
    if pointer_bits != 64 or machine in ("armv6l", "armv7l", "armv8l", "i386", "i686"):
        return Verdict("python", False, f"{found}: a 32-bit OS; {SIXTY_FOUR_BIT}")
    if tuple(version[:2]) < MIN_PYTHON:
        return Verdict("python", False, f"{found}: the agent needs Python {'.'.join(map(str, MIN_PYTHON))} or later")
    return Verdict("python", True, found)


def this_python() -> Verdict:
    """python_check of the running interpreter."""
    return python_check(
        (sys.version_info.major, sys.version_info.minor, sys.version_info.micro),
        platform.machine(),
        struct.calcsize("P") * 8,
    )


def installed_version(package: str) -> str | None:
    """A distribution's installed version, read from its metadata (the package itself is not imported)."""
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def runtime_check(timeout: float = PROBE_SECONDS) -> Verdict:
    """onnxruntime imported and one inference run in a child process (edge_agent.learning.ort_probe), so that an
    illegal instruction kills the child, not the doctor: its signal becomes one line naming the version and the fix."""
    version = installed_version("onnxruntime")
    if version is None:
        return Verdict("onnxruntime", False, "not installed: pip install 'edge-fal[agent]'")
    try:
        child = subprocess.run(
            [sys.executable, "-m", "edge_agent.learning.ort_probe"], capture_output=True, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired:
        return Verdict("onnxruntime", False, f"onnxruntime {version}: one tiny inference took over {timeout:.0f}s")
    if child.returncode < 0:
        name = signal.Signals(-child.returncode).name
        cause = " (an instruction this CPU lacks)" if name == "SIGILL" else ""
        return Verdict("onnxruntime", False, f"onnxruntime {version} died with {name}{cause}: {RUNTIME_FIX}")
    said = (child.stdout.strip() or child.stderr.strip()).splitlines()
    last = said[-1][:200] if said else f"exit {child.returncode}"
    return Verdict("onnxruntime", child.returncode == 0, last)


def available_mb(meminfo: str) -> float | None:
    """MemAvailable of a /proc/meminfo text, in MB (None where the kernel does not report it)."""
    for line in meminfo.splitlines():
        if line.startswith("MemAvailable:"):
            return float(line.split()[1]) / 1024
    return None


def memory_check(budget_mb: int | None, meminfo: str) -> Verdict:
    """The profile's memory budget against the memory the board has available now (MemAvailable)."""
    free = available_mb(meminfo)
    if free is None:
        return Verdict("memory", False, "the kernel reports no MemAvailable in /proc/meminfo")
    if budget_mb is None:
        return Verdict("memory", True, f"{free:.0f} MB available (no --profile: no budget to check)")
    if free < budget_mb:
        return Verdict(
            "memory",
            False,
            f"the profile's budget is {budget_mb} MB but only {free:.0f} MB is available: stop other services "
            "or use a smaller profile",
        )
    return Verdict("memory", True, f"{free:.0f} MB available for the profile's {budget_mb} MB budget")


def this_board_memory(budget_mb: int | None) -> Verdict:
    """memory_check against this machine's /proc/meminfo."""
    try:
        meminfo = Path("/proc/meminfo").read_text()
    except OSError as error:
        return Verdict("memory", False, f"/proc/meminfo is unreadable ({error.strerror})")
    return memory_check(budget_mb, meminfo)


def state_check(folder: Path) -> Verdict:
    """The state folder exists (or can be made) and takes a file written, synced and removed."""
    probe = folder / f".doctor-{os.getpid()}"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with open(probe, "wb") as stream:
            stream.write(b"ok")
            os.fsync(stream.fileno())
        probe.unlink()
    except OSError as error:
        return Verdict(
            "state", False, f"{folder} is not writable ({error.strerror}): labels and progress persist there"
        )
    return Verdict("state", True, f"{folder} is writable")


def clock_check(now: float) -> Verdict:
    """The clock is not before this release (a board without a real-time clock that has not synced yet), which
    would make every TLS certificate look not yet valid."""
    shown = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(now))
    if now < CLOCK_FLOOR:
        return Verdict(
            "clock",
            False,
            f"the clock says {shown}, before {time.strftime('%Y-%m-%d', time.gmtime(CLOCK_FLOOR))}: sync it (timedatectl set-ntp true); TLS needs the date",
        )
    return Verdict("clock", True, shown)


def broker_check(address: BrokerAddress, timeout: float = BROKER_SECONDS) -> Verdict:
    """One MQTT v5 connection with the address's login and TLS files: reachable, TLS accepted, login accepted."""
    answered = threading.Event()
    reasons: list[str] = []

    def on_connect(client, userdata, flags, reason_code, properties) -> None:
        hint = LOGIN_HINT if reason_code.value in (0x86, 0x87) else ""
        reasons.append("" if not reason_code.is_failure else f"{reason_code}{hint}")
        answered.set()

    client = paho.Client(callback_api_version=paho.CallbackAPIVersion.VERSION2, protocol=paho.MQTTv5)
    client.on_connect = on_connect
    login = f" as {address.username!r}" if address.username is not None else ""
    if address.username is not None:
        client.username_pw_set(address.username, address.password)
    if address.tls:
        files = f"ca {address.ca_file}, cert {address.cert_file}, key {address.key_file}"
        try:
            client.tls_set(ca_certs=address.ca_file, certfile=address.cert_file, keyfile=address.key_file)
        except (OSError, ssl.SSLError, ValueError) as error:
            return Verdict("broker", False, f"the TLS files ({files}) cannot be used: {error}")
    try:
        client.connect(address.host, address.port, keepalive=30)
    except (OSError, ssl.SSLError, ValueError) as error:
        return Verdict("broker", False, f"{address.url} cannot be reached{login}: {error}")
    client.loop_start()
    try:
        if not answered.wait(timeout):
            return Verdict("broker", False, f"{address.url} did not answer the connection within {timeout:.0f}s")
    finally:
        client.disconnect()
        client.loop_stop()
    if reasons[0]:
        return Verdict("broker", False, f"{address.url} refused the connection{login}: {reasons[0]}")
    return Verdict("broker", True, f"{address.url} accepted the connection{login}")
