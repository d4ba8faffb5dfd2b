# A device behind a relay predicts: the relay passes the central serving version down to its site broker and its site
# devices' prediction batches up, counted by the central coordinator per site device (real processes and brokers).
from __future__ import annotations

import json
import logging
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from fleet import log_text, start_coordinator, wait_until
from test_fleet_predictions import batch
from test_predictions import pool_with
from test_relay import BASE, relay_on

from coordinator.dashboard.live import LiveState
from coordinator.fleet.broker import EmbeddedBroker, free_loopback_port
from coordinator.fleet.provision import broker_config_lines, provision
from coordinator.intake.predictions import PredictionIntake
from coordinator.relay import FORWARD_QUEUE, PredictionForwarder
from coordinator.storage.store import RunStore
from edge_agent.data.predictions_log import PREDICTIONS_FOLDER
from edge_agent.loop.artefacts import SERVING_MODEL
from protocol import messages, topics, wire
from protocol.model_spec import DEFAULT_SPEC
from protocol.mqtt import BrokerAddress, IncomingMessage, MqttSession
from protocol.prediction_messages import PredictionBatch
from protocol.serving_messages import ServingMessage
from protocol.supervision import Health
from protocol.tensors import weights_hash

pytestmark = pytest.mark.integration

CENTRAL, SITE, RELAY, CAMERA = "central", "site", "relay-00", "cam-1"
IMAGES = 6


def start_process(command: list[str], log_file: Path) -> subprocess.Popen:
    """A python -m process of the project, logging to `log_file`."""
    log_file.parent.mkdir(parents=True, exist_ok=True)
    with open(log_file, "ab") as stream:
        return subprocess.Popen([sys.executable, "-m", *command], stdout=stream, stderr=subprocess.STDOUT)


def relay_counts(port: int) -> dict | None:
    """The central dashboard's predictions summary of the camera behind the relay (None: none counted yet)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/devices", timeout=5) as response:
            devices = json.loads(response.read())["devices"]
    except OSError:
        return None
    return next((d["predictions"] for d in devices if d["device_id"] == f"{RELAY}/{CAMERA}"), None)


def logged(state_dir: Path) -> list[dict]:
    """The camera's own predictions log."""
    lines = []
    for segment in sorted((state_dir / PREDICTIONS_FOLDER).glob("*")):
        lines += [json.loads(line) for line in segment.read_text().splitlines() if line.strip()]
    return lines


def test_a_camera_behind_a_relay_predicts_with_the_central_serving_version_and_the_centre_counts_it(
    tmp_path: Path, processes
) -> None:
    """A secured central fleet (broker logins, its ACL; serving W0, asking for predictions, relay-00 named as a
    relay), a relay process logged in upstream as its device and a field agent on the site's own broker: the relay
    retains the serving version, its model and the site's bundle of it on the site broker, the camera predicts its
    images with it, and the relay passes its batches upstream under its own topics, where the central dashboard
    counts them as relay-00/cam-1."""
    port = free_loopback_port()
    camera, state = tmp_path / "camera", tmp_path / "state"
    pool_with(camera, IMAGES)
    secure = provision(CENTRAL, 1, tmp_path / "central-secure", prefix="relay")
    locked = broker_config_lines(secure)
    with (
        EmbeddedBroker(tmp_path / "central-broker", port=free_loopback_port(), extra_config=locked) as central,
        EmbeddedBroker(tmp_path / "site-broker") as site,
    ):
        watcher = MqttSession(site.address, client_id="site-watcher")
        watcher.connect(timeout=10)
        watcher.subscribe(topics.SERVING.build(fleet=SITE))
        try:
            options = ("--relay", RELAY, "--publish-predictions", "--dashboard", str(port), "--wait-devices", "9")
            options += ("--secure", str(secure.folder))
            processes.append(start_coordinator(central.address, tmp_path / "central", CENTRAL, *options))
            relay = [
                *("coordinator", "relay", "--upstream", central.address.url),
                *("--credentials", str(secure.device_credentials(RELAY))),
                *("--site-fleet", SITE, "--broker", site.address.url, "--run-dir", str(tmp_path / "relay")),
                *("--quorum", "1", "--log-level", "info"),
            ]
            processes.append(start_process(relay, tmp_path / "relay.log"))
            agent = [
                *("edge_agent", "run", "--broker", site.address.url, "--fleet", SITE, "--device-id", CAMERA),
                *("--pool-dir", str(camera), "--state-dir", str(state), "--scan-interval", "0.5"),
                *("--settle-seconds", "0", "--log-level", "info"),
            ]
            processes.append(start_process(agent, tmp_path / "agent.log"))
            message = watcher.next_message(timeout=60)
            assert message is not None, log_text(tmp_path / "relay.log")[-3000:]
            served = wire.decode(message.payload, ServingMessage)
            wait_until(
                lambda: (relay_counts(port) or {}).get("total") == IMAGES, "the camera's predictions counted", 60
            )
            counts = relay_counts(port)
        finally:
            watcher.close()
    assert (served.version, served.publish_predictions) == (0, True)
    assert counts is not None and counts["serving_version"] == 0 and counts["per_hour"] in (0, IMAGES)
    assert sum(counts["class_mix"].values()) == pytest.approx(1.0)
    lines = logged(state)
    assert sorted(line["file"] for line in lines) == [f"{index:03d}.png" for index in range(IMAGES)]
    assert {(line["serving_version"], line["model_hash"]) for line in lines} == {(0, served.model_hash)}
    for log_file in ("relay.log", "agent.log", "central/coordinator.log"):
        assert "Traceback" not in log_text(tmp_path / log_file), log_file


def test_the_forwarder_passes_on_only_checked_batches_under_the_relay_and_drops_what_it_cannot_send(
    broker, sessions, caplog
) -> None:
    """Site batches as a camera publishes them: a good one, one naming another device, bytes that are no batch, a
    good one. Upstream the relay's topic carries the two good ones, each naming its camera; the bad ones are refused
    in one bounded line. With the upstream session gone a good batch is dropped, counted, not queued."""
    site = MqttSession(broker.address, client_id="coordinator-site", manual_ack=True)
    upstream = sessions(broker.address, RELAY)
    watcher = sessions(broker.address, "central-watch")
    watcher.subscribe(topics.RELAYED_PREDICTIONS.build(fleet=CENTRAL, device=RELAY))
    forwarder = PredictionForwarder(CENTRAL, RELAY, site, upstream, Health())
    forwarder.open(SITE)
    site.connect(timeout=10)
    forwarder.start()
    camera = sessions(broker.address, CAMERA)
    topic = topics.PREDICTIONS.build(fleet=SITE, device=CAMERA)
    try:
        with caplog.at_level(logging.WARNING):
            for payload in (batch(CAMERA, 5, 1), batch("cam-2", 4, 0), b"\x00" * 10, batch(CAMERA, 3, 0)):
                sent = payload if isinstance(payload, bytes) else wire.encode(payload)
                camera.publish(topic, sent, wait=10)
            received = [watcher.next_message(timeout=10) for _ in range(2)]
            assert watcher.next_message(timeout=0.5) is None
            upstream.close()
            camera.publish(topic, wire.encode(batch(CAMERA, 2, 0)), wait=10)
            wait_until(lambda: forwarder.dropped == 1, "the batch dropped while upstream is away", 10)
    finally:
        forwarder.close()
        site.close()
    batches = [wire.decode(message.payload, PredictionBatch) for message in received if message is not None]
    assert [(each.device_id, len(each)) for each in batches] == [(CAMERA, 5), (CAMERA, 3)]
    assert forwarder.forwarded == 8
    warned = [record.getMessage() for record in caplog.records if record.levelno >= logging.WARNING]
    refused = [line for line in warned if "predictions refused" in line]
    assert len(refused) == 1 and "batch names device 'cam-2'" in refused[0] and len(refused[0]) < 400
    assert any("site predictions dropped batches=1 reason=the upstream broker is away" in line for line in warned)
    assert watcher.next_message(timeout=0.5) is None


def test_a_full_queue_to_upstream_drops_the_next_batch_and_logs_it_once(caplog) -> None:
    """FORWARD_QUEUE batches wait (the thread not started); the next two are dropped, counted, one warning."""
    nowhere = MqttSession(BrokerAddress("127.0.0.1", 1), client_id="never-connects")
    forwarder = PredictionForwarder(CENTRAL, RELAY, nowhere, nowhere, Health())
    topic = topics.PREDICTIONS.build(fleet=SITE, device=CAMERA)
    with caplog.at_level(logging.WARNING, logger="coordinator.relay"):
        for _ in range(FORWARD_QUEUE + 2):
            forwarder.take(IncomingMessage(topic, b"", False))
    assert forwarder.dropped == 2
    assert [record.getMessage() for record in caplog.records] == [
        "site predictions dropped batches=1 reason=the queue to upstream is full"
    ]


def test_the_centre_counts_a_relays_batches_per_site_device_and_refuses_them_from_any_other_device(caplog) -> None:
    """Relayed batches count under relay/device; from a device not named as a relay, or naming a device that is no
    identifier, they are refused and counted as refused, in bounded lines."""
    live = LiveState(total_rounds=1)
    intake = PredictionIntake(live, relays=[RELAY])
    with caplog.at_level(logging.WARNING, logger="coordinator.intake.predictions"):
        intake.on_relayed(RELAY, wire.encode(batch(CAMERA, 7, 0)), None)
        intake.on_relayed("cam-9", wire.encode(batch(CAMERA, 7, 0)), None)
        intake.on_relayed("relay-00", wire.encode(batch("bad device/" + "x" * 500, 3, 0)), None)
    assert set(live.predictions()) == {f"{RELAY}/{CAMERA}"}
    assert live.predictions()[f"{RELAY}/{CAMERA}"]["total"] == 7
    assert live.counters().predictions_refused == 2
    lines = [record.getMessage() for record in caplog.records]
    assert "device=cam-9 reason=relayed predictions from a device not named as a relay (--relay)" in lines[0]
    assert "not an identifier" in lines[1] and all(len(line) < 400 for line in lines)


def serving_message(model_hash: str, version: int = 0) -> IncomingMessage:
    """The central serving topic's retained message naming `model_hash`."""
    message = ServingMessage("run-t", version, model_hash, time.time(), True)
    return IncomingMessage(topics.SERVING.build(fleet=CENTRAL), wire.encode(message), True)


def test_the_relay_follows_the_serving_versions_model_and_ignores_a_bad_serving_message(
    tmp_path: Path, broker, sessions, caplog
) -> None:
    """Upstream serving messages at the relay: bytes that are no serving message, and one whose hash is no sha256,
    are logged and ignored; a good one has the relay follow that model's topic as the serving model, and once its
    model came in and the site had it, the same version again changes nothing."""
    upstream = sessions(broker.address, RELAY)
    model_topic = topics.MODEL.build(fleet=CENTRAL, hash=weights_hash(BASE))
    with RunStore(tmp_path / "relay") as store, caplog.at_level(logging.WARNING):
        relay = relay_on(upstream, tmp_path / "relay", store)
        bad = IncomingMessage(topics.SERVING.build(fleet=CENTRAL), b"\x93garbage", True)
        assert relay.handle(bad) is False and relay.handle(serving_message("not-a-hash")) is False
        assert relay.serving is None and SERVING_MODEL not in relay.artefacts.followed
        relay.handle(serving_message(weights_hash(BASE)))
        assert relay.serving is not None and relay.artefacts.followed[SERVING_MODEL] == model_topic
        served: list[tuple] = []
        relay.site.serve = lambda *given: served.append(given)
        relay.maybe_serve()
        assert served == [], "its model is not in yet"
        relay.artefacts.on_model(messages.ModelMessage(weights_hash(BASE), DEFAULT_SPEC, BASE), SERVING_MODEL)
        relay.maybe_serve()
        relay.handle(serving_message(weights_hash(BASE)))
        relay.maybe_serve()
    assert [(message.version, spec.num_classes) for message, spec, _ in served] == [(0, 10)]
    lines = [record.getMessage() for record in caplog.records]
    assert any("ignored bad upstream message" in line for line in lines)
    assert any("ignored serving message model='not-a-hash': not a sha256" in line for line in lines)
    assert relay.serving is None
