# The embedded default broker: a private mosquitto on a free loopback port (or a given address), with persistence.
from __future__ import annotations

import ctypes
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from coordinator.fleet.provision import SecureFleet, broker_config_lines
from protocol.errors import UsageError
from protocol.mqtt import BrokerAddress

log = logging.getLogger(__name__)

PORT_FILE = "port"
TCP_LISTEN = "0A"  # /proc/net/tcp's state of a listening socket
# The largest MQTT packet the embedded broker takes (mosquitto's max_packet_size, which MQTT v5 clients learn from
# the CONNACK's Maximum Packet Size); larger messages travel in chunks (protocol.chunks).
DEFAULT_MAX_PACKET_BYTES = 1024 * 1024
PR_SET_PDEATHSIG = 1
LOOPBACK = "127.0.0.1"
# Where a process on the broker's own machine connects to a listener bound to every address.
LOCAL_CLIENT_HOSTS = {"0.0.0.0": LOOPBACK, "::": "::1"}


class BrokerError(UsageError):
    """The embedded broker could not be started (mosquitto missing, or it exited: its log says why); the user's
    setup, so the command shows it in one line."""


def free_loopback_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def mosquitto_config(
    port: int,
    work_dir: Path,
    extra_lines: tuple[str, ...] = (),
    max_packet_bytes: int | None = None,
    host: str = LOOPBACK,
) -> str:
    """A mosquitto.conf for one listener (loopback unless `host` says otherwise) with on-disk persistence (QoS 1
    survives a broker restart) and, if given, a packet size limit it announces to MQTT v5 clients
    (message_size_limit is not announced: a client over it is disconnected without having been told)."""
    lines = [
        f"listener {port} {host}",
        "allow_anonymous true",
        "persistence true",
        f"persistence_location {work_dir}/",
        "autosave_interval 1",
        "max_queued_messages 100000",
        f"log_dest file {work_dir / 'mosquitto.log'}",
        "log_type error",
        "log_type warning",
        "log_type notice",
    ]
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        # Started as root, mosquitto switches to the 'mosquitto' user, which cannot write work_dir: it then runs
        # without its log and, silently, without persistence. Stay the user that owns work_dir.
        lines.append("user root")
    if max_packet_bytes is not None:
        lines.append(f"max_packet_size {max_packet_bytes}")
    lines.extend(extra_lines)
    return "\n".join(lines) + "\n"


def port_is_free(port: int) -> bool:
    """Whether a listener can bind 127.0.0.1:port right now. Like mosquitto's, the probe sets SO_REUSEADDR: a closed
    connection of an earlier broker lingering in TIME_WAIT on the port (for a minute) does not keep a new one off it."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def previous_port(work_dir: Path) -> int | None:
    """The port an earlier broker of this work dir listened on, if it is free again (devices reconnect there)."""
    try:
        port = int((Path(work_dir) / PORT_FILE).read_text())
    # int() raises ValueError for a damaged port file: then no port is remembered
    except (OSError, ValueError):
        return None
    return port if 0 < port < 65536 and port_is_free(port) else None


def stop_with_parent() -> None:
    """Runs in the broker's child process before exec: on Linux, SIGTERM it when its parent dies, even by SIGKILL
    (mosquitto then saves its persistence and exits instead of lingering as an orphan on the port)."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def wait_for_port(host: str, port: int, timeout: float) -> bool:
    """Whether a TCP connect to host:port succeeds within `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((host, port), timeout=0.5):
                return True
        except OSError:
            time.sleep(0.05)
    return False


def listening_inodes(port: int) -> set[str]:
    """The socket inodes of the TCP listeners on `port` (any address, IPv4 and IPv6), from /proc/net."""
    inodes = set()
    for table in (Path("/proc/net/tcp"), Path("/proc/net/tcp6")):
        try:
            rows = table.read_text().splitlines()[1:]
        except OSError:  # no IPv6 table, or no /proc at all
            continue
        for row in rows:
            fields = row.split()
            if len(fields) > 9 and fields[3] == TCP_LISTEN and int(fields[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(fields[9])
    return inodes


def listener_owned(pid: int, port: int) -> bool | None:
    """Whether process `pid` holds a listener on `port`; None where /proc cannot tell (not Linux). A connect to the
    port alone cannot tell: another process (another test's broker) may have taken a free port first."""
    try:
        entries = list(Path(f"/proc/{pid}/fd").iterdir())
    except OSError:
        return None
    links = set()
    for entry in entries:
        try:
            links.add(os.readlink(entry))
        except OSError:  # a descriptor closed since the listing
            continue
    return any(f"socket:[{inode}]" in links for inode in listening_inodes(port))


class EmbeddedBroker:
    """Starts mosquitto in `work_dir` on a loopback port, or on `host` (0.0.0.0: every address, so devices on other
    machines reach it); a context manager that always stops it.

    Without an explicit port it reuses the port an earlier broker of the same work dir had (when free), so that a
    coordinator restarted on its run directory after a crash is found by its devices where they left it.
    `max_packet_bytes` is the largest packet it takes (None: no limit); clients learn it when they connect.
    """

    def __init__(
        self,
        work_dir: Path,
        port: int | None = None,
        extra_config: tuple[str, ...] = (),
        tls: bool = False,
        max_packet_bytes: int | None = DEFAULT_MAX_PACKET_BYTES,
        host: str = LOOPBACK,
    ) -> None:
        self.work_dir = Path(work_dir)
        self.port = port or previous_port(self.work_dir) or free_loopback_port()
        self.extra_config = extra_config
        self.tls = tls
        self.max_packet_bytes = max_packet_bytes
        self.host = host
        self._process: subprocess.Popen | None = None

    @property
    def address(self) -> BrokerAddress:
        """The broker's address for clients on this machine (the coordinator's own session)."""
        return BrokerAddress(host=LOCAL_CLIENT_HOSTS.get(self.host, self.host), port=self.port, tls=self.tls)

    @property
    def listening(self) -> BrokerAddress:
        """The address the broker listens on, as its URL names it (0.0.0.0: every address of this machine)."""
        return BrokerAddress(host=self.host, port=self.port, tls=self.tls)

    def start(self, timeout: float = 10.0) -> EmbeddedBroker:
        """Writes the config and launches mosquitto; raises BrokerError if it does not listen in time."""
        binary = shutil.which("mosquitto") or ("/usr/sbin/mosquitto" if Path("/usr/sbin/mosquitto").exists() else None)
        if binary is None:
            raise BrokerError("mosquitto is not installed: run `apt-get install mosquitto` (or `make install`)")
        self.work_dir.mkdir(parents=True, exist_ok=True)
        config_path = self.work_dir / "mosquitto.conf"
        config_path.write_text(
            mosquitto_config(self.port, self.work_dir, self.extra_config, self.max_packet_bytes, self.host)
        )
        self._process = subprocess.Popen(
            [binary, "-c", str(config_path)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            preexec_fn=stop_with_parent,
        )
        if not self._listening(self._process, timeout):
            self.stop()
            raise BrokerError(
                f"mosquitto did not start on {self.host} port {self.port} (in use, or not this machine's address?); "
                f"see {self.work_dir / 'mosquitto.log'}"
            )
        (self.work_dir / PORT_FILE).write_text(str(self.port))
        log.info("broker started url=%s pid=%s", self.address.url, self._process.pid)
        return self

    def _listening(self, process: subprocess.Popen, timeout: float) -> bool:
        """Whether this broker's own process listens on its port within `timeout` seconds: a connect that another
        process's listener answers (it took the port first) does not count."""
        deadline = time.monotonic() + timeout
        while wait_for_port(self.address.host, self.port, deadline - time.monotonic()):
            owned = listener_owned(process.pid, self.port)
            if owned or (owned is None and process.poll() is None):
                return True
            if process.poll() is not None:  # mosquitto exited: the port is someone else's
                return False
            time.sleep(0.05)
        return False

    def stop(self) -> None:
        """Terminates mosquitto (it saves its persistence file on a clean exit)."""
        if self._process is None:
            return
        if self._process.poll() is None:
            self._process.terminate()
            try:
                self._process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
        if self._process.stderr is not None:
            self._process.stderr.close()
        self._process = None

    def __enter__(self) -> EmbeddedBroker:
        return self.start()

    def __exit__(self, *exc_info) -> None:
        self.stop()


def embedded_packet_limit(configured: int | None) -> int:
    """The embedded broker's packet limit: the run's --max-message-bytes, else DEFAULT_MAX_PACKET_BYTES."""
    return configured or DEFAULT_MAX_PACKET_BYTES


def embedded_broker(
    work_dir: Path,
    secure: SecureFleet | None = None,
    max_packet_bytes: int | None = DEFAULT_MAX_PACKET_BYTES,
    listen: tuple[str, int] | None = None,
) -> EmbeddedBroker:
    """The embedded broker, locked to a provisioned fleet's passwords, ACL (and TLS) when `secure` is given; on
    `listen` (host, port) when given, else a loopback port."""
    host, port = listen or (LOOPBACK, None)
    extra, tls = (broker_config_lines(secure), secure.tls) if secure is not None else ((), False)
    return EmbeddedBroker(work_dir, port, extra, tls, max_packet_bytes, host)
