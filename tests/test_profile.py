# Device profiles: every shipped profile loads; an unknown key or a wrong type names the file, key and expectation.
from __future__ import annotations

from pathlib import Path

import pytest

from edge_agent.profile import ProfileError, load_profile

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


@pytest.mark.parametrize(("old", "new", "message"), [
    ("threads = 4", 'threads = "four"', "key 'threads': expected integer, got str"),
    ("threads = 4", "threads = true", "key 'threads': expected integer, got bool"),
    ("keepalive = 60", "keepalive = 1.5", "key 'keepalive': expected integer, got float"),
    ('execution_providers = ["CPUExecutionProvider"]', 'execution_providers = "CPUExecutionProvider"',
     "key 'execution_providers': expected list of strings"),
    ('backend = "onnxruntime"', 'backend = "tflite"', "key 'backend': expected one of torch, onnxruntime"),
])
def test_wrong_type_names_file_key_and_expectation(tmp_path: Path, old: str, new: str, message: str) -> None:
    with pytest.raises(ProfileError, match="device.toml") as error:
        load_profile(_variant(tmp_path, old, new))
    assert message in str(error.value)


def test_missing_key_is_named(tmp_path: Path) -> None:
    with pytest.raises(ProfileError, match="missing key 'threads'"):
        load_profile(_variant(tmp_path, "threads = 4\n", ""))
