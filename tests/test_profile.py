# Device profiles: every shipped profile loads; an unknown key or a wrong type names the file, key and expectation.
from __future__ import annotations

from pathlib import Path

import pytest

from edge_agent.cli import EDGE_AGENT
from edge_agent.loop.profile import ProfileError, load_profile
from edge_agent.run_command import agent_settings, broker_address

CONFIGS = Path(__file__).resolve().parent.parent / "firmware_configs"
SHIPPED = ("raspberry-pi-4", "raspberry-pi-zero-2w", "jetson-nano", "jetson-orin-nano", "simulated")


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_profiles_load(name: str) -> None:
    profile = load_profile(CONFIGS / f"{name}.toml")
    assert profile.name == name and profile.execution_providers[-1] == "CPUExecutionProvider"
    assert isinstance(profile.execution_providers, tuple) and profile.mqtt.keepalive >= 5


def test_jetson_prefers_tensorrt() -> None:
    assert load_profile(CONFIGS / "jetson-nano.toml").execution_providers[0] == "TensorrtExecutionProvider"


def _variant(tmp_path: Path, old: str, new: str) -> Path:
    path = tmp_path / "device.toml"
    text = (CONFIGS / "raspberry-pi-4.toml").read_text()
    assert old in text
    path.write_text(text.replace(old, new))
    return path


def test_unknown_key_names_file_and_key(tmp_path: Path) -> None:
    path = _variant(tmp_path, "threads = 4", "threads = 4\nturbo = true")
    with pytest.raises(ProfileError, match=r"device\.toml: unknown key 'turbo'"):
        load_profile(path)


@pytest.mark.parametrize(
    ("old", "new", "message"),
    [
        ("threads = 4", 'threads = "four"', "key 'threads': expected integer, got str"),
        ("threads = 4", "threads = true", "key 'threads': expected integer, got bool"),
        ("keepalive = 60", "keepalive = 1.5", "key 'keepalive': expected integer, got float"),
        (
            'execution_providers = ["CPUExecutionProvider"]',
            'execution_providers = "CPUExecutionProvider"',
            "key 'execution_providers': expected list of strings",
        ),
        ('backend = "onnxruntime"', 'backend = "tflite"', "key 'backend': expected one of torch, onnxruntime"),
    ],
)
def test_wrong_type_names_file_key_and_expectation(tmp_path: Path, old: str, new: str, message: str) -> None:
    with pytest.raises(ProfileError, match="device.toml") as error:
        load_profile(_variant(tmp_path, old, new))
    assert message in str(error.value)


def test_missing_key_is_named(tmp_path: Path) -> None:
    with pytest.raises(ProfileError, match="missing key 'threads'"):
        load_profile(_variant(tmp_path, "threads = 4\n", ""))


def test_agent_run_takes_its_settings_from_the_profile_and_the_command_line_wins() -> None:
    pi_zero = CONFIGS / "raspberry-pi-zero-2w.toml"
    base = ["run", "--broker", "mqtts://broker.example:8883", "--fleet", "f", "--device-id", "d", "--pool-dir", "x"]
    args = EDGE_AGENT.parser("run").parse_args([*base, "--profile", str(pi_zero)])
    profile = load_profile(pi_zero)
    settings = agent_settings(args, profile)
    assert (settings.backend, settings.inference_batch, settings.mc_passes_cap, settings.torch_threads) == (
        "onnxruntime",
        profile.inference_batch,
        10,
        2,
    )
    assert profile.inference_batch == 4
    assert settings.profile == "raspberry-pi-zero-2w" and settings.scores_with_onnxruntime
    overridden = agent_settings(
        EDGE_AGENT.parser("run").parse_args([*base, "--inference-batch", "16", "--torch-threads", "1"]), profile
    )
    assert (overridden.inference_batch, overridden.torch_threads) == (16, 1)
    address = broker_address(args.broker, profile)
    assert (address.tls, address.ca_file, address.key_file) == (
        True,
        "/etc/edge-agent/tls/ca.crt",
        "/etc/edge-agent/tls/device.key",
    )
    assert broker_address("mqtt://h:1883", profile).ca_file is None
    bare = agent_settings(EDGE_AGENT.parser("run").parse_args(base), None)
    assert (bare.backend, bare.torch_threads, bare.inference_batch, bare.mc_passes_cap) == ("torch", 1, 256, None)
