# Relays end to end: 2 sites x 3 real agents behind 2 relay processes, a central coordinator, 3 real mosquittos.
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from fleet import kill, log_text, server_data, start_agent, start_coordinator, wait_exit, wait_until

from bench.simulate import BenchSettings, DeviceLaunch, write_shards
from coordinator.fleet.broker import EmbeddedBroker, free_loopback_port
from coordinator.fleet.provision import broker_config_lines, provision
from coordinator.storage.spool import Spool
from coordinator.storage.store import RunStore
from coordinator.strategies.aggregate import ClientUpdate
from coordinator.strategies.means import AveFL, FedAvg
from edge_agent.loop.outbox import OUTBOX_FOLDER
from protocol import messages, wire
from protocol.mqtt import BrokerAddress

pytestmark = pytest.mark.integration

CENTRAL = "central"
ROUNDS = 2
# Every weight is a float32 mean. Hierarchical FedAvg rounds each site's mean to float32 before the central mean
# (half an ulp, about 6e-8 relative), where flat FedAvg rounds once; both sums are exact (ExactSum), so the two
# differ by about one float32 ulp of the weight: 1e-6 absolute covers weights up to |8|.
TOLERANCE = 1e-6


def site_shards(directory: Path, pool_size: int, devices: slice) -> list[DeviceLaunch]:
    """Three of six devices' iid shards with no seed labels: two sites draw different devices, and their pool sizes
    make their sample counts differ (labels a round are a tenth of the pool)."""
    bench = BenchSettings(devices=6, partition="iid", pool_size=pool_size, seed_per_class=0)
    return write_shards(server_data(), bench, directory)[devices]


def start_relay(central: BrokerAddress, site: BrokerAddress, credentials: Path, run_dir: Path) -> subprocess.Popen:
    """`python -m coordinator relay` for one site (all 3 devices in the quorum), signed and logged in upstream with
    its central credential file, logging to RUN_DIR/relay.log."""
    run_dir.mkdir(parents=True, exist_ok=True)
    command = [
        *(sys.executable, "-m", "coordinator", "relay", "--upstream", central.url, "--credentials", str(credentials)),
        *("--site-fleet", f"site-{run_dir.name}", "--broker", site.url, "--run-dir", str(run_dir)),
        *("--quorum", "3", "--min-devices", "3", "--round-timeout", "120", "--keep-updates", "--no-bundles"),
        *("--log-level", "info"),
    ]
    with open(run_dir / "relay.log", "ab") as log_stream:
        return subprocess.Popen(command, stdout=log_stream, stderr=subprocess.STDOUT)


def spooled_updates(run_dir: Path, round_id: int) -> list[messages.Update]:
    """The updates a kept spool holds for one round."""
    with RunStore(run_dir) as store:
        return [wire.decode(payload, messages.Update) for _, payload in store.spool.items(round_id)]


def client_updates(updates: list[messages.Update]) -> list[ClientUpdate]:
    """The strategies' view of decoded float32 updates."""
    return [ClientUpdate(update.device_id, update.tensors, update.num_samples) for update in updates]


def acked(launch: DeviceLaunch, relay_dir: Path) -> bool:
    """The device's round-1 update is in the relay's spool and gone from the device's outbox (the ack settled it)."""
    spooled = launch.device_id in Spool(relay_dir / "spool").round_index(1)
    outbox = launch.state_dir / OUTBOX_FOLDER
    return spooled and outbox.is_dir() and not any(outbox.iterdir())


def test_relays_give_flat_fedavg_and_a_killed_relay_loses_no_acked_update(tmp_path: Path, processes) -> None:
    """Two sites of three agents behind two relays, provisioned as devices of a secured central fleet (broker logins,
    ACL, signed updates); relay A is SIGKILLed once its first device's round-1 update was acked, and restarted: both
    central rounds equal FedAvg over the six devices' spooled updates, and the acked update (sent once) is among
    them."""
    secure = provision(CENTRAL, 2, tmp_path / "central-secure", prefix="relay")
    credentials_a, credentials_b = (secure.device_credentials(relay) for relay in ("relay-00", "relay-01"))
    locked = broker_config_lines(secure)
    with (
        EmbeddedBroker(tmp_path / "central-broker", port=free_loopback_port(), extra_config=locked) as central,
        EmbeddedBroker(tmp_path / "site-a-broker", port=free_loopback_port()) as site_a,
        EmbeddedBroker(tmp_path / "site-b-broker", port=free_loopback_port()) as site_b,
    ):
        run_dir, relay_a, relay_b = tmp_path / "central", tmp_path / "a", tmp_path / "b"
        devices_a = site_shards(tmp_path / "shards-a", 20, slice(0, 3))
        devices_b = site_shards(tmp_path / "shards-b", 80, slice(3, 6))
        options = ("--strategy", "fedavg", "--rounds", str(ROUNDS), "--quorum", "2", "--min-devices", "2")
        options += ("--relay", "relay-00", "--relay", "relay-01")
        more = ("--label-fraction", "0.1", "--keep-updates", "--no-bundles", "--secure", str(secure.folder))
        processes.append(start_coordinator(central.address, run_dir, CENTRAL, *options, *more))
        processes.append(start_relay(central.address, site_b.address, credentials_b, relay_b))
        processes.extend(start_agent(launch, site_b.address, "site-b") for launch in devices_b)
        first_relay_a = start_relay(central.address, site_a.address, credentials_a, relay_a)
        processes.extend([first_relay_a, start_agent(devices_a[0], site_a.address, "site-a")])

        wait_until(lambda: acked(devices_a[0], relay_a), "site A's first device acked in round 1")
        kill(first_relay_a)
        processes.append(start_relay(central.address, site_a.address, credentials_a, relay_a))
        processes.extend(start_agent(launch, site_a.address, "site-a") for launch in devices_a[1:])
        survivors = [process for process in processes if process is not first_relay_a]
        assert [wait_exit(process, "fleet process") for process in survivors] == [0] * len(survivors)

        relay_logs = log_text(relay_a / "relay.log")
        assert relay_logs.count(f"resumed spooled update device={devices_a[0].device_id} round=1") == 1
        assert log_text(devices_a[0].log_file).count("update published device=dev-00 round=1 update=") == 1

        with RunStore(run_dir) as store:
            assert [(record.round_id, record.accepted) for record in store.rounds()] == [(1, 2), (2, 2)]
            assert store.rejection_counts() == {}
            models = {round_id: store.checkpoints.load(round_id) for round_id in range(ROUNDS + 1)}
        for round_id in range(1, ROUNDS + 1):
            devices = spooled_updates(relay_a, round_id) + spooled_updates(relay_b, round_id)
            assert sorted(update.device_id for update in devices) == [f"dev-{index:02d}" for index in range(6)]
            flat = FedAvg().aggregate(models[round_id - 1], client_updates(devices), None)[0]
            for name, array in flat.items():
                np.testing.assert_allclose(models[round_id][name], array, rtol=0, atol=TOLERANCE, err_msg=name)
            relays = spooled_updates(run_dir, round_id)
            assert all(relay.signature for relay in relays)
            assert {relay.device_id: sorted(relay.contributors) for relay in relays} == {
                "relay-00": ["dev-00", "dev-01", "dev-02"],
                "relay-01": ["dev-03", "dev-04", "dev-05"],
            }
            assert sum(relay.num_samples for relay in relays) == sum(update.num_samples for update in devices)
            unweighted = AveFL().aggregate(models[round_id - 1], client_updates(relays), None)[0]
            assert any(np.abs(unweighted[name] - flat[name]).max() > 100 * TOLERANCE for name in flat)
