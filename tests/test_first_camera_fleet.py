# The guide docs/first-camera-fleet.md run as written (and with the field loop's flags) on a generated fleet.
from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from bench.camera_console import logged_predictions
from bench.camera_fleet import (
    ANSWERS_FILE,
    SERVER_FILE,
    SPEC_FILE,
    FleetSettings,
    PeopleAtThePage,
    build_fleet,
    device_dir,
    stop_site,
)
from bench.camera_path import (
    AVERAGED_HEADS,
    CameraSite,
    CentralLabelling,
    broker_listening,
    guide_command,
    run_camera_site,
    with_values,
)
from bench.camera_scenes import parse_classes
from coordinator.fleet.broker import EmbeddedBroker, free_loopback_port
from coordinator.intake.label_agreement import LABEL_MARGIN
from coordinator.storage.spool import Spool
from coordinator.storage.store import RunStore
from edge_agent.data.image_arrays import ImageDataset
from protocol import wire
from protocol.head_statistics import HeadStatistics
from protocol.messages import WAITING_FOR_ANSWERS, Update
from protocol.model_spec import load_model_spec

CLASSES = "sneaker=Sneaker,sandal=Sandal,coat=Coat,pullover=Pullover,shirt=Shirt"
DEVICES = 4
ROUNDS = 2


def test_the_guide_has_the_commands_a_fleet_needs_to_start_together() -> None:
    coordinator, device = guide_command("coordinator"), guide_command("device")
    assert coordinator[:2] == ["fl-coordinator", "run"] and device[:2] == ["edge-agent", "run"]
    for flag in ("--broker-listen", "--wait-devices", "--min-devices", "--round-timeout", "--strategy", "--local-rule"):
        assert flag in coordinator
    assert guide_command(AVERAGED_HEADS) == ["--logit-adjustment", "1", "--no-device-eval"]
    assert "--exit-on-final" in device and "--profile" in device


def test_the_readme_camera_path_is_the_guides_commands_word_for_word() -> None:
    """The front page's camera path restates nothing: its coordinator and device commands are the guide's, which the
    test below runs."""
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    block = re.search(r"## The camera path in ten lines.*?```sh\n(.*?)```", readme, re.DOTALL)
    assert block is not None
    commands = [
        shlex.split(line, comments=True) for line in block.group(1).replace("\\\n", " ").splitlines() if line.strip()
    ]
    assert guide_command("coordinator") in commands
    assert guide_command("device") in commands


def test_a_site_changes_only_values_of_flags_the_guide_has() -> None:
    with pytest.raises(ValueError, match="has no --quorum"):
        with_values(guide_command("coordinator"), {"--quorum": "3"})


def labelled_photo_folders(server: Path, spec: Path, out: Path) -> Path:
    """The server's labelled images as a team has them: one folder of PNG photos per class name."""
    class_names = load_model_spec(spec).spec.class_names
    with np.load(server) as data:
        images = np.concatenate([data["train_images"], data["test_images"]])
        labels = np.concatenate([data["train_labels"], data["test_labels"]])
    for number, (image, label) in enumerate(zip(images, labels, strict=True)):
        folder = out / class_names[int(label)]
        folder.mkdir(parents=True, exist_ok=True)
        Image.fromarray(image).save(folder / f"photo-{number:03d}.png")
    return out


@pytest.mark.integration
def test_the_guides_commands_train_a_fleet_of_other_classes_from_a_folder_of_photos(
    tmp_path: Path, fashion: ImageDataset
) -> None:
    fleet_dir = tmp_path / "fleet"
    settings = FleetSettings(
        DEVICES, parse_classes(CLASSES), per_class=10, test_per_class=10, size=64, seed=7, server_per_class=8
    )
    build_fleet(fleet_dir, settings, fashion)
    photos = labelled_photo_folders(fleet_dir / SERVER_FILE, fleet_dir / SPEC_FILE, tmp_path / "labelled")
    values = {
        "--images": str(photos),
        "--model-spec": str(fleet_dir / SPEC_FILE),
        "--out": str(fleet_dir / SERVER_FILE),
    }
    built = subprocess.run(with_values(guide_command("dataset"), values), capture_output=True, text=True, timeout=120)
    assert built.returncode == 0 and "Traceback" not in built.stderr, built.stdout + built.stderr
    site = CameraSite(fleet_dir, tmp_path, free_loopback_port(), DEVICES, ROUNDS, labels=10)
    codes = run_camera_site(site, timeout=300)
    out = (tmp_path / "coordinator.out").read_text()
    assert codes == [0] * (DEVICES + 1), out + (tmp_path / "coordinator.log").read_text()[-3000:]
    assert "server data: W0 trains on 70 of server.npz's 70 labelled images, none kept for selection" in out
    assert "measured on 20 test images; devices send class statistics, no model of their own to measure" in out
    assert re.search(r"W0 test accuracy 0\.\d{4} \(trained on the server's 70 labelled images\)", out)
    assert f"embedded broker listening at mqtt://127.0.0.1:{site.port}" in out
    for round_id in range(1, ROUNDS + 1):
        line = next(line for line in out.splitlines() if line.startswith(f"round {round_id:>3}/{ROUNDS}"))
        assert re.search(r"global acc 0\.\d{4}", line), line
        assert f"(server 70 + devices {DEVICES * 10 * round_id})" in line, line
        assert re.search(r"peak RSS \d+ MB \(cam-\d\)", line), line
    agent_log = (tmp_path / "cam-0.log").read_text()
    assert "the profile's storage_path /var/lib/edge-agent is not used" in agent_log
    assert "is plain TCP: the profile's tls_ca, tls_cert, tls_key apply to mqtts:// only" in agent_log
    with RunStore(site.run_dir, read_only=True) as store:
        assert 0.0 <= (store.config() or {})["w0_accuracy"] <= 1.0
        assert len(store.rounds()) == ROUNDS
    subprocess.run(site.report_command(), check=True, capture_output=True, timeout=120)


@pytest.mark.integration
def test_the_field_loop_labels_through_the_page_and_serves_a_version(tmp_path: Path, fashion: ImageDataset) -> None:
    """The guide's commands with the field loop's flags: devices label centrally and predict, the bench's person
    answers every query through the dashboard's labelling API with its token (the devices' status saying they wait
    for their answers meanwhile), and each round's gate decides."""
    fleet_dir, devices = tmp_path / "fleet", 2
    settings = FleetSettings(
        devices, parse_classes(CLASSES), per_class=6, test_per_class=10, size=64, seed=3, server_per_class=8
    )
    build_fleet(fleet_dir, settings, fashion)
    site = CameraSite(
        fleet_dir, tmp_path, free_loopback_port(), devices, ROUNDS, 5, central=CentralLabelling(free_loopback_port())
    )
    people = site.people(tuple(c.name for c in settings.classes))
    assert isinstance(people, PeopleAtThePage)
    codes = run_camera_site(site, timeout=300, people=people)
    out = (tmp_path / "coordinator.out").read_text()
    assert codes == [0] * (devices + 1), out + (tmp_path / "coordinator.log").read_text()[-3000:]
    assert people.answered == devices * 5 * ROUNDS, people.last_refusal
    assert WAITING_FOR_ANSWERS in people.states, f"a round waiting for its answers says so: {people.states}"
    with RunStore(site.run_dir, read_only=True) as store:
        decisions = [event for event in store.serving.events() if event.who == "gate"]
        assert [event.round_id for event in decisions] == list(range(1, ROUNDS + 1))
        assert {event.decision for event in decisions} <= {"promoted", "held"}
        assert all(record.labels == 40 + devices * 5 * record.round_id for record in store.rounds())
    for number in range(devices):
        rows = logged_predictions(site.state_dir(number))
        assert len({row["file"] for row in rows}) == settings.per_class * len(settings.classes)
        assert {row["serving_version"] for row in rows} <= {0, *range(1, ROUNDS + 1)}
    published = {row["device_id"]: (row["predictions"] or {}).get("total", 0) for row in people.devices}
    assert published == {f"cam-{n}": settings.per_class * len(settings.classes) for n in range(devices)}


def pooled_site(
    tmp_path: Path,
    fleet_dir: Path,
    flags: tuple[str, ...],
    rounds: int = 1,
    own_flags: tuple[tuple[str, ...], ...] = (),
    devices: int = 2,
    labels: int = 6,
) -> CameraSite:
    """The guide's site of `devices` cameras (its pooled head) with `flags` (each camera's `own_flags`), `labels` a
    camera and round, to the end."""
    site = CameraSite(fleet_dir, tmp_path, free_loopback_port(), devices, rounds, labels, flags, own_flags=own_flags)
    codes = run_camera_site(site, timeout=300)
    out = (tmp_path / "coordinator.out").read_text()
    assert codes == [0] * (devices + 1), out + (tmp_path / "coordinator.log").read_text()[-3000:]
    return site


@pytest.mark.integration
def test_a_fleet_fits_its_head_from_class_statistics_plainly_and_securely_alike(
    tmp_path: Path, fashion: ImageDataset
) -> None:
    fleet_dir = tmp_path / "fleet"
    build_fleet(
        fleet_dir, FleetSettings(2, parse_classes(CLASSES), per_class=8, test_per_class=6, size=64, seed=3), fashion
    )
    plain = pooled_site(tmp_path / "plain", fleet_dir, ())
    secure = pooled_site(
        tmp_path / "secure", fleet_dir, ("--secure-aggregation", "secagg", "--secagg-open-fleet-unsafe")
    )
    heads = []
    for site in (plain, secure):
        with RunStore(site.run_dir, read_only=True) as store:
            rounds, records = store.rounds(), [record for record in store.device_rounds() if record.accepted]
            heads.append({name: array for name, array in store.checkpoints.load(1).items() if "classifier" in name})
        assert [record.round_id for record in rounds] == [1]
        assert all(record.report["classes_seen"] >= 2 for record in rounds)
        assert all(record.update_bytes == 0 for record in records) == (site is secure), "secure: no plain update"
        shares = rounds[0].report["class_shares"]
        assert len(shares) == 5 and abs(sum(shares) - 1.0) < 1e-4, shares
        journal = json.loads((site.state_dir(0) / "state.json").read_text())
        assert journal["fleet_label_shares"] == pytest.approx(shares, abs=1e-6), "the final announcement carried them"
    for name, array in heads[0].items():
        scale = float(np.max(np.abs(array)))
        assert float(np.max(np.abs(heads[1][name] - array))) <= 1e-3 * scale, f"{name}: the secure sum's fit differs"


@pytest.mark.integration
def test_the_pools_posteriors_refine_the_pooled_head_and_a_camera_without_consent_withholds_its_own(
    tmp_path: Path, fashion: ImageDataset
) -> None:
    """`--pool-statistics 1 --rounds-per-acquisition 2`: cam-0, started with `--share-pool-statistics`, sends its
    pool's posterior sums with its labels' statistics; cam-1, started without it, sends zeros in their place (as the
    coordinator's spool holds them) and logs that it withheld them. The round that acquired fits from the labels
    alone, the next (no new labels) refines the class means with cam-0's pool; every count stays of human answers,
    the refined head differs, and the console's line says so."""
    fleet_dir = tmp_path / "fleet"
    build_fleet(
        fleet_dir, FleetSettings(2, parse_classes(CLASSES), per_class=8, test_per_class=6, size=64, seed=3), fashion
    )
    site = pooled_site(tmp_path / "pool", fleet_dir, POOL_FLAGS, rounds=2, own_flags=(("--share-pool-statistics",),))
    with RunStore(site.run_dir, read_only=True) as store:
        rounds = store.rounds()
        samples = {(record.device_id, record.round_id): record.num_samples for record in store.device_rounds()}
        heads = [store.checkpoints.load(r)["classifier_fc.weight"] for r in (1, 2)]
    assert [record.report["pool_refined"] for record in rounds] == [False, True]
    assert rounds[1].report["pool_weight"] > 0
    assert rounds[1].labels == rounds[0].labels, "the refining round acquires nothing"
    assert samples == {(f"cam-{n}", r): 6 for n in range(2) for r in (1, 2)}, "human labels alone are counted"
    assert not np.allclose(heads[0], heads[1])
    received = spooled_statistics(site.run_dir, 2)
    assert np.any(received["cam-0"].pool_mass > 0) and np.any(received["cam-1"].class_counts > 0)
    assert not np.any(received["cam-1"].pool_sums) and not np.any(received["cam-1"].pool_mass)
    withheld = r"pool statistics withheld device=cam-\d round=(\d)"
    assert re.findall(withheld, (site.work / "cam-1.log").read_text()) == ["1", "2"]
    assert re.findall(withheld, (site.work / "cam-0.log").read_text()) == []
    out = (site.work / "coordinator.out").read_text()
    lines = [line for line in out.splitlines() if re.match(r"round +\d+/", line)]
    assert ["refined by the pools (weight" in line for line in lines] == [False, True], lines


POOL_FLAGS = ("--pool-statistics", "1", "--rounds-per-acquisition", "2", "--keep-updates")


def spooled_statistics(run_dir: Path, round_id: int) -> dict[str, HeadStatistics]:
    """Each device's statistics as the coordinator received them in a round (its spool, --keep-updates)."""
    return {
        device: HeadStatistics.of_tensors(update.tensors)
        for device, update in spooled_updates(run_dir, round_id).items()
    }


@pytest.mark.integration
def test_a_camera_whose_person_answers_at_random_is_a_suspect_under_the_pooled_head(
    tmp_path: Path, fashion: ImageDataset
) -> None:
    """Four real cameras on the pooled head; cam-3's person answers from an answer key whose labels are shuffled. Its
    statistics are judged once it holds 20 labels (round 2): it is the round's suspect, and the honest cameras are
    not; the console's round line names it."""
    fleet_dir = tmp_path / "fleet"
    build_fleet(
        fleet_dir, FleetSettings(4, parse_classes(CLASSES), per_class=8, test_per_class=6, size=64, seed=3), fashion
    )
    key = device_dir(fleet_dir, 3) / ANSWERS_FILE
    header, *rows = key.read_text().splitlines()
    names, answers = zip(*(row.split(",") for row in rows))
    shuffled = np.random.default_rng(0).permutation(answers)
    key.write_text("\n".join([header, *(f"{name},{answer}" for name, answer in zip(names, shuffled))]) + "\n")
    site = pooled_site(tmp_path / "pool", fleet_dir, (), rounds=2, devices=4, labels=12)
    with RunStore(site.run_dir, read_only=True) as store:
        suspects = [record.report["suspects"] for record in store.rounds()]
    assert suspects == [{}, {"cam-3": [LABEL_MARGIN]}], "12 labels are too few to judge; 24 are not"
    assert "suspects cam-3" in (site.work / "coordinator.out").read_text()


@pytest.mark.integration
def test_the_guides_pseudo_labels_variant_trains_on_the_pool_and_counts_human_labels_only(
    tmp_path: Path, fashion: ImageDataset
) -> None:
    """The guide's averaged heads with `--local-rule pseudo-labels`: real cameras train on their unlabelled pool
    (their log says on how many rows), and every count the coordinator keeps (the round's labels, each update's
    samples) is of human answers alone."""
    fleet_dir, devices, labels = tmp_path / "fleet", 2, 6
    classes = parse_classes(CLASSES)
    build_fleet(fleet_dir, FleetSettings(devices, classes, 12, 6, size=64, seed=3), fashion)
    rule = ("--local-rule", "pseudo-labels")
    site = CameraSite(fleet_dir, tmp_path, free_loopback_port(), devices, 2, labels, rule, averaged_heads=True)
    codes = run_camera_site(site, timeout=300)
    assert codes == [0] * (devices + 1), (tmp_path / "coordinator.log").read_text()[-3000:]
    with RunStore(site.run_dir, read_only=True) as store:
        rounds = store.rounds()
        samples = {(record.device_id, record.round_id): record.num_samples for record in store.device_rounds()}
    assert [record.labels - rounds[0].labels for record in rounds] == [0, devices * labels]
    assert samples == {(f"cam-{n}", r): r * labels for n in range(devices) for r in (1, 2)}
    trained = re.findall(r"pseudo-labels trained on=(\d+) pool=(\d+)", (tmp_path / "cam-0.log").read_text())
    assert len(trained) == 2 and all(0 < int(rows) <= int(pool) for rows, pool in trained), trained


def start_relay_site(site: CameraSite, site_port: int, cameras: range) -> list[subprocess.Popen]:
    """relay-00 of the guide's fleet (`fl-coordinator relay`, following the central recipe) on a site broker at
    `site_port`, and the guide's agents of `cameras` on that broker as devices of site fleet `hall` (logs in the
    work folder)."""
    relay = [
        *(sys.executable, "-m", "coordinator", "relay", "--upstream", f"mqtt://127.0.0.1:{site.port}"),
        *("--fleet", "site", "--relay-id", "relay-00", "--site-fleet", "hall"),
        *("--broker", f"mqtt://127.0.0.1:{site_port}", "--run-dir", str(site.work / "relay")),
        *("--quorum", str(len(cameras)), "--min-devices", str(len(cameras)), "--round-timeout", "240"),
        *("--keep-updates", "--log-level", "info"),
    ]
    processes = []
    with open(site.work / "relay.log", "ab") as log:
        processes.append(subprocess.Popen(relay, stdout=log, stderr=log))
    for number in cameras:
        command = site.agent_command(number)
        for flag, value in (("--broker", f"mqtt://127.0.0.1:{site_port}"), ("--fleet", "hall")):
            command[command.index(flag) + 1] = value
        with open(site.work / f"cam-{number}.log", "ab") as log:
            processes.append(subprocess.Popen(command, stdout=log, stderr=log))
    return processes


@pytest.mark.integration
def test_a_relay_passes_its_cameras_mean_statistics_up_and_the_centre_counts_every_label(
    tmp_path: Path, fashion: ImageDataset
) -> None:
    """The pooled head with a relay: cam-0 on the central broker, cam-1 and cam-2 behind relay-00 on their site's own
    broker. The relay's site round averages its cameras' statistics by their labels and sends that mean with their
    label count as one update; the centre accepts it beside cam-0's, its label shares are the three cameras'
    summed class counts, and every label counted is a human answer."""
    fleet_dir, labels = tmp_path / "fleet", 6
    build_fleet(fleet_dir, FleetSettings(3, parse_classes(CLASSES), 8, 6, size=64, seed=3), fashion)
    relay, fewer = ("--relay", "relay-00", "--keep-updates"), (("--wait-devices", "2"), ("--min-devices", "2"))
    site = CameraSite(fleet_dir, tmp_path, free_loopback_port(), 3, 1, labels, relay, fewer)
    names = tuple(load_model_spec(fleet_dir / SPEC_FILE).spec.class_names)
    people = site.people(names)
    with EmbeddedBroker(tmp_path / "site-broker", port=free_loopback_port()) as hall:
        out = tmp_path / "coordinator.out"
        with open(out, "ab") as stdout, open(tmp_path / "coordinator.log", "ab") as log:
            processes = [subprocess.Popen(site.coordinator_command(), stdout=stdout, stderr=log)]
        try:
            assert broker_listening(out, processes[0], 120), (tmp_path / "coordinator.log").read_text()[-3000:]
            processes += start_relay_site(site, hall.address.port, range(1, 3))
            with open(tmp_path / "cam-0.log", "ab") as log:
                processes.append(subprocess.Popen(site.agent_command(0), stdout=log, stderr=log))
            people.start()
            codes = [process.wait(timeout=300) for process in processes]
        finally:
            stop_site(people, processes)
    assert codes == [0] * 5, out.read_text() + (tmp_path / "relay.log").read_text()[-3000:]
    behind = spooled_updates(tmp_path / "relay", 1)
    central = spooled_updates(site.run_dir, 1)
    assert sorted(behind) == ["cam-1", "cam-2"] and sorted(central) == ["cam-0", "relay-00"]
    relayed = central["relay-00"]
    assert relayed.contributors == ["cam-1", "cam-2"] and relayed.num_samples == 2 * labels
    for name, array in relayed.tensors.items():
        mean = sum(update.num_samples * update.tensors[name].astype(np.float64) for update in behind.values())
        np.testing.assert_allclose(array, mean / relayed.num_samples, rtol=1e-5, atol=1e-7, err_msg=name)
    with RunStore(site.run_dir, read_only=True) as store:
        (record,) = store.rounds()
    counts = np.sum([update.class_counts for update in [*behind.values(), central["cam-0"]]], axis=0)
    assert record.report["class_shares"] == pytest.approx(counts / counts.sum(), abs=1e-6)
    assert re.findall(r"\(server \d+ \+ devices (\d+)\)", out.read_text()) == [str(3 * labels)]


def spooled_updates(run_dir: Path, round_id: int) -> dict[str, Update]:
    """Each device's update as a coordinator (or a relay) received it in a round (its spool, --keep-updates)."""
    return {device: wire.decode(raw, Update) for device, raw in Spool(run_dir / "spool").payloads(round_id).items()}
