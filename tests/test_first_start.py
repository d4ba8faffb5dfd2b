# A fleet's first start: the server's split from its data and strategy, the broker devices elsewhere reach, the lines.
from __future__ import annotations

import queue
import socket
import ssl
import subprocess
import sys
from pathlib import Path

import numpy as np
import paho.mqtt.client as paho
import pytest

from coordinator.commands.round_console import labels_words, peak_words
from coordinator.commands.run import broker_lines
from coordinator.fleet.broker import EmbeddedBroker, embedded_broker, free_loopback_port
from coordinator.fleet.provision import DEFAULT_TLS_HOSTS, load_secure_fleet, provision
from coordinator.intake.observer import RoundResult
from coordinator.rounds.holdout import SplitSizes, server_holdout, split_sizes
from edge_agent.data.image_arrays import DATASET_KEYS
from edge_agent.loop.profile import load_profile
from edge_agent.run_command import chosen_state_dir, settings_lines
from protocol.credentials import load_credentials
from protocol.errors import UsageError
from protocol.files import save_arrays
from protocol.mqtt import BrokerAddress, parse_broker_url

ROOT = Path(__file__).resolve().parent.parent
PI_ZERO = ROOT / "firmware_configs" / "raspberry-pi-zero-2w.toml"


def test_an_own_data_set_trains_w0_on_all_of_it_unless_the_strategy_selects() -> None:
    assert split_sizes(200, None, None, selects=False, own_data=True) == SplitSizes(None, 0)
    assert split_sizes(200, None, None, selects=True, own_data=True) == SplitSizes(None, 50)
    assert split_sizes(60000, None, None, selects=True, own_data=True) == SplitSizes(None, 1000)
    assert split_sizes(60000, None, None, selects=False, own_data=False) == SplitSizes(100, 1000)
    assert split_sizes(200, 100, 20, selects=True, own_data=True) == SplitSizes(100, 20)
    with pytest.raises(UsageError, match="--validation-samples N"):
        split_sizes(3, None, None, selects=True, own_data=True)


def test_w0_without_a_count_takes_every_image_outside_the_selection_split() -> None:
    labels = np.repeat(np.arange(5), [40, 40, 40, 40, 3])  # imbalanced: a balanced W0 could take 15 at most
    init, selection, rest = server_holdout(labels, None, 20, np.random.default_rng(0), 5)
    assert len(init) == 143 and len(selection) == 20 and len(rest) == 0
    assert np.array_equal(np.sort(np.concatenate([init, selection])), np.arange(163))


def test_a_split_the_data_cannot_give_names_its_flag() -> None:
    labels = np.repeat(np.arange(5), 40)
    with pytest.raises(
        UsageError, match=r"--validation-samples 1000: only 100 labelled images remain .*--init-samples"
    ):
        server_holdout(labels, 100, 1000, np.random.default_rng(0), 5)
    with pytest.raises(UsageError, match="--init-samples 300: class 0 has 40 labelled images"):
        server_holdout(labels, 300, 0, np.random.default_rng(0), 5)


def test_a_start_that_fails_on_its_split_is_one_line_and_leaves_no_run_folder(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (40, 8, 8, 3), dtype=np.uint8)
    labels = np.repeat(np.arange(2), 20)
    save_arrays(tmp_path / "site.npz", dict(zip(DATASET_KEYS, (images, labels, images, labels))))
    (tmp_path / "site.toml").write_text(
        '[model]\narchitecture = "mobilenet"\nwidth_multiplier = 0.25\n\n[input]\nchannels = 3\nheight = 8\nwidth = 8\n'
        'mean = [0.5, 0.5, 0.5]\nstd = [0.25, 0.25, 0.25]\n\n[classes]\nnames = ["a", "b"]\n'
    )
    run_dir = tmp_path / "run"
    result = subprocess.run(
        [sys.executable, "-m", "coordinator", "run", "--model-spec", "site.toml", "--dataset", "site.npz"]
        + ["--run-dir", str(run_dir), "--validation-samples", "1000", "--broker-listen", "127.0.0.1:1"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "fl-coordinator: --validation-samples 1000: the data set has only 40 labelled training images"
    ]
    assert not run_dir.exists()


def this_machines_address() -> str:
    """An address of this machine other than loopback (where a device on another machine would connect)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect(("192.0.2.1", 9))  # no packet is sent: this only picks the outgoing interface
        address = probe.getsockname()[0]
    if address.startswith("127."):
        pytest.skip("this machine has no address beyond loopback")
    return address


def connack(address: BrokerAddress, client_id: str, tls: dict | None = None, login: tuple | None = None) -> int:
    """The CONNACK reason code a plain paho client gets at `address` (-1: no connection or no CONNACK)."""
    answers: queue.Queue = queue.Queue()
    client = paho.Client(paho.CallbackAPIVersion.VERSION2, client_id=client_id, protocol=paho.MQTTv5)
    client.on_connect = lambda c, u, f, reason, p: answers.put(reason.value)
    if login:
        client.username_pw_set(*login)
    if tls:
        client.tls_set(**tls)
    try:
        client.connect(address.host, address.port)
    except (ssl.SSLError, OSError):
        return -1
    client.loop_start()
    try:
        return answers.get(timeout=5)
    except queue.Empty:
        return -1
    finally:
        client.loop_stop()
        client.disconnect()


@pytest.mark.integration
def test_the_embedded_broker_listens_where_it_is_told_and_says_how_devices_reach_it(tmp_path: Path) -> None:
    host, port = this_machines_address(), free_loopback_port()
    with EmbeddedBroker(tmp_path / "broker", port=port, host="0.0.0.0") as broker:
        assert broker.address == BrokerAddress("127.0.0.1", port)
        assert connack(BrokerAddress(host, port), "cam-1") == 0
        lines = broker_lines(broker, reachable=True)
    assert lines[0] == f"embedded broker listening at mqtt://0.0.0.0:{port}"
    assert lines[1] == f"devices connect with --broker mqtt://HOST:{port}, HOST being this machine's name or address"
    assert lines[2].startswith("warning: no broker login: anyone who reaches this port may publish")
    with EmbeddedBroker(tmp_path / "loopback") as broker:
        assert connack(BrokerAddress(host, broker.port), "cam-1") == -1
        assert broker_lines(broker, reachable=False)[1].startswith("devices on this machine only")


@pytest.mark.integration
def test_a_locked_embedded_broker_on_the_network_takes_only_provisioned_logins_over_tls(tmp_path: Path) -> None:
    host, port = this_machines_address(), free_loopback_port()
    provision("site", 1, tmp_path / "secure", tls=True, tls_hosts=(host, *DEFAULT_TLS_HOSTS))
    secure = load_secure_fleet(tmp_path / "secure")
    device = load_credentials(secure.device_credentials("dev-00"))
    tls = {"ca_certs": device.ca_file, "certfile": device.cert_file, "keyfile": device.key_file}
    with embedded_broker(tmp_path / "broker", secure, listen=("0.0.0.0", port)) as broker:
        assert broker.address.url == f"mqtts://127.0.0.1:{port}"
        assert connack(BrokerAddress(host, port), "dev-00", tls, (device.username, device.password)) == 0
        assert connack(BrokerAddress(host, port), "dev-00", tls, (device.username, "wrong")) != 0
        assert connack(BrokerAddress(host, port), "dev-00") == -1  # plain TCP: no TLS handshake, no session
        own = secure.coordinator
        own_tls = {"ca_certs": own.ca_file, "certfile": own.cert_file, "keyfile": own.key_file}
        assert connack(broker.address, "coordinator", own_tls, (own.username, own.password)) == 0
        assert broker_lines(broker, reachable=True)[1].startswith(f"devices connect with --broker mqtts://HOST:{port}")
        assert len(broker_lines(broker, reachable=True)) == 2  # a login: no warning


def test_the_agent_says_which_setting_won_over_the_profile(tmp_path: Path) -> None:
    profile = load_profile(PI_ZERO)
    plain = parse_broker_url("mqtt://coordinator.lan:1883")
    assert chosen_state_dir(None, profile, "cam-1") == Path("/var/lib/edge-agent")
    assert chosen_state_dir(tmp_path, profile, "cam-1") == tmp_path
    assert chosen_state_dir(None, None, "cam-1") == Path("agent-state/cam-1")
    assert settings_lines(tmp_path, tmp_path, profile, plain, None) == [
        f"state folder {tmp_path} from --state-dir (the profile's storage_path /var/lib/edge-agent is not used)",
        "broker mqtt://coordinator.lan:1883 is plain TCP: the profile's tls_ca, tls_cert, tls_key apply to mqtts:// "
        "only and are not used",
    ]
    tls = parse_broker_url("mqtts://coordinator.lan:8883")
    assert settings_lines(None, Path("/var/lib/edge-agent"), profile, tls, None) == []
    assert settings_lines(None, tmp_path, None, plain, None) == []


def test_the_round_line_shows_the_servers_labels_apart_and_the_largest_peak() -> None:
    result = RoundResult(3, 0.7, {}, 280, {}, 12.0, {}, {}, {}, 200, {"cam-1": 150.2, "cam-2": 176.4})
    assert labels_words(result) == "280 (server 200 + devices 80)"
    assert peak_words(result.peak_rss_mb) == "  peak RSS 176 MB (cam-2)"
    assert peak_words({}) == ""


def test_a_broker_on_one_named_address_is_the_address_devices_use(tmp_path: Path) -> None:
    broker = EmbeddedBroker(tmp_path / "broker", port=1883, host="192.0.2.7")
    assert broker.address == BrokerAddress("192.0.2.7", 1883)
    assert broker_lines(broker, reachable=True)[:2] == [
        "embedded broker listening at mqtt://192.0.2.7:1883",
        "devices connect with --broker mqtt://192.0.2.7:1883",
    ]


def test_the_stream_help_says_what_the_code_scores_with() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "edge_agent", "run", "--help"], capture_output=True, text=True, timeout=60, check=True
    )
    words = " ".join(result.stdout.split())
    assert "with the recipe's sampler" in words and "entropy" not in words
