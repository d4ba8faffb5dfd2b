# A field agent process (folder pool + folder oracle) against a real mosquitto: rounds, pending answers, SIGKILL.
from __future__ import annotations

import contextlib
import csv
import dataclasses
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from browser import wait_for
from test_agent import FLEET, FakeCoordinator
from test_feature_cache_faults import OnDisk
from test_folder_pool import write_png
from tmpfs import fill_leaving, mounted_tmpfs

from coordinator.fleet.broker import EmbeddedBroker
from edge_agent.data.fashion_mnist import load_fashion_mnist
from edge_agent.data.feature_cache import ROW_LIMIT
from edge_agent.field.folder_oracle import FolderOracle, QueryBook
from edge_agent.field.folder_pool import folder_pool_of, open_folder_data
from edge_agent.field.parts import StreamAcquirer
from edge_agent.field.stream import BudgetSettings
from edge_agent.learning.models import build_model, get_weights
from edge_agent.loop.agent import LatestModel
from edge_agent.loop.agent_settings import AgentSettings
from export.bundle_writer import ensure_bundle_files
from protocol import messages, topics, wire
from protocol.model_spec import CLASS_NAMES, DEFAULT_SPEC
from protocol.tensors import weights_hash

DEVICE = "cam-1"
PI_ZERO = Path(__file__).resolve().parent.parent / "firmware_configs" / "raspberry-pi-zero-2w.toml"
RECIPE = messages.Recipe(
    sampler="entropy", labels_per_acquisition=5, acquisitions_per_round=1, epochs=1, batch_size=4, mc_passes=3
)


@pytest.fixture()
def camera(tmp_path: Path) -> tuple[Path, dict[str, int]]:
    """A folder of 30 real Fashion-MNIST PNGs and the true label of each file name."""
    dataset = load_fashion_mnist()
    truth = {}
    for i in range(30):
        name = f"{i:03d}.png"
        write_png(tmp_path / "camera" / name, dataset.test_images[2000 + i], age_seconds=60 - i)
        truth[name] = int(dataset.test_labels[2000 + i])
    return tmp_path / "camera", truth


def start_agent(broker: EmbeddedBroker, pool_dir: Path, state_dir: Path, *extra: str) -> subprocess.Popen:
    """`python -m edge_agent run --pool-dir` as a real process, logging to state_dir/../agent.log."""
    command = [
        sys.executable,
        "-m",
        "edge_agent",
        "run",
        "--broker",
        f"mqtt://127.0.0.1:{broker.port}",
        "--fleet",
        FLEET,
        "--device-id",
        DEVICE,
        "--pool-dir",
        str(pool_dir),
        "--state-dir",
        str(state_dir),
        "--scan-interval",
        "0.5",
        "--settle-seconds",
        "0",
        "--log-level",
        "info",
        *extra,
    ]
    with open(state_dir.parent / "agent.log", "ab") as log:
        return subprocess.Popen(command, stdout=log, stderr=log)


def answer(book: QueryBook, truth: dict[str, int], queries: list) -> None:
    """Appends the true labels of queries to labels.csv as a person would (class names, one bad row)."""
    with open(book.labels_path, "a", newline="") as handle:
        writer = csv.writer(handle)
        for query in queries:
            writer.writerow([f"{query.round_id}/{query.name}", CLASS_NAMES[truth[query.source]]])
        writer.writerow(["no-such-file.png", "Bag"])


def kill(process: subprocess.Popen) -> None:
    process.send_signal(signal.SIGKILL)
    process.wait(timeout=10)


@contextlib.contextmanager
def field_run(tmp_path: Path, pool_dir: Path):
    """A real broker, a fake coordinator, a launcher of agent processes (all killed at the end), the query book."""
    with EmbeddedBroker(tmp_path / "broker") as broker:
        coordinator = FakeCoordinator(broker)
        agents: list[subprocess.Popen] = []

        def launch(*extra: str) -> subprocess.Popen:
            agents.append(start_agent(broker, pool_dir, tmp_path / "state", *extra))
            return agents[-1]

        try:
            yield coordinator, launch, QueryBook(tmp_path / "state" / "labelling")
        finally:
            for agent in agents:
                if agent.poll() is None:
                    kill(agent)
            coordinator.close()


def stop(agent: subprocess.Popen) -> None:
    """SIGTERM, and the agent must exit cleanly."""
    agent.send_signal(signal.SIGTERM)
    assert agent.wait(timeout=20) == 0


def test_folder_oracle_end_to_end_with_pending_answers_surviving_sigkill(tmp_path, camera):
    """A SIGKILL after 3 of 5 answers: the restarted agent keeps them, asks nothing again and finishes the round
    with the same batch once the 2 pending queries are answered."""
    pool_dir, truth = camera
    with field_run(tmp_path, pool_dir) as (coordinator, launch, book):
        agent = launch("--answer-wait", "120")
        coordinator.start_round(1, get_weights(build_model(seed=7)), recipe=RECIPE)
        first = wait_for(lambda: len(book.queries()) == 5 and book.queries(), 60, "5 queries in the index")
        for query in first:
            assert book.image_path(query).read_bytes() == (pool_dir / query.source).read_bytes()
            assert query.round_id == 1 and book.image_path(query).parent.name == "1"
        answer(book, truth, first[:3])
        time.sleep(1.0)
        kill(agent)
        assert len(book.pending()) == 2, "answers written before the kill stay on disk"

        agent = launch("--answer-wait", "120")
        answer(book, truth, book.pending())
        message = coordinator.next_on("update", timeout=60)
        assert message is not None, "no update after every query was answered"
        update = wire.decode(message.payload, messages.Update)
        assert (update.round_id, update.acquired_labels, update.num_samples) == (1, 5, 5), (
            "the restarted agent finishes the round with the batch it had queried"
        )
        assert [q.index for q in book.queries()] == [q.index for q in first], "nothing is asked twice"
        kill(agent)
    data = open_folder_data(tmp_path / "state", pool_dir, pool_cap=100, settle_seconds=0)
    indices, labels = data.labelled()
    assert data.count_labels("oracle") == 5
    assert [truth[folder_pool_of(data).item(i).path] for i in indices.tolist()] == labels.tolist()
    assert sorted(indices.tolist()) == sorted(q.index for q in book.queries())
    assert sorted(p.name for p in pool_dir.iterdir()) == sorted(truth), "no user file deleted"


def test_a_round_with_unanswered_queries_trains_on_nothing_new_and_carries_them_over(tmp_path, camera):
    pool_dir, truth = camera
    with field_run(tmp_path, pool_dir) as (coordinator, launch, book):
        agent = launch("--answer-wait", "1")
        weights = get_weights(build_model(seed=8))
        coordinator.start_round(1, weights, recipe=RECIPE)
        first = coordinator.next_on("update", timeout=60)
        assert first is not None and wire.decode(first.payload, messages.Update).acquired_labels == 0
        assert len(book.pending()) == 5
        answer(book, truth, book.pending()[:4])
        coordinator.start_round(2, weights, recipe=RECIPE)
        second = coordinator.next_on(
            "update", timeout=60, accept=lambda m: wire.decode(m.payload, messages.Update).round_id == 2
        )
        assert second is not None and wire.decode(second.payload, messages.Update).acquired_labels == 4
        assert len(book.queries()) == 10 and len(book.pending()) == 6
        assert {q.round_id for q in book.queries()} == {1, 2}
        stop(agent)


def test_stream_acquisition_stays_within_its_labelling_budget(tmp_path):
    images = load_fashion_mnist().test_images[3000:3040]
    pool_dir = tmp_path / "camera"
    pool_dir.mkdir()
    labels_per_second, burst = 1.0, 2
    with field_run(tmp_path, pool_dir) as (coordinator, launch, book):
        agent = launch(
            "--answer-wait",
            "0",
            "--stream",
            "--labels-per-hour",
            str(labels_per_second * 3600),
            "--label-burst",
            str(burst),
        )
        coordinator.start_round(1, get_weights(build_model(seed=9)), recipe=RECIPE)
        first = coordinator.next_on("update", timeout=60)
        assert first is not None and wire.decode(first.payload, messages.Update).acquired_labels == 0
        started = time.monotonic()
        for wave in range(10):
            for i in range(4):
                write_png(pool_dir / f"{wave:02d}-{i}.png", images[4 * wave + i], age_seconds=1)
            time.sleep(1.0)
        state_file = tmp_path / "state" / "state.json"
        wait_for(
            lambda: json.loads(state_file.read_text()).get("stream", {}).get("scored_upto") == 40,
            60,
            "every arrival scored",
        )
        elapsed = time.monotonic() - started
        stop(agent)
    asked = book.queries()
    budget = burst + labels_per_second * elapsed
    assert 3 <= len(asked) <= budget, (len(asked), budget)
    assert len(asked) <= 40 // 2, "arrivals come 4x faster than the budget: most are not asked"
    assert len({q.index for q in asked}) == len(asked)


@pytest.mark.parametrize(
    "options, message",
    [
        (("--pool-dir", "{tmp}", "--broker", "http://x"), "must look like mqtt://HOST:PORT"),
        (("--pool-dir", "{tmp}", "--labels-per-hour", "0", "--stream"), "labels per hour must be a positive number"),
        (("--pool-dir", "{tmp}/none"), "does not exist"),
        (("--pool-dir", "{tmp}", "--label-ui", "host:port"), "--label-ui expects [HOST:]PORT"),
    ],
)
def test_bad_field_options_get_one_clear_line_and_exit_2(tmp_path, options, message):
    options = [option.replace("{tmp}", str(tmp_path)) for option in options]
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "edge_agent",
            "run",
            "--broker",
            "mqtt://127.0.0.1:1",
            "--fleet",
            "f",
            "--device-id",
            "d",
            "--state-dir",
            str(tmp_path / "state"),
            *options,
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("edge-agent: ") and message in lines[0], result.stderr


def stream_on(tmp_path: Path, settings: AgentSettings) -> tuple[StreamAcquirer, QueryBook]:
    """A stream acquirer over a folder device holding six real images, with a burst of two labels."""
    images = load_fashion_mnist().test_images[4000:4006]
    for i, image in enumerate(images):
        write_png(tmp_path / "camera" / f"{i}.png", image, age_seconds=60 - i)
    data = open_folder_data(tmp_path / "state", tmp_path / "camera", pool_cap=100, settle_seconds=0)
    book = QueryBook(tmp_path / "labelling")
    oracle = FolderOracle(book, data, wait_seconds=0)
    return StreamAcquirer(data, oracle, BudgetSettings(3600.0, 2.0), settings, passes=2), book


def test_stream_scores_with_the_recipes_sampler_and_refuses_one_that_needs_more(tmp_path, caplog) -> None:
    stream, book = stream_on(tmp_path, AgentSettings(FLEET, DEVICE))
    weights = get_weights(build_model(seed=9))
    with caplog.at_level("INFO", logger="edge_agent.field.parts"):
        stream.score_new(LatestModel(DEFAULT_SPEC, weights, messages.Recipe(sampler="ksas"), None, ""), round_id=1)
        stream.score_new(LatestModel(DEFAULT_SPEC, weights, messages.Recipe(sampler="ksas"), None, ""), round_id=1)
        assert stream.data.get_state("stream") is None and book.queries() == []
        stream.score_new(LatestModel(DEFAULT_SPEC, weights, messages.Recipe(sampler="margin"), None, ""), round_id=1)
    refused = [r for r in caplog.records if "stream acquisition refused sampler=ksas" in r.getMessage()]
    assert len(refused) == 1 and refused[0].levelname == "ERROR"
    assert stream.data.get_state("stream")["scored_upto"] == 6 and 1 <= len(book.queries()) <= 2
    assert any("stream scored sampler=margin new=6" in r.getMessage() for r in caplog.records)


def test_stream_scores_through_the_agents_back_end(tmp_path) -> None:
    settings = AgentSettings(FLEET, DEVICE, backend="onnxruntime")
    stream, _ = stream_on(tmp_path, settings)
    latest = LatestModel(DEFAULT_SPEC, get_weights(build_model(seed=9)), messages.Recipe(sampler="entropy"), None, "")
    with pytest.raises(ValueError, match="the onnxruntime back end needs the round's bundle"):
        stream.score_new(latest, round_id=1)


HEAD_SPEC = dataclasses.replace(DEFAULT_SPEC, trainable="head")
HEAD_WEIGHTS = get_weights(build_model(HEAD_SPEC, seed=7))


def launch_head_agent(tmp_path: Path, coordinator: FakeCoordinator, launch) -> subprocess.Popen:
    """A Pi Zero (head-only) field agent, and the frozen-backbone model's bundle published for it."""
    files = ensure_bundle_files(HEAD_WEIGHTS, tmp_path / "bundle", HEAD_SPEC)
    bundle = messages.BundleMessage(weights_hash(HEAD_WEIGHTS), files)
    agent = launch("--answer-wait", "0", "--profile", str(PI_ZERO))
    topic = topics.BUNDLE.build(fleet=FLEET, hash=bundle.model_hash)
    coordinator.session.publish(topic, wire.encode(bundle), retain=True, wait=10)
    return agent


def head_round(tmp_path: Path, coordinator: FakeCoordinator, round_id: int) -> None:
    """Starts a round of the head-only model and waits for the device's update of it."""
    coordinator.start_round(round_id, HEAD_WEIGHTS, recipe=RECIPE, spec=HEAD_SPEC)
    update = coordinator.next_on(
        "update", 60, accept=lambda m: wire.decode(m.payload, messages.Update).round_id == round_id
    )
    assert update is not None, (tmp_path / "agent.log").read_text()[-3000:]


def test_a_head_only_field_agent_whose_feature_cache_cannot_be_written_keeps_running(tmp_path, camera) -> None:
    """`features` in the state folder is a file (root cannot make a folder there): the Pi Zero agent computes its
    features without keeping them, warns once naming the folder, and answers two rounds without a traceback."""
    pool_dir, _ = camera
    (tmp_path / "state").mkdir()
    (tmp_path / "state" / "features").write_text("a file where the feature cache's folder would be")
    with field_run(tmp_path, pool_dir) as (coordinator, launch, _):
        agent = launch_head_agent(tmp_path, coordinator, launch)
        for round_id in (1, 2):
            head_round(tmp_path, coordinator, round_id)
        assert agent.poll() is None
        stop(agent)
    log = (tmp_path / "agent.log").read_text()
    warned = [line for line in log.splitlines() if "feature cache folder cannot be written" in line]
    assert len(warned) == 1 and str(tmp_path / "state" / "features") in warned[0] and "Traceback" not in log


def test_a_head_only_field_agent_with_its_feature_cache_on_a_full_tmpfs_answers_across_a_restart(
    tmp_path, camera
) -> None:
    """`features/` on a tmpfs with six pages left: room for the first scan batch's rows (4 of 3232 bytes) and the
    meta, not for the cache's first block. The cache grew its file sparse, claimed the block in its meta, hit
    ENOSPC on the next batch, and the restarted agent memory-mapped the holes: SIGBUS, a crash loop. Now the block
    is allocated before a meta claims it: each process warns once that the folder cannot be written (no space),
    computes its features without keeping them, and answers its round; once space is freed, the next agent keeps
    them again, quietly."""
    pool_dir, _ = camera
    with mounted_tmpfs(tmp_path / "state" / "features") as features:
        filler = fill_leaving(features, 6)
        with field_run(tmp_path, pool_dir) as (coordinator, launch, _):

            def answered(round_id: int) -> None:
                """A fresh agent answers this round and stops cleanly."""
                agent = launch_head_agent(tmp_path, coordinator, launch)
                head_round(tmp_path, coordinator, round_id)
                assert agent.poll() is None
                stop(agent)

            answered(1)
            answered(2)
            filler.unlink()
            freed = (tmp_path / "agent.log").stat().st_size
            answered(3)
        assert OnDisk(features).meta["capacity"] == 256
    log = (tmp_path / "agent.log").read_text()
    warned = [line for line in log.splitlines() if "feature cache folder cannot be written" in line]
    assert len(warned) == 2 and all("No space left on device" in line for line in warned) and "Traceback" not in log
    assert "feature cache" not in "".join(line for line in log[freed:].splitlines() if "WARNING" in line)


def forge_rows(disk: OnDisk, digests: np.ndarray, forged: list[int], forgery: str) -> None:
    """Rewrites the cache with valid tags (computed from `pool/digests.bin`): the forged rows NaN, or 3e38 in a
    float32 cache, or every row of another width."""
    rows = disk.records()["row"][:30].astype(np.float32)
    if forgery == "wider":
        rows = np.random.default_rng(0).normal(size=(30, rows.shape[1] + 8)).astype(np.float32)
    else:
        rows[forged] = np.nan if forgery == "nan" else 3e38
    rows = rows.astype(np.float16 if forgery != "huge" else np.float32)
    disk.forge(rows, [digest.tobytes() for digest in digests[:30]])


@pytest.mark.parametrize(
    ("forgery", "warned"),
    [
        ("nan", "rows failed their check, recomputing key={key} rows=5 not_theirs=0 not_finite=5 beyond_limit=0"),
        ("huge", "rows failed their check, recomputing key={key} rows=5 not_theirs=0 not_finite=0 beyond_limit=5"),
        ("wider", "rows are not of the prefix's width, rebuilding key={key} width={width} prefix={dim}"),
    ],
    ids=["nan", "3e38", "wider"],
)
def test_a_head_only_field_agent_restarted_on_forged_rows_with_valid_tags_recomputes_them_and_answers(
    tmp_path, camera, forgery: str, warned: str
) -> None:
    """The crash loops of issues 33 and 43: after a round, cached rows are forged with tags recomputed from
    `pool/digests.bin` (a person with shell access and the layout): five rows NaN, or five finite rows of 3e38 in
    a float32 cache (the tail's softmax made them NaN), or every row of another width (the tail could not take
    them). The restarted agent answers the next round, with one bounded warning naming the fault, and the rows on
    disk are the prefix's again. The forged rows are of images not asked in round 1 (those round 2 scores)."""
    pool_dir, _ = camera
    with field_run(tmp_path, pool_dir) as (coordinator, launch, book):
        first = launch_head_agent(tmp_path, coordinator, launch)
        head_round(tmp_path, coordinator, 1)
        stop(first)
        disk = OnDisk(tmp_path / "state" / "features")
        dim = disk.meta["dim"]
        digests = np.fromfile(tmp_path / "state" / "pool" / "digests.bin", np.uint8).reshape(-1, 32)
        asked = {query.index for query in book.queries()}
        forged = [index for index in range(30) if index not in asked][:5]  # rows round 2 scores
        forge_rows(disk, digests, forged, forgery)
        restarted = (tmp_path / "agent.log").stat().st_size
        agent = launch_head_agent(tmp_path, coordinator, launch)
        head_round(tmp_path, coordinator, 2)
        stop(agent)
    log = (tmp_path / "agent.log").read_text()[restarted:]
    failed = [line for line in log.splitlines() if "feature cache rows" in line and "WARNING" in line]
    expected = warned.format(key=disk.meta["key"][:12], width=dim + 8, dim=dim)
    assert len(failed) == 1 and expected in failed[0] and len(failed[0]) < 400 and "Traceback" not in log, failed
    again = OnDisk(tmp_path / "state" / "features")
    assert again.meta["dim"] == dim and (np.abs(again.records()["row"][:30].astype(np.float32)) <= ROW_LIMIT).all()
