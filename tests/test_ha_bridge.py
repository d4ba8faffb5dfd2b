# The Home Assistant bridge (`fl-coordinator ha-bridge`) against a real mosquitto, read by a plain paho client exactly
# as Home Assistant reads MQTT discovery: configs, JSON states, availability, a broker restart, malformed batches.
from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import paho.mqtt.client as paho
import pytest
from fleet import wait_exit, wait_until
from paho.mqtt.subscribeoptions import SubscribeOptions

from coordinator.bridge.home_assistant import (
    OFFLINE,
    ONLINE,
    Camera,
    SensorTopics,
    discovery_config,
    ha_id,
    prediction_state,
)
from coordinator.cli import main
from coordinator.fleet.broker import EmbeddedBroker
from coordinator.fleet.provision import broker_config_lines, provision
from edge_agent.loop.agent import last_will
from edge_agent.loop.agent_settings import AgentSettings
from protocol import messages, topics, wire
from protocol.credentials import Credentials, load_credentials
from protocol.prediction_messages import BatchError, PredictionBatch, check_batch

ROOT = Path(__file__).resolve().parent.parent
SPEC = ROOT / "examples" / "rgb-camera.toml"  # classes: empty, person, forklift, pallet
CLASSES = ("empty", "person", "forklift", "pallet")
FLEET = "plant"
WAIT = 20.0
HA_ID = re.compile(r"^[a-zA-Z0-9_-]+$")
VIEWED = ("homeassistant/#", "edge-fal/#")
CONFIG_KEYS = {
    "name",
    "unique_id",
    "state_topic",
    "value_template",
    "json_attributes_topic",
    "availability",
    "device",
    "origin",
}


def predictions(device: str, rows: list[tuple[int, float, float, float]], version: int = 3) -> PredictionBatch:
    """A batch of `rows` (class index, probability, uncertainty, time), classes named as the spec names them."""
    return PredictionBatch(
        device_id=device,
        serving_version=version,
        model_hash="ab" * 32,
        files=[f"2026/05/{index:02d}.jpg" for index in range(len(rows))],
        content_hashes=[f"{index:064x}" for index in range(len(rows))],
        class_indices=[row[0] for row in rows],
        class_names=[CLASSES[row[0]] if row[0] < len(CLASSES) else "ghost" for row in rows],
        probabilities=[row[1] for row in rows],
        uncertainties=[row[2] for row in rows],
        times=[row[3] for row in rows],
    )


class HomeAssistantView:
    """A plain paho client that reads what Home Assistant reads: subscribed to `homeassistant/#` and the bridge's
    `edge-fal/#` (retain flags as published), keeping each topic's latest payload and retain flag."""

    def __init__(self, port: int, login: Credentials | None = None, filters: tuple[str, ...] = VIEWED) -> None:
        self.seen: dict[str, tuple[bytes, bool]] = {}
        self.lock = threading.Lock()
        self.filters = filters
        self.client = paho.Client(paho.CallbackAPIVersion.VERSION2, client_id="home-assistant", protocol=paho.MQTTv5)
        if login is not None:
            self.client.username_pw_set(login.username, login.password)
        self.client.on_connect = self.on_connect
        self.client.on_message = self.on_message
        self.client.connect("127.0.0.1", port)
        self.client.loop_start()

    def on_connect(self, client, userdata, flags, reason_code, properties) -> None:
        options = SubscribeOptions(qos=1, retainAsPublished=True)
        client.subscribe([(name, options) for name in self.filters])

    def on_message(self, client, userdata, message) -> None:
        with self.lock:
            self.seen[message.topic] = (bytes(message.payload), bool(message.retain))

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()

    def configs(self) -> dict[str, dict[str, Any]]:
        """Every discovery config read, parsed (a config must be a JSON object)."""
        with self.lock:
            found = {topic: seen for topic, seen in self.seen.items() if topic.startswith("homeassistant/")}
        return {topic: json.loads(payload) for topic, (payload, _) in found.items()}

    def payload(self, topic: str) -> bytes | None:
        with self.lock:
            return self.seen.get(topic, (None, False))[0]

    def retained(self, topic: str) -> bool:
        with self.lock:
            return self.seen[topic][1]

    def state(self, topic: str) -> dict[str, Any] | None:
        payload = self.payload(topic)
        return None if payload is None else json.loads(payload)


@pytest.fixture
def home_assistant(broker):
    """Home Assistant's reading of the test's broker (connect another after a broker restart)."""
    views: list[HomeAssistantView] = []

    def view() -> HomeAssistantView:
        views.append(HomeAssistantView(broker.port))
        return views[-1]

    yield view
    for opened in views:
        opened.close()


def start_bridge(broker, log_file: Path, processes: list, *options: str) -> subprocess.Popen:
    """`fl-coordinator ha-bridge` on the test's broker, logging at info to `log_file` (the fleet: FLEET, unless the
    options name a credential file)."""
    fleet = [] if "--credentials" in options else ["--fleet", FLEET]
    command = [sys.executable, "-m", "coordinator", "ha-bridge", "--broker", broker.address.url, *fleet]
    with open(log_file, "ab") as stream:
        process = subprocess.Popen([*command, "--log-level", "info", *options], stdout=stream, stderr=subprocess.STDOUT)
    processes.append(process)
    return process


def publish_status(session, device: str, state: str, profile: str = "", fleet: str = FLEET) -> None:
    status = messages.Status(device, state, 1.0, profile=profile)
    session.publish(topics.STATUS.build(fleet=fleet, device=device), wire.encode(status), retain=True)


def publish_batch(session, device: str, payload: bytes, fleet: str = FLEET) -> None:
    session.publish(topics.PREDICTIONS.build(fleet=fleet, device=device), payload)


def expected_state(batch: PredictionBatch) -> dict[str, Any]:
    """The newest row of the batch as the device's predictions log holds it (`rows()`), in the state's keys."""
    row = max(batch.rows(), key=lambda line: line["time"])
    return {key: row[key] for key in ("class_name", "class_index", "probability", "uncertainty", "serving_version")}


def test_home_assistant_ids_keep_to_its_characters_and_two_cameras_never_share_one() -> None:
    assert ha_id("cam-07_a") == "cam-07_a"
    dotted, underscored = ha_id("cam.2"), ha_id("cam_2")
    assert HA_ID.match(dotted) and dotted != underscored and dotted.startswith("cam_2-")
    where = SensorTopics("site.a")
    assert where.discovery("cam.2").split("/")[2:4] == [ha_id("edge-fal_site.a"), dotted]
    configs = [discovery_config(where, Camera(device)) for device in ("cam.2", "cam_2")]
    assert configs[0]["unique_id"] != configs[1]["unique_id"]
    assert "sw_version" not in configs[0]["device"]  # unknown until a prediction names the serving version
    assert discovery_config(where, Camera("cam_2", "", 4))["device"]["sw_version"] == "serving version 4"


def test_a_sensors_state_is_its_batchs_newest_prediction() -> None:
    batch = predictions("cam-1", [(1, 0.9, 0.1, 1_700_000_002.0), (2, 0.6, 0.8, 1_700_000_001.0)])
    state = prediction_state(batch)
    assert state is not None and state["class_name"] == "person" and state["uncertain"] is False
    assert state["predicted_at"] == "2023-11-14T22:13:22+00:00" and state["file"] == "2026/05/00.jpg"
    assert prediction_state(predictions("cam-1", [])) is None
    assert prediction_state(predictions("cam-1", [(0, 0.5, 0.9, -5.0)]))["predicted_at"] is None  # a broken clock


def test_a_batch_whose_class_the_fleet_lacks_is_refused_given_the_fleets_classes() -> None:
    check_batch(predictions("cam-1", [(3, 0.5, 0.5, 1.0)]), CLASSES)
    with pytest.raises(BatchError, match="class index 7 is not below the fleet's 4 classes"):
        check_batch(predictions("cam-1", [(7, 0.5, 0.5, 1.0)]), CLASSES)
    renamed = predictions("cam-1", [(1, 0.5, 0.5, 1.0)])
    with pytest.raises(BatchError, match="class 1 is named 'person', not 'empty'"):
        check_batch(renamed, ("person", "empty"))


@pytest.mark.parametrize(
    ("options", "error"),
    [
        ([], "--fleet is required without --credentials"),
        (["--fleet", "plant", "--discovery-prefix", "home/assistant"], "discovery prefix 'home/assistant' must be"),
        (["--fleet", "plant/a"], "fleet 'plant/a' must be"),
        (["--fleet", "plant", "--model-spec", "absent.toml"], "absent.toml"),
    ],
)
def test_a_bad_flag_is_one_line_and_exit_2(options: list[str], error: str, capsys) -> None:
    assert main(["ha-bridge", "--broker", "mqtt://127.0.0.1:1", *options]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and error in lines[0], lines


def test_home_assistant_reads_a_sensor_per_camera_its_latest_prediction_and_its_availability(
    broker, tmp_path: Path, processes, sessions, home_assistant
) -> None:
    """Three cameras (two whose ids differ only where Home Assistant's ids allow no '.'): a retained discovery
    config each, JSON states matching what the devices published, availability from their status and last will;
    garbage, a wrong kind, a class the spec lacks, a negative version and a batch naming another device are refused
    (logged once, counted) and a good batch after them still comes through; SIGTERM leaves the bridge offline."""
    devices = sessions(broker.address, "devices")
    profiles = {"cam-1": "raspberry-pi-zero-2w", "cam.2": "jetson-nano", "cam_2": ""}
    for device, profile in profiles.items():
        publish_status(devices, device, "idle", profile)
    log_file = tmp_path / "bridge.log"
    bridge = start_bridge(broker, log_file, processes, "--model-spec", str(SPEC))
    view = home_assistant()
    where = SensorTopics(FLEET)
    wait_until(lambda: len(view.configs()) == 3, "a discovery config per camera", WAIT)

    configs = view.configs()
    assert sorted(configs) == sorted(where.discovery(device) for device in profiles)
    assert all(view.retained(topic) for topic in configs)
    for topic, config in configs.items():
        assert set(config) >= CONFIG_KEYS, topic
        node, object_id = topic.split("/")[2:4]
        assert topic.startswith("homeassistant/sensor/") and HA_ID.match(node) and HA_ID.match(object_id)
        assert set(config["device"]) >= {"identifiers", "name", "model", "manufacturer"}
        assert config["origin"]["name"] and config["value_template"] == "{{ value_json.class_name }}"
        assert config["json_attributes_topic"] == config["state_topic"]
        for entry in config["availability"]:
            assert (entry["payload_available"], entry["payload_not_available"]) == (ONLINE, OFFLINE)
    assert len({config["unique_id"] for config in configs.values()}) == 3
    assert configs[where.discovery("cam-1")]["device"]["model"] == "raspberry-pi-zero-2w"
    wait_until(lambda: view.payload(where.bridge) == b"online", "the bridge online", WAIT)
    for device in profiles:
        wait_until(lambda device=device: view.payload(where.availability(device)) == b"online", "online", WAIT)

    published = {
        "cam-1": predictions("cam-1", [(1, 0.91, 0.12, 1_780_000_000.0), (2, 0.55, 0.71, 1_780_000_009.5)]),
        "cam.2": predictions("cam.2", [(3, 0.8, 0.2, 1_780_000_003.0)], version=4),
    }
    for device, batch in published.items():
        publish_batch(devices, device, wire.encode(batch))
    for device, batch in published.items():
        wait_until(lambda device=device: view.state(where.state(device)) is not None, f"{device}'s state", WAIT)
        state = view.state(where.state(device))
        assert {key: state[key] for key in expected_state(batch)} == expected_state(batch)
        assert view.retained(where.state(device))
    assert view.state(where.state("cam-1"))["uncertain"] is True
    assert view.state(where.state("cam_2")) is None  # no prediction yet: no state
    wait_until(lambda: "sw_version" in view.configs()[where.discovery("cam.2")]["device"], "the version", WAIT)
    assert view.configs()[where.discovery("cam.2")]["device"]["sw_version"] == "serving version 4"

    malformed = [
        b"\x00garbage" * 50,
        wire.encode(messages.Status("cam-1", "idle", 1.0)),  # a valid message of the wrong kind
        wire.encode(predictions("cam-1", [(7, 0.9, 0.1, 1_780_000_010.0)])),  # a class the spec lacks
        wire.encode(predictions("cam-1", [(0, 0.9, 0.1, 1_780_000_010.0)], version=-1)),
        wire.encode(predictions("cam-2", [(0, 0.9, 0.1, 1_780_000_010.0)])),  # names another device
    ]
    for payload in malformed:
        publish_batch(devices, "cam-1", payload)
    after = predictions("cam-1", [(0, 0.97, 0.03, 1_780_000_020.0)], version=5)
    publish_batch(devices, "cam-1", wire.encode(after))
    wait_until(lambda: view.state(where.state("cam-1"))["class_name"] == "empty", "the good batch after", WAIT)
    assert {key: view.state(where.state("cam-1"))[key] for key in expected_state(after)} == expected_state(after)

    will = last_will(AgentSettings(FLEET, "cam.2"))  # what the broker publishes when the device dies
    devices.publish(will.topic, will.payload, retain=will.retain)
    wait_until(lambda: view.payload(where.availability("cam.2")) == b"offline", "cam.2 offline", WAIT)
    publish_status(devices, "cam.2", "training", "jetson-nano")
    wait_until(lambda: view.payload(where.availability("cam.2")) == b"online", "cam.2 back online", WAIT)

    assert bridge.poll() is None
    bridge.send_signal(signal.SIGTERM)
    assert wait_exit(bridge, "the bridge", WAIT) == 0
    wait_until(lambda: view.payload(where.bridge) == b"offline", "the bridge offline", WAIT)
    log = log_file.read_text()
    refusals = [line for line in log.splitlines() if "predictions refused" in line]
    assert len(refusals) == 1 and "device=cam-1" in refusals[0] and len(refusals[0]) < 400, refusals
    assert "refused_batches=5" in log and "cameras=3" in log and "Traceback" not in log


def test_a_relays_site_devices_are_cameras_of_their_own_available_while_their_relay_is(
    broker, tmp_path: Path, processes, sessions, home_assistant
) -> None:
    """`--relay relay-1`: a batch of its site device dev-00 on its relayed predictions topic becomes camera
    relay-1/dev-00 (its topics' level an HA id); the same from a device not named as a relay is refused; the
    relay's last will takes its site cameras offline with it."""
    devices = sessions(broker.address, "devices")
    publish_status(devices, "relay-1", "idle")
    log_file = tmp_path / "bridge.log"
    bridge = start_bridge(broker, log_file, processes, "--model-spec", str(SPEC), "--relay", "relay-1")
    view = home_assistant()
    where = SensorTopics(FLEET)
    wait_until(lambda: view.payload(where.availability("relay-1")) == b"online", "the relay online", WAIT)
    site = predictions("dev-00", [(2, 0.88, 0.1, 1_780_000_000.0)])
    for sender in ("cam-9", "relay-1"):
        devices.publish(topics.RELAYED_PREDICTIONS.build(fleet=FLEET, device=sender), wire.encode(site))
    camera = "relay-1/dev-00"
    wait_until(lambda: view.state(where.state(camera)) is not None, "the site device's state", WAIT)
    assert where.state(camera) == f"edge-fal/{FLEET}/{ha_id(camera)}/state" and HA_ID.match(ha_id(camera))
    state = view.state(where.state(camera))
    assert {key: state[key] for key in expected_state(site)} == expected_state(site)
    config = view.configs()[where.discovery(camera)]
    assert config["device"]["name"] == camera and config["unique_id"] == f"edge-fal:{FLEET}:{camera}"
    assert view.payload(where.availability(camera)) == b"online"
    assert where.discovery("cam-9/dev-00") not in view.configs()  # cam-9 is no relay: its batch refused
    will = last_will(AgentSettings(FLEET, "relay-1"))
    devices.publish(will.topic, will.payload, retain=will.retain)
    wait_until(lambda: view.payload(where.availability(camera)) == b"offline", "the site camera offline", WAIT)
    bridge.send_signal(signal.SIGTERM)
    assert wait_exit(bridge, "the bridge", WAIT) == 0
    log = log_file.read_text()
    assert "device=cam-9" in log and "not named as a relay" in log and "Traceback" not in log


def test_the_bridge_publishes_its_sensors_again_after_a_broker_restart_that_lost_them(
    broker, tmp_path: Path, processes, sessions, home_assistant
) -> None:
    """mosquitto stops and comes back on the same port without its store (the retained configs and states gone with
    it): the bridge reconnects by itself and publishes them again, and a prediction after the restart comes through."""
    devices = sessions(broker.address, "devices")
    publish_status(devices, "cam-1", "idle")
    log_file = tmp_path / "bridge.log"
    start_bridge(broker, log_file, processes)
    where = SensorTopics(FLEET)
    view = home_assistant()
    wait_until(lambda: where.discovery("cam-1") in view.configs(), "the camera's config", WAIT)
    publish_batch(devices, "cam-1", wire.encode(predictions("cam-1", [(1, 0.9, 0.1, 1_780_000_000.0)])))
    wait_until(lambda: view.state(where.state("cam-1")) is not None, "the camera's state", WAIT)

    broker.stop()
    (broker.work_dir / "mosquitto.db").unlink()
    broker.start()
    again = home_assistant()
    wait_until(lambda: where.discovery("cam-1") in again.configs(), "the config again after the restart", WAIT)
    wait_until(lambda: again.state(where.state("cam-1")) is not None, "the state again", WAIT)
    assert again.state(where.state("cam-1"))["class_name"] == "person"
    assert again.retained(where.discovery("cam-1")) and again.retained(where.state("cam-1"))
    wait_until(lambda: again.payload(where.availability("cam-1")) == b"online", "the availability again", WAIT)
    wait_until(lambda: again.payload(where.bridge) == b"online", "the bridge online again", WAIT)

    later = predictions("cam-1", [(2, 0.8, 0.3, 1_780_000_100.0)])
    wait_until(lambda: devices.connected, "the device reconnected", WAIT)
    publish_batch(devices, "cam-1", wire.encode(later))
    wait_until(lambda: again.state(where.state("cam-1"))["class_name"] == "forklift", "a prediction after", WAIT)
    assert "republished=3" in log_file.read_text()


def test_on_a_provisioned_fleet_the_bridge_and_home_assistant_log_in_with_their_own_acl(
    tmp_path: Path, processes, sessions
) -> None:
    """`provision` writes ha-bridge.json and home-assistant.json: with the fleet's passwords and ACL on mosquitto the
    bridge (its fleet from its credential file) reads a device's status and predictions and publishes the sensor,
    Home Assistant's login reads it, and a device's login cannot write a discovery config."""
    secure = provision("site", 1, tmp_path / "secure", prefix="cam")
    lines = tuple(line for line in broker_config_lines(secure) if not line.startswith(("cafile", "certfile")))
    with EmbeddedBroker(tmp_path / "broker", extra_config=lines) as broker:
        device_login = load_credentials(secure.device_credentials("cam-00"))
        device = sessions(device_login.apply_to(broker.address), "cam-00")
        publish_status(device, "cam-00", "idle", fleet="site")
        bridge_file = secure.folder / "ha-bridge.json"
        bridge = start_bridge(broker, tmp_path / "bridge.log", processes, "--credentials", str(bridge_file))
        view = HomeAssistantView(
            broker.port, load_credentials(secure.folder / "home-assistant.json"), ("homeassistant/#", "edge-fal/site/#")
        )
        try:
            where = SensorTopics("site")
            wait_until(lambda: where.discovery("cam-00") in view.configs(), "the camera's config", WAIT)
            device.publish(where.discovery("cam-01"), b"{}", retain=True)  # refused by the ACL: never seen
            publish_batch(device, "cam-00", wire.encode(predictions("cam-00", [(1, 0.9, 0.1, 1.0)])), fleet="site")
            wait_until(lambda: view.state(where.state("cam-00")) is not None, "the camera's state", WAIT)
            assert view.state(where.state("cam-00"))["class_name"] == "person"
            assert list(view.configs()) == [where.discovery("cam-00")]  # the forgery came before the batch
        finally:
            view.close()
        bridge.send_signal(signal.SIGTERM)
        assert wait_exit(bridge, "the bridge", WAIT) == 0


NODE_RED_FLOW = re.compile(r"\*\*Node-RED\.\*\*.*?```json\n(.*?)```", re.DOTALL)


def test_the_node_red_flow_in_the_docs_imports_and_reads_the_state_topics_the_bridge_publishes() -> None:
    """docs/inference.md's flow parses as a Node-RED export: an `mqtt in` node whose topic matches every camera's
    state topic, wired to a `json` node, then a `switch` and a `debug` node, every wire naming a node of the flow;
    and the page names each topic the bridge publishes."""
    page = (ROOT / "docs" / "inference.md").read_text()
    found = NODE_RED_FLOW.search(page)
    assert found is not None
    nodes = {node["id"]: node for node in json.loads(found.group(1))}
    by_type = {node["type"]: node for node in nodes.values()}
    assert {"mqtt in", "mqtt-broker", "json", "switch", "debug"} <= set(by_type)
    reader = by_type["mqtt in"]
    where = SensorTopics("plant-a")
    assert all(paho.topic_matches_sub(reader["topic"], where.state(device)) for device in ("cam-07", "cam.2"))
    assert not paho.topic_matches_sub(reader["topic"], where.availability("cam-07"))
    assert reader["broker"] == by_type["mqtt-broker"]["id"]
    assert all(target in nodes for node in nodes.values() for output in node.get("wires", []) for target in output)
    assert reader["wires"] == [[by_type["json"]["id"]]] and by_type["json"]["wires"] == [[by_type["switch"]["id"]]]
    assert by_type["switch"]["wires"] == [[by_type["debug"]["id"]]]
    assert by_type["switch"]["property"] == "payload.class_name"
    for pattern in (topics.HA_DISCOVERY, topics.HA_STATE, topics.HA_AVAILABILITY, topics.HA_BRIDGE):
        shown = pattern.template.replace("{prefix}", "homeassistant").replace("{node}", "edge-fal_{fleet}")
        shown = shown.replace("{object}", "{device}").replace("{", "<").replace("}", ">")
        assert f"`{shown}`" in page, shown
