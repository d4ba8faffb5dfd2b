# Predictions on a field device: one per image per serving version (restarts too), the bounded log, a full disk,
# publishing only when the fleet asks, and `edge-agent predict` over a folder.
from __future__ import annotations

import csv
import dataclasses
import io
import json
import logging
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from fleet import WITHOUT_TORCH
from test_field_agent import HEAD_WEIGHTS, field_run, head_round, kill, launch_head_agent, stop
from test_folder_pool import write_png

from coordinator.dashboard.live import LiveState
from coordinator.intake.predictions import PredictionIntake
from edge_agent.data.fashion_mnist import load_fashion_mnist
from edge_agent.data.predictions_log import PREDICTIONS_FOLDER, PredictionLog, segment_path
from edge_agent.field.folder_oracle import FolderOracle, QueryBook
from edge_agent.field.folder_pool import folder_pool_of, open_folder_data
from edge_agent.field.parts import FieldWork
from edge_agent.field.predicting import LEDGER_KEY, PoolPredictions
from edge_agent.learning.bundle import Bundle, load_bundle
from edge_agent.learning.models import build_model, get_weights
from edge_agent.loop.agent import Agent
from edge_agent.loop.agent_settings import AgentSettings
from export.bundle_writer import ensure_bundle_files
from protocol import messages, topics, wire
from protocol.model_spec import CLASS_NAMES, DEFAULT_SPEC, trainable_names
from protocol.mqtt import MqttSession
from protocol.prediction_messages import BatchError, PredictionBatch, check_batch
from protocol.serving_messages import ServingMessage

ROOT = Path(__file__).resolve().parent.parent
FLEET, DEVICE = "fleet-p", "cam-p"
HEAD_SPEC = dataclasses.replace(DEFAULT_SPEC, trainable="head")
SETTINGS = AgentSettings(FLEET, DEVICE, backend="onnxruntime", trainer="head")


@dataclasses.dataclass(frozen=True)
class Serving:
    """A serving version as the device's serving slot gives it."""

    version: int
    model_hash: str
    bundle: Bundle


@pytest.fixture(scope="module")
def servings(tmp_path_factory: pytest.TempPathFactory) -> list[Serving]:
    """Two serving versions of one frozen backbone: W0 and a model whose classifier differs."""
    first = get_weights(build_model(HEAD_SPEC, seed=7))
    head = set(trainable_names(HEAD_SPEC, first))
    second = {name: (value * 0.5 + 0.01 if name in head else value) for name, value in first.items()}
    found = []
    for version, weights in enumerate((first, second)):
        folder = tmp_path_factory.mktemp(f"bundle-{version}")
        ensure_bundle_files(weights, folder, HEAD_SPEC)
        bundle = load_bundle(folder)
        found.append(Serving(version, bundle.manifest.weights_hash, bundle))
    return found


def pool_with(folder: Path, count: int, first: int = 0) -> None:
    """Real Fashion-MNIST PNGs first..first+count-1 in a camera folder."""
    images = load_fashion_mnist().test_images[5000 + first : 5000 + first + count]
    for offset, image in enumerate(images):
        write_png(folder / f"{first + offset:03d}.png", image, age_seconds=60 - offset)


def predictor(tmp_path: Path, repredict: bool = False, log_bytes: int = 1 << 20) -> PoolPredictions:
    """A field device's predictions over tmp_path/camera (the store opened anew: a restarted process)."""
    data = open_folder_data(tmp_path / "state", tmp_path / "camera", pool_cap=100, settle_seconds=0)
    log_file = PredictionLog(tmp_path / "state" / PREDICTIONS_FOLDER, log_bytes)
    return PoolPredictions(data, folder_pool_of(data), SETTINGS, log_file, CLASS_NAMES, repredict)


def logged(state_dir: Path) -> list[dict]:
    """Every line of the predictions log, oldest first."""
    log_file = PredictionLog(state_dir / PREDICTIONS_FOLDER, 1)
    return [json.loads(line) for path in log_file.segments() for line in path.read_text().splitlines()]


def test_each_image_is_predicted_once_per_serving_version_across_restarts(tmp_path, servings) -> None:
    """12 images, then 5 more after a restart, then a process killed between writing the log and noting it: each
    image has exactly one line under version 0, from the cached features (the rows file exists)."""
    pool_with(tmp_path / "camera", 12)
    first = predictor(tmp_path).tick(servings[0], passes=3)
    assert first is not None and len(first) == 12 and first.serving_version == 0
    assert set(first.class_names) <= set(CLASS_NAMES) and all(0 <= p <= 1 for p in first.uncertainties)
    assert list((tmp_path / "state" / "features").glob("*.rows")), "a frozen prefix's rows are cached"
    pool_with(tmp_path / "camera", 5, first=12)
    restarted = predictor(tmp_path)
    assert restarted.tick(servings[0], passes=3) is not None
    restarted.data.set_state(LEDGER_KEY, {**restarted.data.get_state(LEDGER_KEY), "upto": 12})  # the note was lost
    again = predictor(tmp_path)
    assert again.tick(servings[0], passes=3) is None and again.ledger().upto == 17
    lines = logged(tmp_path / "state")
    assert sorted(line["index"] for line in lines) == list(range(17))
    assert {line["serving_version"] for line in lines} == {0}
    assert [line["file"] for line in lines[:2]] == ["000.png", "001.png"]
    digests = np.fromfile(tmp_path / "state" / "pool" / "digests.bin", np.uint8).reshape(-1, 32)
    assert [line["content_hash"] for line in lines] == [digest.tobytes().hex() for digest in digests]


@pytest.mark.parametrize("repredict", [False, True])
def test_a_new_serving_version_predicts_only_new_images_unless_asked_to_repredict(
    tmp_path, servings, repredict
) -> None:
    pool_with(tmp_path / "camera", 6)
    predictor(tmp_path).tick(servings[0], passes=2)
    pool_with(tmp_path / "camera", 2, first=6)
    second = predictor(tmp_path, repredict)
    batch = second.tick(servings[1], passes=2)
    assert batch is not None and batch.model_hash == servings[1].model_hash
    assert len(batch) == (8 if repredict else 2)
    counts = Counter((line["serving_version"], line["index"]) for line in logged(tmp_path / "state"))
    assert set(counts.values()) == {1}
    assert sum(1 for version, _ in counts if version == 1) == (8 if repredict else 2)


def rows(count: int, start: int = 0) -> list[dict]:
    return [{"index": start + i, "note": "x" * 80} for i in range(count)]


def test_the_log_rotates_and_stays_within_its_bound_and_cuts_a_torn_line(tmp_path) -> None:
    log_file = PredictionLog(tmp_path / "log", 2000)
    for start in range(0, 120, 10):
        assert log_file.append(rows(10, start))
    segments = log_file.segments()
    sizes = [path.stat().st_size for path in segments]
    assert sum(sizes) <= 2000 and len(segments) >= 3 and max(sizes) <= 500
    assert segments[-1] == segment_path(tmp_path / "log", int(segments[-1].stem.split("-")[1]))
    assert log_file.last() == rows(1, 119)[0]
    with open(segments[-1], "ab") as handle:
        handle.write(b'{"index": 120, "no')  # a crash mid-line
    assert log_file.last() == rows(1, 119)[0]
    assert log_file.append(rows(1, 121))
    kept = [json.loads(line) for path in log_file.segments() for line in path.read_text().splitlines()]
    assert kept[-2:] == [rows(1, 119)[0], rows(1, 121)[0]]


@pytest.mark.parametrize("fault", ["disk full", "folder is a file"])
def test_a_log_that_cannot_be_written_warns_once_and_the_device_keeps_predicting(
    tmp_path, servings, fault, caplog
) -> None:
    """/dev/full behind the log's segment (ENOSPC on every write), or a file where its folder would be."""
    folder = tmp_path / "state" / PREDICTIONS_FOLDER
    folder.parent.mkdir(parents=True)
    if fault == "disk full":
        folder.mkdir()
        segment_path(folder, 1).symlink_to("/dev/full")
    else:
        folder.write_text("not a folder")
    pool_with(tmp_path / "camera", 4)
    predictions = predictor(tmp_path)
    with caplog.at_level(logging.INFO, logger="edge_agent.data.predictions_log"):
        assert predictions.tick(servings[0], passes=2) is not None
        pool_with(tmp_path / "camera", 3, first=4)
        predictions.data.refresh()
        assert predictions.tick(servings[0], passes=2) is not None
    warned = [record for record in caplog.records if "predictions log cannot be written" in record.getMessage()]
    assert len(warned) == 1 and warned[0].levelname == "WARNING" and len(warned[0].getMessage()) < 400
    assert predictions.ledger().upto == 7 and predictions.log.lost == 7


def test_a_journal_that_cannot_be_written_is_one_warning_and_predicting_goes_on(tmp_path, servings, caplog) -> None:
    """state.json turned into a folder (its atomic replace fails, as on a full disk): no image is predicted twice
    by the running process, one warning says a restart may."""
    pool_with(tmp_path / "camera", 5)
    predictions = predictor(tmp_path)
    (tmp_path / "state" / "state.json").unlink()
    (tmp_path / "state" / "state.json").mkdir()
    with caplog.at_level(logging.WARNING, logger="edge_agent.field.predicting"):
        assert len(predictions.tick(servings[0], passes=2)) == 5
        assert predictions.tick(servings[0], passes=2) is None
        pool_with(tmp_path / "camera", 2, first=5)
        predictions.data.refresh()
        assert len(predictions.tick(servings[0], passes=2)) == 2
    warned = [record.getMessage() for record in caplog.records if "ledger not kept" in record.getMessage()]
    assert len(warned) == 1 and len(warned[0]) < 400
    assert sorted(line["index"] for line in logged(tmp_path / "state")) == list(range(7))


def serve(session: MqttSession, serving: Serving, publish: bool) -> None:
    """What a coordinator's promotion publishes, retained: the serving version's bundle, then the serving message."""
    files = {path.name: path.read_bytes() for path in serving.bundle.path.iterdir() if path.is_file()}
    bundle = messages.BundleMessage(serving.model_hash, files)
    session.publish(
        topics.BUNDLE.build(fleet=FLEET, hash=serving.model_hash), wire.encode(bundle), retain=True, wait=10
    )
    message = ServingMessage("run", serving.version, serving.model_hash, time.time(), publish)
    session.publish(topics.SERVING.build(fleet=FLEET), wire.encode(message), retain=True, wait=10)


@pytest.mark.parametrize("publish", [True, False])
def test_predictions_are_published_when_the_fleet_asks_and_only_then(tmp_path, servings, publish, broker) -> None:
    pool_with(tmp_path / "camera", 9)
    live = LiveState(total_rounds=1)
    coordinator = PredictionIntake(live)  # the coordinator's side, fed what the broker delivered
    listener = MqttSession(broker.address, client_id="listener")
    listener.connect(timeout=10)
    listener.subscribe(topics.PREDICTIONS.filter(fleet=FLEET))
    serve(listener, servings[0], publish)
    session = MqttSession(broker.address, client_id=DEVICE)
    predictions = predictor(tmp_path)
    data = predictions.data
    work = FieldWork(data, 0.1, predictions=predictions)
    oracle = FolderOracle(QueryBook(tmp_path / "labelling"), data, 0)
    agent = Agent(SETTINGS, session, data, oracle, work)
    try:
        session.connect(timeout=10)
        agent.start()
        deadline = time.monotonic() + 30
        while (predictions.ledger() is None or predictions.ledger().upto < 9) and time.monotonic() < deadline:
            agent.step(timeout=0.05)
        received = []
        deadline = time.monotonic() + (10 if publish else 1.5)
        while time.monotonic() < deadline and sum(len(batch) for batch in received) < 9:
            message = listener.next_message(timeout=0.2)
            if message is not None and message.topic.endswith("/predictions"):
                assert message.topic == topics.PREDICTIONS.build(fleet=FLEET, device=DEVICE)
                received.append(check_batch(wire.decode(message.payload, PredictionBatch)))
                coordinator.on_predictions(DEVICE, message.payload, message.dropped)
    finally:
        agent.finish()
        session.close()
        listener.close()
    if not publish:
        assert received == []
        return
    assert sum(len(batch) for batch in received) == 9
    assert {(batch.device_id, batch.serving_version, batch.model_hash) for batch in received} == {
        (DEVICE, 0, servings[0].model_hash)
    }
    assert [file for batch in received for file in batch.files] == [f"{i:03d}.png" for i in range(9)]
    assert live.predictions()[DEVICE]["per_hour"] == 9 and live.counters().predictions_refused == 0


def test_a_batch_whose_columns_disagree_is_refused_in_one_bounded_line() -> None:
    batch = PredictionBatch(
        DEVICE, 0, "h", ["a.png"] * 3, ["0" * 64] * 3, [1, 2], ["x"] * 3, [0.5] * 3, [0.1] * 3, [0.0] * 3
    )
    with pytest.raises(BatchError, match="differ in length"):
        check_batch(wire.decode(wire.encode(batch), PredictionBatch))
    bad = dataclasses.replace(batch, class_indices=[1, 2, 3], probabilities=[0.5, 1.5, float("nan")])
    with pytest.raises(BatchError, match="outside"):
        check_batch(bad)


def test_a_head_only_agent_process_predicts_each_image_once_per_version_across_a_sigkill(tmp_path) -> None:
    """The Pi Zero profile: the serving version 0 predicts the 30 images; after a SIGKILL and 3 new images, version 1
    (promoted while the device was down) predicts the 3 new ones, nothing twice."""
    pool_dir, state = tmp_path / "camera", tmp_path / "state"
    pool_with(pool_dir, 30)
    with field_run(tmp_path, pool_dir) as (coordinator, launch, _):
        agent = launch_head_agent(tmp_path, coordinator, launch)
        coordinator.serve(0, HEAD_WEIGHTS)
        head_round(tmp_path, coordinator, 1)
        deadline = time.monotonic() + 60
        while len(logged(state)) < 30 and time.monotonic() < deadline:
            time.sleep(0.2)
        kill(agent)
        pool_with(pool_dir, 3, first=100)
        coordinator.serve(1, HEAD_WEIGHTS)
        agent = launch_head_agent(tmp_path, coordinator, launch)
        head_round(tmp_path, coordinator, 2)
        deadline = time.monotonic() + 60
        while len(logged(state)) < 33 and time.monotonic() < deadline:
            time.sleep(0.2)
        stop(agent)
    counts = Counter((line["serving_version"], line["index"]) for line in logged(state))
    assert set(counts.values()) == {1}, counts
    assert sorted(index for version, index in counts if version == 0) == list(range(30))
    assert sorted(index for version, index in counts if version == 1) == [30, 31, 32]
    assert "Traceback" not in (tmp_path / "agent.log").read_text()


def run_predict(*arguments: str) -> subprocess.CompletedProcess:
    """`edge-agent predict` in a process where torch cannot be imported."""
    command = [sys.executable, "-c", WITHOUT_TORCH, "edge_agent", "predict", *arguments]
    return subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=ROOT)


def test_predict_prints_one_line_per_image_as_json_or_csv_without_torch(tmp_path, servings) -> None:
    pool_with(tmp_path / "camera", 4)
    (tmp_path / "camera" / "broken.png").write_bytes(b"not a png")
    bundle = str(servings[0].bundle.path)
    as_json = run_predict("--bundle", bundle, "--pool", str(tmp_path / "camera"), "--passes", "3")
    assert as_json.returncode == 0, as_json.stderr
    lines = [json.loads(line) for line in as_json.stdout.splitlines()]
    assert [line["file"] for line in lines] == [f"{i:03d}.png" for i in range(4)]
    assert {line["model_hash"] for line in lines} == {servings[0].model_hash}
    assert as_json.stderr.startswith("edge-agent: skipped 1 unreadable files (broken.png")
    data = open_folder_data(tmp_path / "state", tmp_path / "camera", pool_cap=100, settle_seconds=0)
    assert [line["content_hash"] for line in lines] == [d.tobytes().hex() for d in data.digests(np.arange(4))]
    as_csv = run_predict("--bundle", bundle, "--pool", str(tmp_path / "camera"), "--passes", "3", "--csv")
    table = list(csv.DictReader(io.StringIO(as_csv.stdout)))
    assert [row["class_name"] for row in table] == [line["class_name"] for line in lines]


@pytest.mark.parametrize(
    "where, message",
    [
        ("no-such-folder", "does not exist"),
        ("a-file", "is not a folder"),
        ("bad-bundle", "manifest.json is missing"),
        ("camera --passes 0", "--passes must be at least 1"),
        ("camera --limit 0", "--limit must be at least 1"),
    ],
)
def test_predict_refuses_a_bad_folder_bundle_or_count_in_one_line(tmp_path, servings, where, message) -> None:
    (tmp_path / "a-file").write_text("x")
    (tmp_path / "bad-bundle").mkdir()
    pool_with(tmp_path / "camera", 1)
    folder, *extra = where.split()
    bundle = tmp_path / "bad-bundle" if folder == "bad-bundle" else servings[0].bundle.path
    pool = tmp_path / "camera" if folder == "bad-bundle" else tmp_path / folder
    result = run_predict("--bundle", str(bundle), "--pool", str(pool), *extra)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1 and message in lines[0], result.stderr
