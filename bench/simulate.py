# Bench runs: N real agents (own MQTT clients, own data shards; hosted by a few worker processes, or one process
# each) against a real broker and coordinator.
from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from bench.partition import partition_indices
from bench.shard import Shard, save_shard
from coordinator.fleet.broker import embedded_broker, embedded_packet_limit
from coordinator.fleet.provision import SecureFleet, device_names, load_secure_fleet, provision
from coordinator.intake.observer import RoundObserver, RoundResult
from coordinator.server import run_server
from coordinator.setup.server_data import ServerData, load_server_data
from coordinator.setup.settings import ServerSettings
from protocol.errors import UsageError
from protocol.mqtt import BrokerAddress

log = logging.getLogger(__name__)

AGENT_EXIT_SECONDS = 60.0
WATCH_SECONDS = 0.25
DEVICE_WAIT_SECONDS = 60.0
DEVICE_WAIT_SECONDS_EACH = 0.2
# paho's network loop waits in select(), which takes no file descriptor above 1023, and a session holds three (its
# socket and a wake-up socket pair) beside the device's open files: a worker hosts at most this many devices.
DEVICES_PER_WORKER = 200


@dataclass(frozen=True)
class BenchSettings:
    """The simulated fleet: how many devices, how their data is split, how big each pool is."""

    devices: int = 4
    partition: str = "type1"
    pool_size: int = 4000
    agent_threads: int = 1
    seed: int = 0
    seed_per_class: int = 5
    agent_profile: Path | None = None
    secure: bool = False
    tls: bool = False
    process_per_device: bool = False
    workers: int | None = None
    slow_fraction: float = 0.0
    slow_factor: float = 1.0

    def __post_init__(self) -> None:
        if not 0.0 <= self.slow_fraction <= 1.0:
            raise UsageError(f"--slow-fraction must lie in [0, 1], got {self.slow_fraction}")
        if not 1.0 <= self.slow_factor <= 1000.0:
            raise UsageError(f"--slow-factor must lie in [1, 1000], got {self.slow_factor}")

    @property
    def device_wait_seconds(self) -> float:
        """How long the coordinator waits for every device to come online (a thousand take a while to start)."""
        return DEVICE_WAIT_SECONDS + DEVICE_WAIT_SECONDS_EACH * self.devices

    @property
    def worker_count(self) -> int:
        """Worker processes hosting the virtual devices: as asked, else one per core, and at least enough that none
        hosts more than DEVICES_PER_WORKER; never more than devices."""
        needed = -(-self.devices // DEVICES_PER_WORKER)
        return max(1, min(self.devices, max(self.workers or os.cpu_count() or 1, needed)))


def slow_devices(bench: BenchSettings) -> set[str]:
    """The bench's slow devices: a seeded round(slow_fraction * devices) of them (none at a factor of 1)."""
    count = round(bench.slow_fraction * bench.devices) if bench.slow_factor > 1.0 else 0
    rng = np.random.default_rng([bench.seed, bench.devices])
    return set(rng.choice(device_names(bench.devices), size=count, replace=False).tolist())


@dataclass(frozen=True)
class DeviceLaunch:
    """Where one simulated device's shard, state and log live."""

    device_id: str
    shard: Path
    state_dir: Path
    log_file: Path
    credentials: Path | None = None


def seed_indices(labels: np.ndarray, init_indices: np.ndarray, per_class: int) -> np.ndarray:
    """The first `per_class` of each class among the server's W0 samples: every device's labelled seed set."""
    init_labels = labels[init_indices]
    return (
        np.concatenate([init_indices[init_labels == c][:per_class] for c in np.unique(init_labels)])
        if per_class and len(init_indices)
        else np.zeros(0, dtype=np.int64)
    )


def write_shards(data: ServerData, bench: BenchSettings, run_dir: Path) -> list[DeviceLaunch]:
    """Partitions the devices' share of the training set and writes one pool shard (plus the seeds) per device."""
    rng = np.random.default_rng(bench.seed)
    images, labels = data.dataset.train_images, data.dataset.train_labels
    parts = partition_indices(labels, bench.partition, bench.devices, rng, indices=data.device_indices)
    seeds = seed_indices(labels, data.init_indices, bench.seed_per_class)
    launches = []
    for device_id, part in zip(device_names(bench.devices), parts):
        pool = rng.permutation(part)[: bench.pool_size]
        device_dir = run_dir / "devices" / device_id
        shard = device_dir / "shard.npz"
        if not shard.exists():
            save_shard(shard, Shard(images[pool], labels[pool], images[seeds], labels[seeds]))
        launches.append(DeviceLaunch(device_id, shard, device_dir / "state", device_dir / "agent.log"))
    return launches


def agent_arguments(launch: DeviceLaunch, address: BrokerAddress, fleet: str, bench: BenchSettings) -> list[str]:
    """The `fl-bench device` arguments: those of a field device's `edge-agent run`, with a simulated shard."""
    profile = [] if bench.agent_profile is None else ["--profile", str(bench.agent_profile)]
    slow = ["--slowdown", str(bench.slow_factor)] if launch.device_id in slow_devices(bench) else []
    return [
        "--broker",
        address.url,
        "--fleet",
        fleet,
        "--device-id",
        launch.device_id,
        "--data",
        str(launch.shard),
        "--state-dir",
        str(launch.state_dir),
        "--torch-threads",
        str(bench.agent_threads),
        "--exit-on-final",
        *profile,
        *slow,
    ] + (["--credentials", str(launch.credentials)] if launch.credentials else [])


def agent_command(launch: DeviceLaunch, address: BrokerAddress, fleet: str, bench: BenchSettings) -> list[str]:
    """The bench device's own process: `fl-bench device` over its simulated shard."""
    return [sys.executable, "-m", "bench", "device", *agent_arguments(launch, address, fleet, bench)]


@dataclass(frozen=True)
class AgentHost:
    """A process hosting bench devices: one device (process-per-device), or a worker of many virtual devices that
    notes each device failing on its own in `exits` (`DEVICE CODE` lines)."""

    process: subprocess.Popen
    launches: list[DeviceLaunch]
    exits: Path | None = None


def start_process(command: list[str], log_file: Path, bench: BenchSettings) -> subprocess.Popen:
    """Starts one bench process with its own log file and its BLAS threads (2 cores shared by many agents)."""
    threads = str(bench.agent_threads)
    environment = {**os.environ, "OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads}
    log_file.parent.mkdir(parents=True, exist_ok=True)
    with open(log_file, "ab") as log_stream:
        return subprocess.Popen(command, stdout=log_stream, stderr=subprocess.STDOUT, env=environment)


def spawn_agent(launch: DeviceLaunch, address: BrokerAddress, fleet: str, bench: BenchSettings) -> AgentHost:
    """One agent process of its own for one device (`--process-per-device`)."""
    return AgentHost(start_process(agent_command(launch, address, fleet, bench), launch.log_file, bench), [launch])


def spawn_worker(
    number: int, launches: list[DeviceLaunch], address: BrokerAddress, fleet: str, bench: BenchSettings, folder: Path
) -> AgentHost:
    """One `fl-bench host` worker for `launches`: each device with the arguments and log file of its own process."""
    folder.mkdir(parents=True, exist_ok=True)
    devices_file, exits = folder / f"worker-{number:02d}.json", folder / f"worker-{number:02d}.exits"
    exits.unlink(missing_ok=True)
    listed = [
        {
            "device_id": launch.device_id,
            "log_file": str(launch.log_file),
            "argv": agent_arguments(launch, address, fleet, bench),
        }
        for launch in launches
    ]
    devices_file.write_text(json.dumps({"devices": listed}))
    command = [sys.executable, "-m", "bench", "host", "--devices", str(devices_file), "--exits", str(exits)]
    return AgentHost(start_process(command, folder / f"worker-{number:02d}.log", bench), launches, exits)


def spawn_hosts(
    launches: list[DeviceLaunch], address: BrokerAddress, fleet: str, bench: BenchSettings, run_dir: Path
) -> list[AgentHost]:
    """The bench's agent processes: one per device, or bench.worker_count workers sharing the devices evenly."""
    if bench.process_per_device:
        return [spawn_agent(launch, address, fleet, bench) for launch in launches]
    count = bench.worker_count
    return [
        spawn_worker(number, launches[number::count], address, fleet, bench, run_dir / "workers")
        for number in range(count)
    ]


def stop_agents(processes: list[subprocess.Popen], timeout: float) -> None:
    """Waits for agents to leave after the final announcement, then terminates any that linger."""
    deadline = time.monotonic() + timeout
    for process in processes:
        try:
            process.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.terminate()
    for process in processes:
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def exit_codes(host: AgentHost) -> dict[str, int]:
    """Each bench device that has ended with an error, and its exit code: its own process's, or its worker's (then
    every device of the worker's), or the one its worker noted for it alone."""
    code = host.process.poll()
    if code not in (None, 0):
        return {launch.device_id: int(code) for launch in host.launches}
    if host.exits is None or not host.exits.exists():
        return {}
    noted = (line.split() for line in host.exits.read_text().splitlines())
    return {fields[0]: int(fields[1]) for fields in noted if len(fields) == 2 and fields[1].lstrip("-").isdigit()}


class AgentWatch:
    """Notices bench agents that died during the run (a device's own process, a whole worker, or one device in a
    worker): logs each once with its log file, and tells the coordinator (which asks on every loop) so that rounds
    go on with the living instead of waiting for the deadline. Looks at most once a WATCH_SECONDS."""

    def __init__(self, hosts: list[AgentHost]) -> None:
        self.hosts = hosts
        self.log_files = {launch.device_id: launch.log_file for host in hosts for launch in host.launches}
        self.dead: set[str] = set()
        self._next_look = 0.0

    def __call__(self) -> set[str]:
        now = time.monotonic()
        if now >= self._next_look:
            self._next_look = now + WATCH_SECONDS
            for host in self.hosts:
                self.note(exit_codes(host))
        return set(self.dead)

    def note(self, codes: dict[str, int]) -> None:
        """Logs and remembers the devices newly found dead."""
        for device_id, code in codes.items():
            if device_id not in self.dead:
                log.error(
                    "agent died device=%s exit=%s log=%s; the run goes on with the others",
                    device_id,
                    code,
                    self.log_files.get(device_id),
                )
                self.dead.add(device_id)


@contextlib.contextmanager
def broker_for(
    run_dir: Path,
    address: BrokerAddress | None,
    secure: SecureFleet | None = None,
    max_packet_bytes: int | None = None,
) -> Iterator[BrokerAddress]:
    """The given broker, or an embedded mosquitto (locked to `secure`'s fleet if given, taking packets of at most
    `max_packet_bytes`, default DEFAULT_MAX_PACKET_BYTES) for the run's duration."""
    if address is not None:
        yield address
        return
    with embedded_broker(run_dir / "broker", secure, embedded_packet_limit(max_packet_bytes)) as broker:
        yield broker.address


def secure_bench(settings: ServerSettings, bench: BenchSettings) -> SecureFleet:
    """The bench's provisioned fleet in run_dir/secure: made on the first run, reused when the run resumes."""
    folder = settings.secure_dir or settings.run_dir / "secure"
    if not (folder / "keys.json").exists():
        provision(settings.fleet, bench.devices, folder, tls=bench.tls)
    return load_secure_fleet(folder)


def with_credentials(launches: list[DeviceLaunch], secure: SecureFleet | None) -> list[DeviceLaunch]:
    """The launches with each device's credential file from a secured bench's fleet (as they are otherwise)."""
    if secure is None:
        return launches
    return [dataclasses.replace(launch, credentials=secure.device_credentials(launch.device_id)) for launch in launches]


def simulate(
    settings: ServerSettings,
    bench: BenchSettings,
    on_round: Callable[[RoundResult], None],
    address: BrokerAddress | None = None,
    observer: RoundObserver | None = None,
) -> None:
    """Runs the whole bench: shards, broker, the agents' processes and the coordinator, and cleans up after.

    Secured (bench.secure), a given broker must already use the fleet provisioned in settings.secure_dir.
    """
    secure = None
    if bench.secure:
        secure = secure_bench(settings, bench)
        settings = dataclasses.replace(settings, secure_dir=secure.folder)
    data = load_server_data(settings)
    settings = dataclasses.replace(settings, seed_labels=bench.seed_per_class * settings.spec.num_classes)
    launches = with_credentials(write_shards(data, bench, settings.run_dir), secure)
    with broker_for(settings.run_dir, address, secure, settings.broker_max_packet_bytes) as broker_address:
        hosts = spawn_hosts(launches, broker_address, settings.fleet, bench, settings.run_dir)
        processes = [host.process for host in hosts]
        try:
            run_server(
                settings,
                broker_address,
                on_round,
                data=data,
                wait_for_devices=bench.devices,
                device_wait_timeout=bench.device_wait_seconds,
                observer=observer,
                dead_devices=AgentWatch(hosts),
            )
        except BaseException:
            stop_agents(processes, timeout=0.0)
            raise
        stop_agents(processes, AGENT_EXIT_SECONDS)
    failed = sorted(device for host in hosts for device, code in exit_codes(host).items() if code != -15)
    if failed:
        log.warning("agents exited with errors devices=%s (see their agent.log)", failed)
