# `simulate` runs KAFAL (ksas + kcfu, partial participation), FAST and FedProx end to end with real agents, a real
# mosquitto and real Fashion-MNIST slices, and ends with a summary line; bad method options fail in one line.
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.cli import main
from coordinator.storage.store import RunStore
from edge_agent.data.device_data import DeviceData

pytestmark = pytest.mark.integration

TINY = [
    "--devices",
    "4",
    "--partition",
    "dirichlet:0.1",
    "--rounds",
    "2",
    "--json",
    "--pool-size",
    "100",
    "--labels-per-acquisition",
    "10",
    "--epochs",
    "1",
    "--test-samples",
    "500",
    "--no-device-eval",
    "--init-epochs",
    "2",
    "--init-samples",
    "50",
    "--validation-samples",
    "100",
    "--round-timeout",
    "300",
]


def simulate(run_dir: Path, *options: str) -> list[dict]:
    """Runs the bench command and returns its JSON lines."""
    result = subprocess.run(
        [sys.executable, "-m", "bench", "simulate", *TINY, "--run-dir", str(run_dir), *options],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    return [json.loads(line) for line in result.stdout.strip().splitlines()]


def device_data(run_dir: Path) -> dict[str, DeviceData]:
    return {path.parent.name: DeviceData.open(path) for path in sorted((run_dir / "devices").glob("*/state"))}


def test_kafal_runs_with_partial_participation_and_the_active_round_schedule(tmp_path: Path) -> None:
    run_dir = tmp_path / "kafal"
    lines = simulate(
        run_dir,
        "--sampler",
        "ksas",
        "--local-rule",
        "kcfu",
        "--strategy",
        "fedavg",
        "--participation",
        "0.5",
        "--initial-label-fraction",
        "0.1",
        "--label-fraction",
        "0.05",
        "--ksas-lambda",
        "1",
        "--kcfu-nu",
        "0.5",
    )
    assert [line["round"] for line in lines[:-1]] == [1, 2] and lines[-1]["summary"]["rounds"] == 2
    with RunStore(run_dir) as store:
        for record in store.rounds():
            participants = record.report["participants"]
            assert len(participants) == 2 and record.accepted == 2 and record.metrics["quorum"] == 2
            assert sorted(record.report["coefficients"]) == participants
            assert sorted(d.device_id for d in store.device_rounds(record.round_id)) == participants
    devices = device_data(run_dir)
    assert len(devices) == 4
    for data in devices.values():
        assert data.count_labels("oracle") == 10 + 5, "10% initial labels, then 5% in round 2, selected or not"


def test_fast_with_fedprox_runs_and_ends_with_a_summary(tmp_path: Path) -> None:
    run_dir = tmp_path / "fast"
    lines = simulate(
        run_dir, "--sampler", "fast", "--local-rule", "fedprox", "--strategy", "fedavg", "--mu", "0.01", "--knn-k", "5"
    )
    summary = lines[-1]["summary"]
    assert summary["rounds"] == 2 and 0.0 < summary["final_accuracy"] <= 1.0
    assert (run_dir / "encoder.onnx").is_file()
    devices = device_data(run_dir)
    assert [data.count_labels("oracle") for data in devices.values()] == [20] * 4
    assert [data.count_labels("weak") for data in devices.values()] == [80] * 4
    assert summary["labels"] == 50 + 4 * 20, "weak labels are not counted as labels"


@pytest.mark.parametrize(
    ("option", "value", "message"),
    [
        ("--participation", "1.5", "--participation must lie in (0, 1]"),
        ("--label-fraction", "2", "--label-fraction must lie in [0, 1]"),
        ("--rounds-per-acquisition", "0", "--rounds-per-acquisition must be at least 1"),
        ("--mu", "-1", "--mu must be at least 0, got -1.0"),
        ("--mu", "0.1", "--mu is an option of local rule 'fedprox'; this run uses 'kept-labels'"),
        ("--kcfu-nu", "1.5", "--kcfu-nu must lie in [0, 1]"),
        ("--encoder", "/nonexistent/encoder.onnx", "no such file"),
    ],
)
def test_bad_method_options_give_one_line(tmp_path: Path, capsys, option: str, value: str, message: str) -> None:
    code = main(["simulate", "--devices", "2", "--rounds", "1", "--run-dir", str(tmp_path / "run"), option, value])
    stderr = capsys.readouterr().err
    assert code == 2 and message in stderr and len(stderr.strip().splitlines()) == 1
    assert not (tmp_path / "run" / "devices").exists()
