# Identities secure aggregation relies on (issue 43): `provision` gives each device an Ed25519 identity key and every
# credential file the fleet's roster; a signed advert from those credentials is the only one a coordinator takes;
# secure aggregation on a fleet without them is refused at start unless its operator says what it gives up.
from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import numpy as np
import pytest

from bench.secagg_fleet import SecureRound, head_updates, largest_error, plain_sum
from coordinator.cli import main
from coordinator.fleet.provision import load_secure_fleet, provision
from coordinator.secure.secagg_round import SecAggSettings
from coordinator.secure.secagg_server import SecAggServer
from coordinator.setup.settings import ServerSettings, fleet_identities
from edge_agent.loop.secagg_device import SecAggDevice
from protocol import messages
from protocol.credentials import load_credentials
from protocol.errors import UsageError
from protocol.messages import RejectionKind
from protocol.secagg.errors import SecAggAbandoned, SecAggRefusal
from protocol.secagg.identity import confirmation_body, sign

FLEET = "ids"
SECURE = messages.Recipe(secure_aggregation="secagg")


@pytest.fixture(scope="module")
def fleet_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("provisioned") / "fleet"
    provision(FLEET, 3, folder)
    return folder


def test_provision_gives_each_device_an_identity_key_and_everyone_the_roster(fleet_folder: Path) -> None:
    """Each device's credential file holds its own identity secret and the roster of all three public keys; the
    coordinator's holds the roster and no secret; no two devices share a key; the files read back as written."""
    secure = load_secure_fleet(fleet_folder)
    devices = {name: load_credentials(secure.device_credentials(name)) for name in sorted(secure.device_keys)}
    roster = secure.identities
    assert sorted(roster) == sorted(devices) == ["dev-00", "dev-01", "dev-02"]
    assert len(set(roster.values())) == 3 and all(len(key) == 32 for key in roster.values())
    assert all(c.identities == roster and len(c.identity_key) == 32 for c in devices.values())
    assert len({c.identity_key for c in devices.values()}) == 3 and secure.coordinator.identity_key == b""
    assert "identity_key" not in repr(devices["dev-00"].identity)


def signed_round(fleet_folder: Path) -> tuple[SecAggServer, dict[str, SecAggDevice]]:
    """A coordinator's secure round over the provisioned devices, checking adverts against the fleet's roster, and
    each device as its credential file makes it."""
    secure = load_secure_fleet(fleet_folder)
    names = sorted(secure.device_keys)
    layout = {"t": np.zeros(3, np.float32)}
    server = SecAggServer.start("run", 1, names, layout, SecAggSettings(identities=secure.identities))
    devices = {
        name: SecAggDevice.start(
            name, 1, 1.0, 0.3, run_id="run", identity=load_credentials(secure.device_credentials(name)).identity
        )
        for name in names
    }
    return server, devices


def test_only_a_device_own_signed_advert_enters_the_round(fleet_folder: Path) -> None:
    """An advert signed with another device's identity key under dev-00's name, an unsigned one, and dev-00's own
    advert replayed into another round are each refused as bad_signature naming dev-00; its own is taken, and the
    rosters carry every neighbour's signature, which each device checks."""
    server, devices = signed_round(fleet_folder)
    own = devices["dev-00"].advert()
    other = dataclasses.replace(devices["dev-01"].advert(), device_id="dev-00")
    for forged in (other, dataclasses.replace(own, signature=b""), dataclasses.replace(own, signature=bytes(64))):
        with pytest.raises(SecAggRefusal) as refused:
            server.on_keys(forged)
        assert refused.value.kind == RejectionKind.BAD_SIGNATURE
        assert refused.value.reason == "the key advert of 'dev-00' is not signed by its identity key"
    later = SecAggDevice.start("dev-00", 2, 1.0, 0.3, run_id="run", identity=devices["dev-00"].identity)
    with pytest.raises(SecAggRefusal):
        server.on_keys(dataclasses.replace(later.advert(), round_id=1))
    for device in devices.values():
        server.on_keys(device.advert())
    rosters = server.rosters()
    assert all(len(roster.signatures) == len(roster.neighbours) == 2 for roster in rosters)
    assert all(devices[roster.device_id].on_roster(roster).device_id == roster.device_id for roster in rosters)


def test_secure_aggregation_on_an_open_fleet_is_refused_at_start(tmp_path: Path, capsys) -> None:
    """`fl-coordinator run --secure-aggregation secagg` without --secure stops before anything is written, in one
    line naming --secagg-open-fleet-unsafe; with that flag the settings pass (adverts then go unchecked)."""
    run_dir = tmp_path / "run"
    secure = ("--strategy", "fedavg", "--secure-aggregation", "secagg", "--secagg-sample-cap", "200")
    assert main(["run", "--rounds", "1", "--run-dir", str(run_dir), *secure]) == 2
    error = capsys.readouterr().err.strip()
    assert error.startswith("fl-coordinator: --secure-aggregation needs per-device logins and identity keys")
    assert "--secagg-open-fleet-unsafe accepts that" in error and "\n" not in error
    assert not run_dir.exists()
    settings = ServerSettings(run_dir, recipe=SECURE, strategy="fedavg", secagg_open_fleet_unsafe=True)
    assert fleet_identities(settings) == {}


def test_a_fleet_provisioned_before_identity_keys_is_refused_for_secure_aggregation(
    fleet_folder: Path, tmp_path: Path
) -> None:
    """A provisioned folder whose credentials carry no roster (written before identity keys) cannot check adverts:
    refused in one line unless the operator accepts unchecked adverts; a provisioned one gives its roster."""
    old = tmp_path / "old"
    provision(FLEET, 2, old)
    body = json.loads((old / "coordinator.json").read_text())
    (old / "coordinator.json").write_text(json.dumps({**body, "identities": {}}))
    settings = ServerSettings(tmp_path / "run", recipe=SECURE, strategy="fedavg", secure_dir=old)
    with pytest.raises(UsageError, match="holds no device identity keys") as refused:
        fleet_identities(settings)
    assert "\n" not in str(refused.value)
    assert fleet_identities(dataclasses.replace(settings, secagg_open_fleet_unsafe=True)) == {}
    provisioned = dataclasses.replace(settings, secure_dir=fleet_folder)
    assert fleet_identities(provisioned) == load_secure_fleet(fleet_folder).identities


def test_a_credential_file_with_a_bad_roster_is_refused_in_one_bounded_line(fleet_folder: Path, tmp_path: Path) -> None:
    """A roster entry that is not a 32-byte hex key, or not a map at all, is a UsageError naming the file."""
    body = json.loads((fleet_folder / "devices" / "dev-00.json").read_text())
    for identities, says in (({"dev-01": "ab" * 31}, "not 32 bytes"), (["x" * 5000], "must map device ids")):
        path = tmp_path / "dev-00.json"
        path.write_text(json.dumps({**body, "identities": identities}))
        with pytest.raises(UsageError, match=says) as refused:
            load_credentials(path)
        assert len(str(refused.value)) < 300


def test_a_signed_round_unmasks_the_same_sum_and_costs_64_bytes_per_signature() -> None:
    """A whole in-process round on a provisioned fleet (bench.secagg_fleet, as benchmarks/secagg_cost.py runs it):
    the sum is the plain sum within the fixed point's bound; against the same round unsigned each device sends its
    advert's signature and one per confirmation (64 bytes and msgpack's 2 each), and receives one per neighbour in
    its roster and one per confirmation routed to it."""
    updates = head_updates(6, features=4)
    costs = {}
    for signed in (False, True):
        secure = SecureRound.started(updates, signed, dropout=0.1)
        secure.share()
        secure.mask(sorted(updates))
        result = secure.unmask(sorted(updates))
        assert largest_error(result.total, plain_sum(updates, sorted(updates))) <= result.error_bound
        costs[signed] = (secure.costs.sent["dev000"], secure.costs.received["dev000"], secure.server.degree)
    (sent, received, degree), (signed_sent, signed_received, _) = costs[False], costs[True]
    assert signed_sent - sent == 64 + 66 * degree
    assert 2 * 64 * degree <= signed_received - received <= 2 * 66 * degree


@pytest.mark.parametrize("restarted", [False, True], ids=["running", "restarted-before-finishing"])
def test_only_a_cheat_own_signature_takes_it_out_of_the_sum(restarted: bool) -> None:
    """Five devices on a provisioned fleet; dev004 sends every partner a random confirmation under its own valid
    signature. The coordinator refuses confirmations without a signature each; a holder given a garbled confirmation of
    an honest device (whose signature covers the real one: what a coordinator could fake) withholds that share but
    proves nothing; with dev004's own signed garbage each holder gives its pairwise seed with dev004, and the round
    finishes with the four honest devices' sum, dev004 excluded as bad_signature. A coordinator restarted before
    finishing has lost the masked inputs it kept apart (memory only): it abandons the round, naming dev004."""
    updates = head_updates(5, features=4)
    secure = SecureRound.started(updates, True, dropout=0.1)
    secure.share()
    secure.mask(sorted(updates))
    cheat = "dev004"
    secret = secure.devices[cheat].identity.secret
    for view in secure.server.view_requests():
        confirmation = secure.devices[view.device_id].on_view(view)
        if view.device_id == cheat:
            tags = [os.urandom(32) for _ in confirmation.tags]
            bodies = [
                confirmation_body(secure.server.context, cheat, r, t) for r, t in zip(confirmation.recipients, tags)
            ]
            confirmation = dataclasses.replace(confirmation, tags=tags, signatures=[sign(secret, b) for b in bodies])
        with pytest.raises(SecAggRefusal) as refused:
            secure.server.on_confirm(dataclasses.replace(confirmation, signatures=[b"x"] * len(confirmation.tags)))
        assert refused.value.kind == RejectionKind.UNDECODABLE
        secure.server.on_confirm(confirmation)
    requests = {request.device_id: request for request in secure.server.unmask_requests()}
    holder = secure.devices["dev000"]
    request = requests["dev000"]
    garbled = [os.urandom(32) if sender == "dev001" else tag for sender, tag in zip(request.senders, request.tags)]
    faked = holder.on_unmask(dataclasses.replace(request, tags=garbled))
    assert (faked.refused, faked.proven) == (["dev001", cheat], [cheat])
    for device, request in requests.items():
        if device != cheat:
            secure.server.on_reveal(secure.devices[device].on_unmask(request))
    if restarted:
        server = SecAggServer.restored(secure.server.snapshot())
        with pytest.raises(SecAggAbandoned, match=r"^\['dev004'\] sent view confirmations that did not check"):
            server.finish()
        assert server.state.excluded == [cheat]
        return
    result = secure.server.finish()
    honest = sorted(set(updates) - {cheat})
    assert result.survivors == honest and secure.server.state.excluded == [cheat]
    assert largest_error(result.total, plain_sum(updates, honest)) <= result.error_bound
    assert secure.server.exclusions()[0][2] == RejectionKind.BAD_SIGNATURE
