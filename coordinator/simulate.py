# Bench runs: N real agent processes (own MQTT clients, own data shards) against a real broker and coordinator.
from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from coordinator.broker import embedded_broker, embedded_packet_limit
from coordinator.observer import RoundObserver, RoundResult
from coordinator.partition import partition_indices
from coordinator.provision import SecureFleet, device_names, load_secure_fleet, provision
from coordinator.server import ServerData, ServerSettings, load_server_data, run_server
from edge_agent.mqtt import BrokerAddress
from edge_agent.shard import Shard, save_shard

log = logging.getLogger(__name__)

AGENT_EXIT_SECONDS = 60.0


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


def agent_command(launch: DeviceLaunch, address: BrokerAddress, fleet: str, bench: BenchSettings) -> list[str]:
    """The exact command a field device would run, pointed at a simulated shard."""
    profile = [] if bench.agent_profile is None else ["--profile", str(bench.agent_profile)]
    return [
        sys.executable,
        "-m",
        "edge_agent",
        "run",
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
    ] + (["--credentials", str(launch.credentials)] if launch.credentials else [])


def spawn_agent(launch: DeviceLaunch, address: BrokerAddress, fleet: str, bench: BenchSettings) -> subprocess.Popen:
    """Starts one agent process with its own log file and its BLAS threads (2 cores shared by many agents)."""
    threads = str(bench.agent_threads)
    environment = {**os.environ, "OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads}
    launch.log_file.parent.mkdir(parents=True, exist_ok=True)
    with open(launch.log_file, "ab") as log_stream:
        return subprocess.Popen(
            agent_command(launch, address, fleet, bench), stdout=log_stream, stderr=subprocess.STDOUT, env=environment
        )


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


class AgentWatch:
    """Notices bench agents that died during the run: logs each once with its log file, and tells the coordinator
    (which asks on every loop) so that rounds go on with the living instead of waiting for the deadline."""

    def __init__(self, launches: list[DeviceLaunch], processes: list[subprocess.Popen]) -> None:
        self.launches = launches
        self.processes = processes
        self.dead: set[str] = set()

    def __call__(self) -> set[str]:
        for launch, process in zip(self.launches, self.processes):
            if launch.device_id not in self.dead and process.poll() not in (None, 0):
                log.error(
                    "agent died device=%s exit=%s log=%s; the run goes on with the others",
                    launch.device_id,
                    process.returncode,
                    launch.log_file,
                )
                self.dead.add(launch.device_id)
        return set(self.dead)


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


def simulate(
    settings: ServerSettings,
    bench: BenchSettings,
    on_round: Callable[[RoundResult], None],
    address: BrokerAddress | None = None,
    observer: RoundObserver | None = None,
) -> None:
    """Runs the whole bench: shards, broker, N agent processes and the coordinator, and cleans up after.

    Secured (bench.secure), a given broker must already use the fleet provisioned in settings.secure_dir.
    """
    secure = None
    if bench.secure:
        secure = secure_bench(settings, bench)
        settings = dataclasses.replace(settings, secure_dir=secure.folder)
    data = load_server_data(settings)
    launches = [
        dataclasses.replace(launch, credentials=secure.device_credentials(launch.device_id) if secure else None)
        for launch in write_shards(data, bench, settings.run_dir)
    ]
    with broker_for(settings.run_dir, address, secure, settings.broker_max_packet_bytes) as broker_address:
        processes = [spawn_agent(launch, broker_address, settings.fleet, bench) for launch in launches]
        try:
            run_server(
                settings,
                broker_address,
                on_round,
                data=data,
                wait_for_devices=bench.devices,
                observer=observer,
                dead_devices=AgentWatch(launches, processes),
            )
        except BaseException:
            stop_agents(processes, timeout=0.0)
            raise
        stop_agents(processes, AGENT_EXIT_SECONDS)
    failed = [launch.device_id for launch, process in zip(launches, processes) if process.returncode not in (0, -15)]
    if failed:
        log.warning("agents exited with errors devices=%s (see their agent.log)", failed)
