# Secure aggregation with real processes (mosquitto, `python -m coordinator run`, `python -m bench device`): a secure
# round of four devices, a coordinator SIGKILLed after masked inputs arrived that a restart finishes exactly, and a
# provisioned fleet's round whose every key advert is signed by its device's identity key.
from __future__ import annotations

from pathlib import Path

import pytest
from fleet import LABELS, committed_rounds, fleet_shards, kill, start_agent, start_coordinator, wait_exit, wait_until

from bench.simulate import with_credentials
from coordinator.fleet.provision import provision
from coordinator.secure.secagg_round import ServerSecAggState
from coordinator.storage.store import RunStore
from protocol import wire
from protocol.secagg.identity import advert_signed
from protocol.tensors import weights_hash

pytestmark = pytest.mark.integration

SECURE = (
    "--secure-aggregation",
    "secagg",
    "--strategy",
    "fedavg",
    "--rounds",
    "1",
    "--quorum",
    "4",
)
OPTIONS = (*SECURE, "--min-devices", "4", "--round-timeout", "60", "--secagg-open-fleet-unsafe")


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


def test_a_provisioned_fleet_signs_every_key_advert_with_real_processes(tmp_path: Path, broker, processes) -> None:
    """`fl-coordinator run --secure DIR` and four `bench device` agents with their credential files from `provision`
    (no --secagg-open-fleet-unsafe): each agent signs its advert with the identity key its file holds, the
    coordinator checks each against the roster in its own (and every device each neighbour's), and the round
    commits with all four devices; the saved round holds each advert's valid signature."""
    secure = provision("secure", 4, tmp_path / "secure")
    run_dir = tmp_path / "run"
    options = (*SECURE, "--min-devices", "4", "--round-timeout", "60", "--secure", str(secure.folder))
    coordinator = start_coordinator(broker.address, run_dir, "secure", *options)
    launches = with_credentials(fleet_shards(run_dir, 4), secure)
    agents = [start_agent(launch, broker.address, "secure") for launch in launches]
    processes.extend([coordinator, *agents])
    assert [wait_exit(process, "fleet process") for process in [coordinator, *agents]] == [0] * 5
    _, metrics = round_one(run_dir)
    assert metrics["secure_aggregation"] == "committed" and metrics["secagg_survivors"] == 4
    state = secure_state(run_dir)
    assert state is not None and sorted(state.advertised) == sorted(secure.identities)
    context = f"{state.run_id}/1".encode()
    adverts = zip(state.advertised, state.cipher_keys, state.mask_keys, state.signatures)
    assert all(advert_signed(secure.identities[d], s, context, d, c, m) for d, c, m, s in adverts)
