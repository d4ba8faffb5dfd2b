# Private runs over a real mosquitto: the budget stop, the spent epsilon across a restart, device-noised spools.
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from coordinator.dashboard.report import write_report
from coordinator.dashboard.views import load_snapshot, run_view
from coordinator.storage.spool import Spool
from coordinator.storage.store import RunStore
from edge_agent.loop.serving import STATE_FILE
from protocol import messages, wire
from protocol.dp import DpRound, clip_delta, delta_of, l2_norm
from protocol.dp_accountant import SampledGaussian, epsilon_of
from tests.fleet import (
    committed_rounds,
    fleet_shards,
    kill,
    log_text,
    start_agent,
    start_coordinator,
    wait_exit,
    wait_until,
)

pytestmark = pytest.mark.integration

NOISE = 2.0
DEVICES = ("--quorum", "2", "--min-devices", "2", "--wait-devices", "2")


def spent(rounds: int) -> float:
    """The epsilon of `rounds` rounds of every device (q = 1) at noise multiplier NOISE, delta 1e-5."""
    return epsilon_of([SampledGaussian(1.0, NOISE)] * rounds, 1e-5)


def run_fleet(broker, run_dir: Path, fleet: str, processes: list, *options: str) -> None:
    """A coordinator and 2 agents on `fleet` (the agents' state kept under run_dir), all run until they exit 0."""
    coordinator = start_coordinator(broker.address, run_dir, fleet, *DEVICES, *options)
    agents = [start_agent(launch, broker.address, fleet) for launch in fleet_shards(run_dir, devices=2)]
    processes.extend([coordinator, *agents])
    assert [wait_exit(process, "fleet process") for process in [coordinator, *agents]] == [0, 0, 0]


def test_the_budget_stops_the_run_before_the_round_that_would_cross_it_and_survives_a_restart(
    tmp_path: Path, broker, processes
) -> None:
    """A central run with a budget between the epsilon of 3 and 4 rounds, its coordinator SIGKILLed once 2 rounds
    are committed: the restarted coordinator rebuilds the spent epsilon from the store, commits round 3 (its
    epsilon composed with the 2 committed rounds) and exits 0 with a clear line before round 4."""
    run_dir = tmp_path / "run"
    options = (
        *("--rounds", "6", "--dp", "central", "--dp-clip", "0.001", "--dp-noise-multiplier", str(NOISE)),
        *("--dp-epsilon-budget", str((spent(3) + spent(4)) / 2), *DEVICES),
    )
    coordinator = start_coordinator(broker.address, run_dir, "budget", *options)
    launches = fleet_shards(run_dir, devices=2)
    agents = [start_agent(launch, broker.address, "budget") for launch in launches]
    processes.extend([coordinator, *agents])
    wait_until(lambda: len(committed_rounds(run_dir)) >= 2, "two committed rounds")
    kill(coordinator)
    assert committed_rounds(run_dir)[:2] == [(1, 2), (2, 2)]
    restarted = start_coordinator(broker.address, run_dir, "budget", *options)
    processes.append(restarted)
    assert [wait_exit(process, "fleet process") for process in [restarted, *agents]] == [0, 0, 0]

    assert committed_rounds(run_dir) == [(1, 2), (2, 2), (3, 2)]
    assert log_text(run_dir / "coordinator.log").count("privacy budget reached: stopping before round 4,") == 1
    with RunStore(run_dir, read_only=True) as store:
        epsilons = [record.report["dp"]["epsilon"] for record in store.rounds()]
        gated = [(event.round_id, event.who) for event in store.serving.events()]
        served = {0, *(event.serving for event in store.serving.events())}
    assert gated == [(1, "gate"), (2, "gate"), (3, "gate")]  # each noised aggregate judged once, across the restart
    for launch in launches:  # each agent followed the serving version beside its rounds
        assert json.loads((launch.state_dir / "serving" / STATE_FILE).read_text())["version"] in served
    assert epsilons == pytest.approx([spent(1), spent(2), spent(3)], rel=1e-9)
    privacy = run_view(load_snapshot(run_dir), None)["privacy"]
    assert privacy["epsilon"] == epsilons[-1] and privacy["summary"].startswith(f"central: epsilon {spent(3):.3g}")
    assert f"<td>{spent(3):.4f}</td>" in write_report(run_dir).read_text()  # the report's accountant table


def spooled_updates(run_dir: Path) -> dict[str, messages.Update]:
    """Round 1's accepted updates as the coordinator's spool keeps them (--keep-updates)."""
    return {
        device: wire.decode(payload, messages.Update)
        for device, payload in Spool(run_dir / "spool").payloads(1).items()
    }


def test_device_placement_never_leaves_an_unnoised_delta_in_the_spool(tmp_path: Path, broker, processes) -> None:
    """The same two devices train the same round twice, once plainly and once under --dp device: the private spool
    holds each plain delta clipped to the clip plus noise of the device's share of std z * C / sqrt(2), never the
    plain or the clipped delta itself."""
    clip, noise = 0.01, 0.5
    keep = ("--rounds", "1", "--keep-updates")
    run_fleet(broker, tmp_path / "plain", "plain", processes, *keep)
    run_fleet(
        broker,
        tmp_path / "private",
        "private",
        processes,
        *keep,
        "--dp",
        "device",
        "--dp-clip",
        str(clip),
        "--dp-noise-multiplier",
        str(noise),
    )
    with RunStore(tmp_path / "plain", read_only=True) as store:
        base = store.checkpoints.load(0)
    plain, private = spooled_updates(tmp_path / "plain"), spooled_updates(tmp_path / "private")
    assert sorted(plain) == sorted(private) and len(plain) == 2
    share = DpRound(clip, noise, 0.0, 2).sum_std / math.sqrt(2)
    for device, update in private.items():
        plain_delta = delta_of(plain[device].tensors, base)
        clipped, norm = clip_delta(plain_delta, clip)
        assert norm > 3 * clip  # the plain delta was well beyond the clip
        residual = np.concatenate([(delta_of(update.tensors, base)[n] - clipped[n]).ravel() for n in clipped])
        assert np.std(residual) == pytest.approx(share, rel=0.05)  # the noise, and nothing else, was added
        for name, array in update.tensors.items():
            assert not np.allclose(array, plain[device].tensors[name], atol=share / 10)
        assert l2_norm(delta_of(update.tensors, base)) > clip  # what was sent is noised, not just clipped
        assert "dp_within_clip" in update.metrics
