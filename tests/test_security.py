# Who may talk: provisioned passwords, ACL and TLS enforced by a real mosquitto; signatures by the coordinator.
from __future__ import annotations

import json
import queue
import ssl
import stat
from pathlib import Path

import paho.mqtt.client as paho
import pytest

from bench.simulate import BenchSettings, secure_bench, simulate
from coordinator.fleet.broker import EmbeddedBroker, embedded_broker
from coordinator.fleet.provision import broker_config_lines, device_names, load_secure_fleet, password_hash, provision
from coordinator.intake.observer import RoundResult
from coordinator.rounds.rules import RoundPolicy
from coordinator.setup.settings import InitSettings, ServerSettings
from coordinator.storage.store import RunStore
from edge_agent.learning.models import build_model, get_weights
from protocol import messages, topics, wire
from protocol.credentials import load_credentials
from protocol.model_spec import DEFAULT_SPEC
from protocol.mqtt import BrokerAddress

NUM_CLASSES = DEFAULT_SPEC.num_classes

pytestmark = pytest.mark.integration

FLEET = "sec"
WAIT = 10.0


@pytest.fixture(scope="module")
def fleet_dir(tmp_path_factory) -> Path:
    """One provisioned fleet (3 devices, TLS) shared by the module: key generation is the slow part."""
    folder = tmp_path_factory.mktemp("provisioned") / "fleet"
    provision(FLEET, 3, folder, tls=True)
    return folder


@pytest.fixture
def plain_broker(tmp_path, fleet_dir):
    """mosquitto with the fleet's password file and ACL on a plain TCP listener."""
    secure = load_secure_fleet(fleet_dir)
    lines = tuple(
        line for line in broker_config_lines(secure) if line.startswith(("allow_", "use_", "password_", "acl_"))
    )
    with EmbeddedBroker(tmp_path / "broker", extra_config=lines) as broker:
        yield broker


@pytest.fixture
def tls_broker(tmp_path, fleet_dir):
    """mosquitto with the fleet's password file, ACL and TLS listener."""
    secure = load_secure_fleet(fleet_dir)
    with EmbeddedBroker(tmp_path / "broker", extra_config=broker_config_lines(secure), tls=True) as broker:
        yield broker


class Client:
    """A raw paho MQTT v5 client that records CONNACK, SUBACK and PUBACK reason codes and received messages."""

    def __init__(
        self,
        address: BrokerAddress,
        client_id: str,
        username: str | None = None,
        password: str | None = None,
        tls_files: dict | None = None,
    ) -> None:
        self.events: queue.Queue = queue.Queue()
        self.client = paho.Client(paho.CallbackAPIVersion.VERSION2, client_id=client_id, protocol=paho.MQTTv5)
        if username is not None:
            self.client.username_pw_set(username, password)
        if tls_files is not None:
            self.client.tls_set(**tls_files)
        self.client.on_connect = lambda c, u, f, reason, p: self.events.put(("connack", reason.value))
        self.client.on_subscribe = lambda c, u, mid, reasons, p: self.events.put(("suback", reasons[0].value))
        self.client.on_publish = lambda c, u, mid, reason, p: self.events.put(("puback", reason.value))
        self.client.on_message = lambda c, u, m: self.events.put(("message", m.topic, bytes(m.payload)))
        self.client.on_disconnect = lambda c, u, f, reason, p: self.events.put(("disconnect", reason.value))
        self.address = address

    def connect(self) -> int:
        """The CONNACK reason code (0 = accepted); -1 when the TLS handshake itself fails."""
        try:
            self.client.connect(self.address.host, self.address.port)
        except ssl.SSLError:
            return -1
        self.client.loop_start()
        return self.expect("connack")[1]

    def expect(self, kind: str, timeout: float = WAIT):
        """The next event of this kind (others are skipped); fails the test after the timeout."""
        while True:
            event = self.events.get(timeout=timeout)
            if event[0] == kind:
                return event

    def drain(self, wait: float = 1.0) -> list[tuple]:
        """Every event until none comes for `wait` seconds."""
        received = []
        try:
            while True:
                received.append(self.events.get(timeout=wait))
        except queue.Empty:
            return received

    def messages(self, wait: float = 1.0) -> list[tuple]:
        """Every message received within `wait` seconds."""
        return [event for event in self.drain(wait) if event[0] == "message"]

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()


def login(address: BrokerAddress, fleet_dir: Path, who: str, tls: bool = False, client_id: str = "") -> Client:
    """A connected client with the credentials from the provisioned folder ('coordinator', 'labelling' or a device
    id)."""
    path = fleet_dir / (f"{who}.json" if who in ("coordinator", "labelling") else f"devices/{who}.json")
    credentials = load_credentials(path)
    tls_files = (
        {"ca_certs": credentials.ca_file, "certfile": credentials.cert_file, "keyfile": credentials.key_file}
        if tls
        else None
    )
    client = Client(address, client_id or f"client-{who}", credentials.username, credentials.password, tls_files)
    assert client.connect() == 0
    return client


def test_provision_writes_private_secrets_and_mosquitto_compatible_hashes(fleet_dir) -> None:
    assert device_names(3) == ["dev-00", "dev-01", "dev-02"]
    secrets = [
        "passwd",
        "keys.json",
        "labelling-keys.json",
        "coordinator.json",
        "labelling.json",
        "ha-bridge.json",
        "home-assistant.json",
        "devices/dev-01.json",
    ]
    secrets.append("tls/ca.key")
    for secret in [*secrets, "tls/broker.key"]:
        assert stat.S_IMODE((fleet_dir / secret).stat().st_mode) == 0o600, secret
    users = [line.split(":")[0] for line in (fleet_dir / "passwd").read_text().splitlines()]
    assert users == ["coordinator", "labelling", "ha-bridge", "home-assistant", "dev-00", "dev-01", "dev-02"]
    keys = json.loads((fleet_dir / "keys.json").read_text())
    credentials = load_credentials(fleet_dir / "devices" / "dev-01.json")
    assert credentials.hmac_key.hex() == keys["dev-01"] and len(credentials.hmac_key) == 32
    assert len(set(keys.values())) == 3
    assert "%c" not in (fleet_dir / "acl").read_text()
    salt = bytes(range(12))
    assert password_hash("secret", salt) == password_hash("secret", salt) != password_hash("other", salt)
    with pytest.raises(ValueError, match="already holds a provisioned fleet"):
        provision(FLEET, 2, fleet_dir)


def test_a_device_cannot_connect_without_its_password(plain_broker, fleet_dir) -> None:
    anonymous = Client(plain_broker.address, "dev-00")
    assert anonymous.connect() == 0x87  # Not authorized
    anonymous.close()
    wrong = Client(plain_broker.address, "dev-00", "dev-00", "not-the-password")
    assert wrong.connect() == 0x87  # mosquitto 2.0 answers a wrong password with Not authorized too
    wrong.close()
    login(plain_broker.address, fleet_dir, "dev-00").close()


def test_a_device_cannot_publish_as_another_device_even_with_its_client_id(plain_broker, fleet_dir) -> None:
    coordinator = login(plain_broker.address, fleet_dir, "coordinator")
    coordinator.client.subscribe(topics.UPDATE.filter(fleet=FLEET), qos=1)
    assert coordinator.expect("suback")[1] == 1
    intruder = login(plain_broker.address, fleet_dir, "dev-00", client_id="dev-01")
    intruder.client.publish(topics.UPDATE.build(fleet=FLEET, device="dev-01"), b"forged", qos=1)
    assert intruder.expect("puback")[1] == 0x87  # Not authorized
    intruder.client.publish(topics.UPDATE.build(fleet=FLEET, device="dev-00"), b"own", qos=1)
    assert intruder.expect("puback")[1] == 0
    assert [m[1:] for m in coordinator.messages()] == [(topics.UPDATE.build(fleet=FLEET, device="dev-00"), b"own")]
    for client in (coordinator, intruder):
        client.close()


def test_a_device_login_cannot_take_over_the_coordinators_or_another_devices_session(plain_broker, fleet_dir) -> None:
    coordinator = login(plain_broker.address, fleet_dir, "coordinator", client_id=f"coordinator-{FLEET}")
    coordinator.client.subscribe(topics.UPDATE.filter(fleet=FLEET), qos=1)
    assert coordinator.expect("suback")[1] == 1
    device = login(plain_broker.address, fleet_dir, "dev-00", client_id="dev-00")
    update_topic = topics.UPDATE.build(fleet=FLEET, device="dev-00")
    for stolen_id in (f"coordinator-{FLEET}", "dev-00"):
        intruder = login(plain_broker.address, fleet_dir, "dev-01", client_id=stolen_id)
        device.client.publish(update_topic, f"sent while dev-01 posed as {stolen_id}".encode(), qos=1)
        assert device.expect("puback")[1] == 0
        intruder.close()
    heard = coordinator.drain()
    assert [event for event in heard if event[0] == "disconnect"] == []
    assert [event[2] for event in heard if event[0] == "message"] == [
        f"sent while dev-01 posed as coordinator-{FLEET}".encode(),
        b"sent while dev-01 posed as dev-00",
    ]
    assert [event for event in device.drain(0.2) if event[0] == "disconnect"] == []
    for client in (coordinator, device):
        client.close()


def test_a_device_reads_its_own_acks_and_the_round_but_not_another_device_acks(plain_broker, fleet_dir) -> None:
    snoop = login(plain_broker.address, fleet_dir, "dev-00")
    for topic in (
        topics.ACK.build(fleet=FLEET, device="dev-01"),
        topics.ACK.build(fleet=FLEET, device="dev-00"),
        topics.ROUND.build(fleet=FLEET),
    ):
        snoop.client.subscribe(topic, qos=1)
    granted = [snoop.expect("suback")[1] for _ in range(3)]
    assert granted == [1, 1, 1]  # mosquitto 2.0 grants the subscription but never delivers what the ACL forbids
    coordinator = login(plain_broker.address, fleet_dir, "coordinator")
    for device in ("dev-01", "dev-00"):
        coordinator.client.publish(topics.ACK.build(fleet=FLEET, device=device), device.encode(), qos=1)
        assert coordinator.expect("puback")[1] == 0
    coordinator.client.publish(topics.ROUND.build(fleet=FLEET), b"round", qos=1)
    assert [m[2] for m in snoop.messages()] == [b"dev-00", b"round"]
    for client in (coordinator, snoop):
        client.close()


def test_the_labelling_login_reads_queries_and_receipts_and_writes_answers_only(plain_broker, fleet_dir) -> None:
    desk = login(plain_broker.address, fleet_dir, "labelling")
    for topic in (topics.LABEL_QUERIES, topics.LABELLING_UP, topics.UPDATE):
        desk.client.subscribe(topic.filter(fleet=FLEET), qos=1)
        assert desk.expect("suback")[1] == 1
    device = login(plain_broker.address, fleet_dir, "dev-00")
    for topic in (topics.LABEL_QUERIES, topics.LABELLING_UP, topics.UPDATE):
        device.client.publish(topic.build(fleet=FLEET, device="dev-00"), topic.template.encode(), qos=1)
        assert device.expect("puback")[1] == 0
    assert sorted(m[2] for m in desk.messages()) == sorted(
        [topics.LABEL_QUERIES.template.encode(), topics.LABELLING_UP.template.encode()]
    ), "no update reaches the labelling desk"
    device.client.subscribe(topics.LABELLING_DOWN.build(fleet=FLEET, device="dev-00"), qos=1)
    assert device.expect("suback")[1] == 1
    desk.client.publish(topics.LABELLING_DOWN.build(fleet=FLEET, device="dev-00"), b"answer", qos=1)
    assert desk.expect("puback")[1] == 0
    for forbidden in (topics.ROUND.build(fleet=FLEET), topics.UPDATE.build(fleet=FLEET, device="dev-00")):
        desk.client.publish(forbidden, b"forged", qos=1)
        assert desk.expect("puback")[1] == 0x87  # Not authorized
    assert [m[2] for m in device.messages()] == [b"answer"]
    for client in (desk, device):
        client.close()


def test_tls_with_the_generated_ca_works_and_without_it_fails(tls_broker, fleet_dir) -> None:
    device = login(tls_broker.address, fleet_dir, "dev-02", tls=True)
    device.client.publish(topics.STATUS.build(fleet=FLEET, device="dev-02"), b"online", qos=1)
    assert device.expect("puback")[1] == 0x10  # accepted, no matching subscribers
    device.close()
    credentials = load_credentials(fleet_dir / "devices" / "dev-02.json")
    system_cas_only = Client(
        tls_broker.address,
        "dev-02",
        credentials.username,
        credentials.password,
        {"certfile": credentials.cert_file, "keyfile": credentials.key_file},
    )
    with pytest.raises(ssl.SSLCertVerificationError):
        system_cas_only.client.connect(tls_broker.address.host, tls_broker.address.port)
    plain = Client(tls_broker.address, "dev-02", credentials.username, credentials.password)
    plain.client.connect(tls_broker.address.host, tls_broker.address.port)
    plain.client.loop_start()
    with pytest.raises(queue.Empty):
        plain.expect("connack", timeout=3)
    plain.client.loop_stop()


class Forger:
    """Holds a provisioned device's broker login (dev-02, which runs no agent: the broker gives one login one
    session) but not its HMAC key: answers round 1 with a well-formed, wrongly signed update."""

    def __init__(self, address: BrokerAddress, fleet_dir: Path) -> None:
        credentials = load_credentials(fleet_dir / "devices" / "dev-02.json")
        self.client = Client(
            address,
            "dev-02-forger",
            credentials.username,
            credentials.password,
            {"ca_certs": credentials.ca_file, "certfile": credentials.cert_file, "keyfile": credentials.key_file},
        )
        self.client.client.on_message = self.on_message
        self.acks: queue.Queue = queue.Queue()

    def start(self) -> None:
        assert self.client.connect() == 0
        self.client.client.subscribe(topics.ROUND.build(fleet=FLEET), qos=1)
        self.client.client.subscribe(topics.ACK.build(fleet=FLEET, device="dev-02"), qos=1)

    def on_message(self, client, userdata, message) -> None:
        if message.topic == topics.ROUND.build(fleet=FLEET) and message.payload:
            announcement = wire.decode(message.payload, messages.RoundAnnouncement)
            if announcement.final:
                return
            forged = messages.Update(
                "dev-02",
                announcement.round_id,
                "forged",
                announcement.model_hash,
                10,
                [1] * NUM_CLASSES,
                0,
                {},
                get_weights(build_model()),
                nonce=b"n" * 16,
            )
            payload = wire.signed(wire.encode(forged), b"guessed key")
            client.publish(topics.UPDATE.build(fleet=FLEET, device="dev-02"), payload, qos=1)
        elif message.topic.endswith("/ack"):
            self.acks.put(wire.decode(message.payload, messages.Ack))


def test_a_secured_bench_run_completes_and_rejects_a_forged_update(tmp_path) -> None:
    """2 agents over TLS with passwords, ACL and signed updates; a forger with dev-02's login is turned away."""
    settings = ServerSettings(
        run_dir=tmp_path / "run",
        fleet=FLEET,
        strategy="avefl",
        recipe=messages.Recipe(sampler="entropy", labels_per_acquisition=20, epochs=1, mc_passes=2, batch_size=10),
        policy=RoundPolicy(rounds=1, min_devices=2, quorum=2, round_timeout=120),
        init=InitSettings(samples=20, epochs=1),
        validation_samples=50,
        test_samples=200,
        secure_dir=tmp_path / "secure",
    )
    provision(FLEET, 3, tmp_path / "secure", tls=True)
    bench = BenchSettings(devices=2, partition="iid", pool_size=60, secure=True, tls=True)
    secure = secure_bench(settings, bench)
    results: list[RoundResult] = []
    with embedded_broker(tmp_path / "broker", secure) as broker:
        forger = Forger(broker.address, secure.folder)
        forger.start()
        simulate(settings, bench, results.append, broker.address)
        forged_ack = forger.acks.get(timeout=WAIT)
        forger.client.close()
    assert not forged_ack.accepted and forged_ack.update_id == "forged"
    assert forged_ack.reason == "bad signature: the HMAC does not match 'dev-02''s key"
    assert [r.round_id for r in results] == [1] and sorted(results[0].device_accuracy) == ["dev-00", "dev-01"]
    with RunStore(settings.run_dir) as store:
        assert store.rounds()[0].accepted == 2
        assert store.rejection_counts() == {forged_ack.reason: 1}
