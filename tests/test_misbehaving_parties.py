# The field loop keeps running when one party misbehaves, with real processes: a plain paho + msgpack client (none
# of the project's code) sends the labelling desk of `fl-coordinator labelling serve` non-finite, out-of-range and
# out-of-folder queries, and forges an answer to a real `edge-agent run --labelling central`; the desk's images sit
# on a full tmpfs. Every part keeps working or comes back by itself, the sender is named in /metrics, nothing is
# redelivered forever, and no answer is lost.
from __future__ import annotations

import io
import json
import queue
import signal
import subprocess
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import msgpack
import numpy as np
import paho.mqtt.client as paho
import pytest
from browser import free_port, wait_for
from PIL import Image
from test_central_labelling import FLEET, TOKEN, asked_queries, desk, device, index_of, labelled, open_count, start
from tmpfs import fill_leaving, mounted_tmpfs

from coordinator.fleet.broker import EmbeddedBroker
from coordinator.fleet.provision import LABELLING_KEYS, broker_config_lines, load_secure_fleet, provision
from coordinator.labelling.queue_schema import IMAGES, QUEUE_FOLDER
from edge_agent.data.query_store import QueryStore
from edge_agent.field.folder_oracle import QueryBook
from protocol import wire
from protocol.credentials import load_credentials
from protocol.label_messages import LabelAnswer, LabelCorrection
from protocol.label_signing import labelling_key, sign

pytestmark = pytest.mark.integration

SENDER = "cam-x"


def packed(kind: str, **fields: object) -> bytes:
    """A wire message as a malicious client writes it: plain msgpack, no project code."""
    return msgpack.packb({"v": 2, "kind": kind, **fields}, use_bin_type=True)


def png() -> bytes:
    """A small real PNG."""
    buffer = io.BytesIO()
    Image.fromarray(np.zeros((8, 8), dtype=np.uint8)).save(buffer, format="PNG")
    return buffer.getvalue()


def query(query_id: str, **changed: object) -> bytes:
    """A query of the attacker's device as plain msgpack, with any field changed."""
    fields: dict[str, object] = {
        "device_id": SENDER,
        "query_id": query_id,
        "image": png(),
        "media_type": "image/png",
        "asked_at": 1.7e9,
    }
    return packed("label_query", **{**fields, **changed})


class PlainClient:
    """A paho client of its own, reading what the desk sends the device it claims to be."""

    inbox: queue.Queue[tuple[str, dict]]

    def __init__(self, port: int, client_id: str) -> None:
        self.inbox: queue.Queue[tuple[str, dict]] = queue.Queue()
        self.client = paho.Client(paho.CallbackAPIVersion.VERSION2, client_id=client_id, protocol=paho.MQTTv5)
        self.client.on_message = lambda c, u, m: self.inbox.put((m.topic, msgpack.unpackb(m.payload)))
        self.client.connect("127.0.0.1", port)
        self.client.loop_start()

    def send(self, topic: str, payload: bytes) -> None:
        self.client.publish(topic, payload, qos=1).wait_for_publish(timeout=10)

    def receipt(self, timeout: float = 20.0) -> dict:
        return self.inbox.get(timeout=timeout)[1]

    def close(self) -> None:
        self.client.loop_stop()
        self.client.disconnect()


def queued_receipt(query_id: str) -> dict:
    """The desk's receipt of a queued query, as the plain client unpacks it."""
    return {"v": 2, "kind": "query_receipt", "query_id": query_id, "queued": True, "refusal": ""}


def metrics(url: str) -> str:
    """The desk's /metrics body."""
    request = urllib.request.Request(url + "metrics", headers={"Authorization": f"Bearer {TOKEN}"})
    with urllib.request.urlopen(request, timeout=5) as response:
        return response.read().decode()


def metrics_when(url: str, name_and_labels: str, value: float, what: str, timeout: float = 30) -> str:
    """The /metrics body once one sample holds `value`."""
    return wait_for(lambda: (body := metrics(url)) and sample(body, name_and_labels) == value and body, timeout, what)


def sample(text: str, name_and_labels: str) -> float:
    """One sample's value in a /metrics body (0 when it is absent)."""
    for line in text.splitlines():
        if line.startswith(name_and_labels + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


@contextmanager
def running_desk(root: Path, broker: EmbeddedBroker) -> Iterator[tuple[str, subprocess.Popen]]:
    """`fl-coordinator labelling serve` until the with-block ends (SIGTERM)."""
    port = free_port()
    url = f"http://127.0.0.1:{port}/"
    process = desk(broker, root, port)
    try:
        wait_for(lambda: _up(url), 60, "the desk's page")
        yield url, process
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=30)


def _up(url: str) -> bool:
    try:
        metrics(url)
        return True
    except OSError:
        return False


@pytest.fixture()
def attacked(tmp_path: Path) -> Iterator[tuple[EmbeddedBroker, PlainClient]]:
    """A broker and the attacker's plain client on it, reading what the desk sends the device it claims to be."""
    with EmbeddedBroker(tmp_path / "broker") as broker:
        attacker = PlainClient(broker.port, SENDER)
        attacker.client.subscribe(f"fl/{FLEET}/devices/{SENDER}/labelling_in", qos=1)
        try:
            yield broker, attacker
        finally:
            attacker.close()


def test_non_finite_out_of_range_and_out_of_folder_queries_are_refused_and_never_redelivered(
    tmp_path: Path, attacked: tuple[EmbeddedBroker, PlainClient]
) -> None:
    broker, attacker = attacked
    with running_desk(tmp_path, broker) as (url, _):
        topic = f"fl/{FLEET}/devices/{SENDER}/queries"
        for bad in (
            query("nan", asked_at=float("nan")),
            query("inf", probability=float("inf")),
            query("huge", score=1e300),
            query("wide", guess=2**64 - 1),
        ):
            attacker.send(topic, bad)
        attacker.send(f"fl/{FLEET}/devices/../queries", query("escape", device_id=".."))
        attacker.send(topic, query("good"))
        assert attacker.receipt() == queued_receipt("good")
        refused = f'fl_labelling_refused_total{{device="{SENDER}",kind="bad_message"}}'
        body = metrics_when(url, refused, 4, "four refusals naming the sender")
        assert sample(body, 'fl_labelling_refused_total{device="(topic)",kind="bad_topic"}') == 1
        assert sample(body, 'fl_part_up{part="labelling-desk"}') == 1
        assert open_count(url) == 1
    assert not list(tmp_path.rglob("escape*")), "no image written for the '..' device, inside the folder or out"
    log = (tmp_path / "desk.log").read_text()
    assert "Traceback" not in log and "must be a finite number" in log
    assert max(len(line) for line in log.splitlines()) < 600, "no log line grows with the input"

    with running_desk(tmp_path, broker) as (url, _):
        attacker.send(f"fl/{FLEET}/devices/{SENDER}/queries", query("after"))
        assert attacker.receipt()["query_id"] == "after"
        assert sample(metrics(url), f'fl_labelling_refused_total{{device="{SENDER}",kind="bad_message"}}') == 0, (
            "the refused messages were acknowledged: a restarted desk does not get them again"
        )


@pytest.fixture()
def full_tmpfs(tmp_path: Path) -> Iterator[Path]:
    """The queue's image folder on a tmpfs filled to the last page: the filler, to delete once space should come back."""
    with mounted_tmpfs(tmp_path / "run" / QUEUE_FOLDER / IMAGES) as images:
        yield fill_leaving(images, 0)


def test_a_full_disk_sets_the_query_aside_and_the_desk_comes_back(
    tmp_path: Path, full_tmpfs: Path, attacked: tuple[EmbeddedBroker, PlainClient]
) -> None:
    broker, attacker = attacked
    with running_desk(tmp_path, broker) as (url, process):
        topic = f"fl/{FLEET}/devices/{SENDER}/queries"
        attacker.send(topic, query("q1"))
        aside = f'fl_messages_set_aside_total{{part="labelling-desk",sender="{SENDER}"}}'
        text = metrics_when(url, aside, 1, "the query set aside after three failures")
        assert sample(text, 'fl_part_restarts_total{part="labelling-desk"}') == 2
        wait_for(lambda: sample(metrics(url), 'fl_part_up{part="labelling-desk"}') == 1, 10, "the desk up")
        full_tmpfs.unlink()
        attacker.send(topic, query("q1"))  # the device's resend, once there is room
        assert attacker.receipt() == queued_receipt("q1")
        assert open_count(url) == 1 and process.poll() is None
    log = (tmp_path / "desk.log").read_text()
    assert "No space left on device" in log and "message set aside" in log
    kept = list((tmp_path / "run" / QUEUE_FOLDER / "set-aside").glob("*.payload"))
    assert [path.read_bytes() for path in kept] == [query("q1")]


def test_a_forged_answer_with_a_non_finite_time_leaves_the_device_link_working(tmp_path: Path) -> None:
    state = asked_queries(tmp_path, "cam-a", 0)
    with EmbeddedBroker(tmp_path / "broker") as broker:
        forger = PlainClient(broker.port, "forger")
        processes: list[subprocess.Popen] = []
        try:
            with running_desk(tmp_path, broker) as (url, _):
                processes.append(device(broker, tmp_path, "cam-a"))
                wait_for(lambda: open_count(url) == 2, 60, "the device's queries in the queue")
                asked = [asked.query_id for asked in QueryBook(state / "labelling").queries()]
                forged = packed(
                    "label_answer", query_id=asked[0], label=1, answered_by="mallory", answered_at=float("nan")
                )
                forger.send(f"fl/{FLEET}/devices/cam-a/labelling_in", forged)
                _answer(url, "cam-a", asked[0], 5)
                wait_for(lambda: labelled(state) == {index_of(state, asked[0]): 5}, 30, "the person's answer stored")
                assert processes[0].poll() is None
            stored = QueryStore(state / "labelling" / "answers.sqlite").answers()
            assert [(a.label, a.answered_by) for a in stored] == [(5, "anonymous")]
            log = (tmp_path / "cam-a.log").read_text()
            assert "Traceback" not in log and "must be a finite number" in log
        finally:
            forger.close()
            for process in processes:
                process.kill()
                process.wait(timeout=30)


def _answer(url: str, device_id: str, query_id: str, label: int) -> None:
    """A person's answer through the page's API, with the token."""
    body = json.dumps({"device": device_id, "query_id": query_id, "label": label, "person": "anonymous"}).encode()
    request = urllib.request.Request(
        url + "api/label/answer",
        data=body,
        headers={"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"},
        method="POST",
    )
    with urllib.request.urlopen(request, timeout=5) as response:
        assert response.status == 200


@pytest.fixture(scope="module")
def secured_fleet(tmp_path_factory) -> Path:
    """A provisioned fleet of one device (no TLS: the ACL and the signatures are what is tested)."""
    folder = tmp_path_factory.mktemp("secured") / "fleet"
    provision(FLEET, 1, folder, prefix="cam")
    return folder


def test_in_a_secured_fleet_only_the_desks_signed_answers_count(tmp_path: Path, secured_fleet: Path) -> None:
    """A party holding the desk's broker login but not its keys (a leaked labelling.json, the broker's operator)
    sends the device an unsigned answer and correction and ones signed with a key of its own; with the coordinator's
    login it sends the desk a receipt for the device: the device stores only the person's answer, and the desk
    refuses the receipt, naming the device it claims."""
    state = asked_queries(tmp_path, "cam-00", 0)
    keys = json.loads((secured_fleet / LABELLING_KEYS).read_text())
    assert bytes.fromhex(keys["cam-00"]) == labelling_key(
        load_credentials(secured_fleet / "devices/cam-00.json").hmac_key
    )
    secure = load_secure_fleet(secured_fleet)
    lines = tuple(line for line in broker_config_lines(secure) if line.startswith(("allow_", "password_", "acl_")))
    port = free_port()
    url = f"http://127.0.0.1:{port}/"
    with EmbeddedBroker(tmp_path / "broker", extra_config=lines) as broker:
        desk_login = ["--credentials", str(secured_fleet / "labelling.json")]
        served = start(
            [
                *("coordinator", "labelling", "serve", str(tmp_path / "run"), "--broker", broker.address.url),
                *("--fleet", FLEET, "--dashboard", str(port), "--dashboard-token", TOKEN, "--resend-seconds", "1"),
                *desk_login,
            ],
            tmp_path / "desk.log",
        )
        login = load_credentials(secured_fleet / "labelling.json")
        forger = paho.Client(paho.CallbackAPIVersion.VERSION2, client_id="forger", protocol=paho.MQTTv5)
        forger.username_pw_set(login.username, login.password)
        agent: subprocess.Popen | None = None
        try:
            wait_for(lambda: _up(url), 60, "the desk's page (its desk subscribed before it)")
            agent = start(
                [
                    *("edge_agent", "run", "--broker", broker.address.url, "--fleet", FLEET),
                    *("--credentials", str(secured_fleet / "devices/cam-00.json")),
                    *("--pool-dir", str(tmp_path / "cam-00" / "camera"), "--state-dir", str(state)),
                    *("--labelling", "central", "--scan-interval", "0.3", "--settle-seconds", "0"),
                ],
                tmp_path / "cam-00.log",
            )
            wait_for(lambda: open_count(url) == 2, 60, "the device's queries in the secured queue")
            asked = [query.query_id for query in QueryBook(state / "labelling").queries()]
            assert forger.connect("127.0.0.1", broker.port) == 0
            forger.loop_start()
            fields = {"query_id": asked[0], "label": 1, "answered_by": "mallory", "answered_at": 1.7e9}
            own_key = labelling_key(b"\1" * 32)
            forged = LabelAnswer(**fields)
            change = {"query_id": asked[0], "label": 2, "revision": 7, "corrected_by": "mallory", "corrected_at": 1.7e9}
            for payload in (
                packed("label_answer", **fields),
                wire.encode(sign(forged, own_key, FLEET, "cam-00")),
                packed("label_correction", **change),
                wire.encode(sign(LabelCorrection(**change), own_key, FLEET, "cam-00")),
            ):
                forger.publish(f"fl/{FLEET}/devices/cam-00/labelling_in", payload, qos=1).wait_for_publish(10)
            receipt = packed("answer_receipt", device_id="cam-00", query_id=asked[0], stored=True)
            other = load_credentials(secured_fleet / "coordinator.json")  # the one other login that writes receipts
            forger.disconnect()
            forger.username_pw_set(other.username, other.password)
            assert forger.reconnect() == 0
            forger.publish(f"fl/{FLEET}/devices/cam-00/labelling", receipt, qos=1).wait_for_publish(10)
            _answer(url, "cam-00", asked[0], 5)
            wait_for(lambda: labelled(state) == {index_of(state, asked[0]): 5}, 30, "the person's answer stored")
            refused = 'fl_labelling_refused_total{device="cam-00",kind="bad_signature"}'
            wait_for(lambda: sample(metrics(url), refused) == 1, 10, "the forged receipt refused, naming the device")
        finally:
            forger.loop_stop()
            forger.disconnect()
            for process in (agent, served):
                if process is not None:
                    process.send_signal(signal.SIGTERM)
                    process.wait(timeout=30)
    device_log = (tmp_path / "cam-00.log").read_text()
    assert device_log.count("labelling message without the desk's signature ignored kind=label_answer") == 2
    assert device_log.count("labelling message without the desk's signature ignored kind=label_correction") == 2
    assert [(a.label, a.answered_by) for a in QueryStore(state / "labelling" / "answers.sqlite").answers()] == [
        (5, "anonymous")
    ]
    assert "labelling message refused device=cam-00 kind=bad_signature" in (tmp_path / "desk.log").read_text()
