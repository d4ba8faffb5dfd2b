# `simulate` end to end with CADIS and FMLU: real agents, real mosquitto, real SQLite; what the devices sent.
from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from coordinator.storage.store import RunStore
from edge_agent.learning.torch_rules import PRIVATE_MODEL_FILE
from protocol import messages, wire
from protocol.files import load_arrays
from protocol.tensors import weights_hash

pytestmark = pytest.mark.integration

TINY = [
    "--devices",
    "2",
    "--rounds",
    "2",
    "--pool-size",
    "200",
    "--labels-per-acquisition",
    "20",
    "--epochs",
    "1",
    "--batch-size",
    "16",
    "--test-samples",
    "500",
    "--no-device-eval",
    "--sampler",
    "random",
    "--init-samples",
    "50",
    "--init-epochs",
    "2",
    "--validation-samples",
    "100",
    "--json",
]


def simulate(run_dir: Path, *method: str) -> list[dict]:
    """Runs `python -m bench simulate` as a user does; returns its JSON lines (rounds, then the summary)."""
    result = subprocess.run(
        [sys.executable, "-m", "bench", "simulate", *TINY, "--run-dir", str(run_dir), *method],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    return [json.loads(line) for line in result.stdout.strip().splitlines()]


def spooled_updates(run_dir: Path, round_id: int) -> dict[str, messages.Update]:
    with RunStore(run_dir) as store:
        return {
            device: wire.decode(payload, messages.Update) for device, payload in store.spool.payloads(round_id).items()
        }


def test_fmlu_with_dmlu_uploads_only_memes_and_their_entropy(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    lines = simulate(
        run_dir, "--partition", "dirichlet:0.1", "--local-rule", "dmlu", "--strategy", "fmlu", "--keep-updates"
    )
    assert [line.get("round") for line in lines[:-1]] == [1, 2] and lines[-1]["summary"]["rounds"] == 2
    with RunStore(run_dir) as store:
        report = store.rounds()[-1].report
        checkpoints = {weights_hash(store.checkpoints.load(r)) for r in range(3)}
    updates = spooled_updates(run_dir, 2)
    assert sorted(updates) == ["dev-00", "dev-01"]
    entropies = {device: update.metrics[messages.METRIC_MEME_ENTROPY] for device, update in updates.items()}
    assert all(set(update.metrics) == {messages.METRIC_MEME_ENTROPY} for update in updates.values())
    assert all(0.0 <= h <= math.log(10) for h in entropies.values())
    total = sum(math.exp(-h) for h in entropies.values())
    assert report["coefficients"] == pytest.approx({d: math.exp(-h) / total for d, h in entropies.items()})
    for device, update in updates.items():
        private = load_arrays(run_dir / "devices" / device / "state" / PRIVATE_MODEL_FILE)
        assert weights_hash(private) not in checkpoints | {weights_hash(update.tensors)}
        assert all(not np.array_equal(private[name], update.tensors[name]) for name in private)


def test_cadis_with_cadis_kd_on_cluster_skew_keeps_its_state_in_the_store(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    lines = simulate(
        run_dir, "--partition", "clusters:2", "--local-rule", "cadis-kd", "--strategy", "cadis", "--kd-weight", "0.5"
    )
    assert [line.get("round") for line in lines[:-1]] == [1, 2] and "summary" in lines[-1]
    with RunStore(run_dir) as store:
        rounds = store.rounds()
        state = store.latest_strategy_state()
        recipe = store.config()["settings"]["recipe"]
    assert recipe["local_rule"] == "cadis-kd" and recipe["options"] == {"kd_weight": 0.5}
    assert state is not None and state.strategy == "cadis"
    assert sorted(state.state["devices"]) == ["dev-00", "dev-01"] and state.state["step"] == 2
    assert np.array_equal(np.asarray(state.state["counts"]), np.full((2, 2), 2))
    assert [r.report["threshold"] for r in rounds] == [0.975, 0.975]
    assert all(sum(r.report["coefficients"].values()) == pytest.approx(1.0) for r in rounds)
