# Secure aggregation with real processes (mosquitto, `python -m coordinator run`, `python -m bench device`): a secure
# round of four devices, and a coordinator SIGKILLed after masked inputs arrived that a restart finishes exactly.
from __future__ import annotations

from pathlib import Path

import pytest
from fleet import LABELS, committed_rounds, fleet_shards, kill, start_agent, start_coordinator, wait_exit, wait_until

from coordinator.secure.secagg_round import ServerSecAggState
from coordinator.storage.store import RunStore
from protocol import wire
from protocol.tensors import weights_hash

pytestmark = pytest.mark.integration

SECURE = (
    "--secure-aggregation",
    "secagg",
    "--secagg-open-fleet-unsafe",
    "--strategy",
    "fedavg",
    "--rounds",
    "1",
    "--quorum",
    "4",
)
OPTIONS = (*SECURE, "--min-devices", "4", "--round-timeout", "60")


def secure_state(run_dir: Path) -> ServerSecAggState | None:
    """The coordinator's saved secure round 1, as a restarted process reads it (None before it is saved)."""
    path = run_dir / "spool" / "secagg-1.rec"
    return wire.decode_record(path.read_bytes(), ServerSecAggState) if path.exists() else None


def masked_in(run_dir: Path) -> bool:
    """Whether a masked input reached the coordinator's saved round (and the round is not committed yet)."""
    state = secure_state(run_dir)
    return state is not None and bool(state.masked_from) and committed_rounds(run_dir) == []


def round_one(run_dir: Path) -> tuple[str, dict]:
    """The hash of the model round 1 committed, and its record's metrics."""
    with RunStore(run_dir) as store:
        return weights_hash(store.checkpoints.load(1)), store.rounds()[0].metrics


def test_a_coordinator_killed_after_masked_inputs_commits_what_an_uninterrupted_secure_run_does(
    tmp_path: Path, broker, module_broker, processes
) -> None:
    """Four real devices in a secure round, twice, each fleet on its own broker (their device ids are the same):
    uninterrupted, and with the coordinator SIGKILLed once a masked input is saved; the restarted coordinator
    resumes the saved stage and commits the same model bit for bit (the unmasked sum is exact integer arithmetic,
    and the devices are deterministic per device and round), every device a survivor, their new labels counted."""
    reference, resumed = tmp_path / "reference", tmp_path / "resumed"
    brokers = {reference: module_broker.address, resumed: broker.address}
    coordinators = {
        run_dir: start_coordinator(address, run_dir, "secure", *OPTIONS) for run_dir, address in brokers.items()
    }
    agents = [
        start_agent(launch, address, "secure")
        for run_dir, address in brokers.items()
        for launch in fleet_shards(run_dir, 4)
    ]
    processes.extend([*coordinators.values(), *agents])
    wait_until(lambda: masked_in(resumed), "a masked input saved by the coordinator")
    kill(coordinators[resumed])
    killed = secure_state(resumed)
    assert killed is not None
    restarted = start_coordinator(broker.address, resumed, "secure", *OPTIONS)
    processes.append(restarted)
    survivors = [coordinators[reference], restarted, *agents]
    assert [wait_exit(process, "fleet process") for process in survivors] == [0] * len(survivors)

    (expected, reference_metrics), (model, metrics) = round_one(reference), round_one(resumed)
    for record in (reference_metrics, metrics):
        assert record["secure_aggregation"] == "committed" and record["secagg_survivors"] == 4
        assert record["secagg_labels"] == 4 * LABELS
    assert model == expected, f"killed in stage {killed.stage}"
    assert "secure round resumed round=1" in (resumed / "coordinator.log").read_text()
