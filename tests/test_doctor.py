# `edge-agent doctor` as a person installing a board runs it: real processes, a real mosquitto, real files.
from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from coordinator.fleet.broker import EmbeddedBroker, free_loopback_port
from coordinator.fleet.provision import broker_config_lines, load_secure_fleet, provision
from edge_agent.loop.board_checks import CLOCK_FLOOR, clock_check, memory_check, python_check
from protocol.credentials import load_credentials, save_credentials

ROOT = Path(__file__).resolve().parent.parent
PROFILE = ROOT / "firmware_configs" / "raspberry-pi-zero-2w.toml"
FLEET = "doctor-fleet"
SIGILL_ONNXRUNTIME = "import os, signal\nos.kill(os.getpid(), signal.SIGILL)\n"


@pytest.fixture(scope="module")
def fleet_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A provisioned fleet of one device (passwords and ACL, no TLS)."""
    folder = tmp_path_factory.mktemp("provisioned") / "fleet"
    provision(FLEET, 1, folder)
    return folder


@pytest.fixture(scope="module")
def locked_broker(tmp_path_factory: pytest.TempPathFactory, fleet_dir: Path) -> Iterator[EmbeddedBroker]:
    """mosquitto with the fleet's password file and ACL: anonymous clients and wrong passwords are refused."""
    lines = tuple(
        line
        for line in broker_config_lines(load_secure_fleet(fleet_dir))
        if line.startswith(("allow_", "use_", "password_", "acl_"))
    )
    with EmbeddedBroker(tmp_path_factory.mktemp("broker"), extra_config=lines) as broker:
        yield broker


def doctor(broker_url: str, state_dir: Path, *options: str, pythonpath: tuple[Path, ...] = ()) -> tuple[int, list[str]]:
    """Runs `python -m edge_agent doctor` with the Pi Zero 2 W profile: (exit code, its output's lines)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(map(str, (*pythonpath, ROOT)))}
    command = [sys.executable, "-m", "edge_agent", "doctor", "--broker", broker_url, "--state-dir", str(state_dir)]
    done = subprocess.run(
        [*command, "--profile", str(PROFILE), *options], capture_output=True, text=True, env=env, timeout=300
    )
    assert done.stderr == "", done.stderr
    return done.returncode, done.stdout.splitlines()


def failures(lines: list[str]) -> list[str]:
    """The lines of failed checks."""
    return [line for line in lines if line.startswith("FAIL")]


def test_a_board_that_can_serve_passes_every_check_with_its_credentials(
    tmp_path: Path, fleet_dir: Path, locked_broker: EmbeddedBroker
) -> None:
    code, lines = doctor(
        locked_broker.address.url, tmp_path / "state", "--credentials", str(fleet_dir / "devices" / "dev-00.json")
    )
    assert code == 0, lines
    assert [line.split(":")[0] for line in lines[:-1]] == [
        *("ok   python", "ok   onnxruntime", "ok   memory", "ok   state", "ok   clock", "ok   broker")
    ]
    assert "ran one inference" in lines[1] and "for the profile's 200 MB budget" in lines[2]
    assert lines[-1] == "ready: this board can serve its fleet"
    assert list((tmp_path / "state").iterdir()) == []  # the probe file is gone


def test_a_state_folder_under_a_regular_file_is_refused(tmp_path: Path, broker: EmbeddedBroker) -> None:
    (tmp_path / "a-file").write_text("not a folder")  # even root cannot make a folder under a file
    code, lines = doctor(broker.address.url, tmp_path / "a-file" / "state")
    assert code == 1
    assert failures(lines) == [
        f"FAIL state: {tmp_path}/a-file/state is not writable (Not a directory): labels and progress persist there"
    ]
    assert lines[-1] == "not ready: state failed"


def test_a_broker_nobody_listens_on_is_unreachable(tmp_path: Path) -> None:
    port = free_loopback_port()
    code, lines = doctor(f"mqtt://127.0.0.1:{port}", tmp_path / "state")
    assert code == 1
    assert failures(lines) == [
        f"FAIL broker: mqtt://127.0.0.1:{port} cannot be reached: [Errno 111] Connection refused"
    ]


def test_a_wrong_password_is_refused_by_the_broker(
    tmp_path: Path, fleet_dir: Path, locked_broker: EmbeddedBroker
) -> None:
    credentials = load_credentials(fleet_dir / "devices" / "dev-00.json")
    wrong = tmp_path / "wrong.json"
    save_credentials(wrong, dataclasses.replace(credentials, password="not-the-password"))
    code, lines = doctor(locked_broker.address.url, tmp_path / "state", "--credentials", str(wrong))
    assert code == 1
    assert failures(lines) == [
        f"FAIL broker: {locked_broker.address.url} refused the connection as 'dev-00': Not authorized "
        "(check the login and password of --credentials, or the broker's password file)"
    ]


def test_a_runtime_that_dies_with_sigill_in_the_child_is_one_line_naming_its_version(
    tmp_path: Path, broker: EmbeddedBroker
) -> None:
    fake = tmp_path / "fake"
    (fake / "onnxruntime").mkdir(parents=True)
    (fake / "onnxruntime" / "__init__.py").write_text(SIGILL_ONNXRUNTIME)
    (fake / "onnxruntime-1.21.0.dist-info").mkdir()
    (fake / "onnxruntime-1.21.0.dist-info" / "METADATA").write_text("Name: onnxruntime\nVersion: 1.21.0\n")
    code, lines = doctor(broker.address.url, tmp_path / "state", pythonpath=(fake,))
    assert code == 1
    assert failures(lines) == [
        "FAIL onnxruntime: onnxruntime 1.21.0 died with SIGILL (an instruction this CPU lacks): "
        "pip install --upgrade 'onnxruntime>=1.17,!=1.21.0'"
    ]
    assert lines[-1] == "not ready: onnxruntime failed"


def test_a_32_bit_os_gets_one_line_saying_to_install_the_64_bit_one() -> None:
    verdict = python_check((3, 11, 2), "armv7l", 32)
    assert not verdict.ok
    assert verdict.line == (
        "Python 3.11.2 on armv7l (32-bit): a 32-bit OS; install the 64-bit OS (Raspberry Pi OS 64-bit, arm64): "
        "onnxruntime publishes no 32-bit ARM wheel"
    )
    assert not python_check((3, 11, 2), "aarch64", 32).ok  # a 64-bit kernel under a 32-bit userland
    assert not python_check((3, 10, 12), "aarch64", 64).ok
    assert python_check((3, 13, 5), "aarch64", 64).ok


def test_memory_and_clock_refusals_name_what_was_found() -> None:
    meminfo = "MemTotal:  437000 kB\nMemFree:  90000 kB\nMemAvailable:  153600 kB\n"
    assert memory_check(200, meminfo).line.startswith("the profile's budget is 200 MB but only 150 MB is available")
    assert memory_check(100, meminfo).ok
    assert not memory_check(100, "MemTotal: 1 kB\n").ok
    assert not clock_check(0.0).ok and "1970-01-01" in clock_check(0.0).line
    assert clock_check(CLOCK_FLOOR).ok


def test_missing_tls_files_are_named_rather_than_called_unreachable(tmp_path: Path) -> None:
    code, lines = doctor(f"mqtts://127.0.0.1:{free_loopback_port()}", tmp_path / "state")  # the profile's TLS files
    assert code == 1
    assert failures(lines) == [
        "FAIL broker: the TLS files (ca /etc/edge-agent/tls/ca.crt, cert /etc/edge-agent/tls/device.crt, key "
        "/etc/edge-agent/tls/device.key) cannot be used: [Errno 2] No such file or directory"
    ]
