# The serving version on the coordinator: the promotion gate (pure), the stored history, `promote` and `rollback`.
from __future__ import annotations

import sqlite3
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from coordinators import FakeSession, ServingRecorder

from coordinator.cli import main
from coordinator.dashboard.report import write_report
from coordinator.dashboard.server import Dashboard, ListenAddress
from coordinator.dashboard.views import load_snapshot, rounds_view, run_view
from coordinator.rounds.promotion import GateEvidence, PairedTable, PromotionGate
from coordinator.rounds.publisher import Artefacts, RetainedPublisher
from coordinator.rounds.serving import W0_ACCURACY, W0_CLASS_ACCURACY, Judge, ServingKeeper
from coordinator.storage.serving_history import GATE, HELD, PERSON, PROMOTED, ROLLED_BACK, serving_stack
from coordinator.storage.store import RoundRecord, RunStore
from protocol import topics
from protocol.serving_messages import ServingMessage
from protocol.tensors import weights_hash

NAMES = ("cat", "dog", "cow")


def recall_judge(store: RunStore) -> Judge:
    """The gate's evidence from the stored per-class recalls, as if each class had 100 test images and a model of
    recall r got the first 100 r of them right (the weights here are stand-ins no model can score)."""

    def recalls(version: int) -> list[float]:
        if version == 0:
            return list((store.config() or {})[W0_CLASS_ACCURACY])
        return next(r.metrics["class_accuracy"] for r in store.rounds() if r.round_id == version)

    def judge(candidate: int, serving: int) -> GateEvidence:
        right = [(round(100 * new), round(100 * old)) for new, old in zip(recalls(candidate), recalls(serving))]
        columns = [(min(new, old), max(0, old - new), max(0, new - old), 100 - max(new, old)) for new, old in right]
        counts = np.array(columns, dtype=np.int64).T
        empty = np.zeros(len(columns), dtype=np.int64)
        return GateEvidence(PairedTable(*counts), PairedTable(empty, empty, empty, empty))

    return judge


def test_the_stack_pushes_promotions_and_pops_rollbacks() -> None:
    class Row:
        def __init__(self, round_id: int, decision: str) -> None:
            self.round_id, self.decision = round_id, decision

    rows = [Row(1, PROMOTED), Row(2, HELD), Row(3, PROMOTED), Row(3, ROLLED_BACK), Row(1, ROLLED_BACK)]
    assert serving_stack(rows[:3]) == [0, 1, 3]
    assert serving_stack(rows) == [0]
    assert serving_stack([*rows, Row(0, ROLLED_BACK)]) == [0]


def record(round_id: int, accuracy: float, per_class: list[float], abandoned: bool = False) -> RoundRecord:
    """A committed round's record with the held-out scores the gate reads."""
    metrics: dict = {"class_accuracy": per_class}
    if abandoned:
        metrics["secure_aggregation"] = "abandoned"
    return RoundRecord(round_id, 1.0, 2.0, "ab" * 32, accuracy, 10, 1, 0, {}, metrics)


def weights_of(round_id: int) -> dict[str, np.ndarray]:
    """A tiny distinct model per round."""
    return {"w": np.full(3, float(round_id), dtype=np.float32)}


def filled_run(run_dir: Path) -> None:
    """A run of four committed rounds: 1 better than W0, 2 worse, 3 better, 4 abandoned."""
    with RunStore(run_dir) as store:
        store.set_config({"run_id": "r", W0_ACCURACY: 0.5, W0_CLASS_ACCURACY: [0.5, 0.5, 0.5]})
        store.checkpoints.save(0, weights_of(0))
        for each in (
            record(1, 0.6, [0.6, 0.6, 0.6]),
            record(2, 0.4, [0.4, 0.4, 0.4]),
            record(3, 0.7, [0.7, 0.7, 0.7]),
            record(4, 0.7, [0.7, 0.7, 0.7], abandoned=True),
        ):
            store.checkpoints.save(each.round_id, weights_of(each.round_id))
            store.commit_round(each, [])


def test_the_keeper_decides_each_round_once_and_publishes_what_serves(tmp_path: Path) -> None:
    filled_run(tmp_path)
    recorder = ServingRecorder()
    with RunStore(tmp_path) as store:
        keeper = ServingKeeper(store, recorder, PromotionGate(), NAMES, recall_judge(store))  # type: ignore[arg-type]
        keeper.refresh()
        keeper.refresh()
        events = store.serving.events()
        assert [(e.round_id, e.decision, e.serving, e.who) for e in events] == [
            (1, PROMOTED, 1, GATE),
            (2, HELD, 1, GATE),
            (3, PROMOTED, 3, GATE),
            (4, HELD, 3, GATE),
        ]
        assert events[1].reason.startswith("accuracy fell 20.0 points (0.6000 to 0.4000) on the server's test set")
        assert "abandoned" in events[3].reason
        assert [(m.version, m.model_hash) for m in recorder.published] == [(3, weights_hash(weights_of(3)))]


def coordinator_cli(*argv: str) -> int:
    """fl-coordinator in this process."""
    return main(list(argv))


def test_promote_and_rollback_walk_the_history(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    filled_run(tmp_path)
    recorder = ServingRecorder()
    with RunStore(tmp_path) as store:
        ServingKeeper(store, recorder, PromotionGate(), NAMES, recall_judge(store)).refresh()  # type: ignore[arg-type]
    assert coordinator_cli("promote", str(tmp_path), "--round", "2") == 0
    assert "round 2 serves" in capsys.readouterr().out
    assert coordinator_cli("rollback", str(tmp_path)) == 0
    assert "round 3 serves again (was round 2)" in capsys.readouterr().out
    for _ in range(2):
        assert coordinator_cli("rollback", str(tmp_path)) == 0
    assert "W0 (round 0) serves again (was round 1)" in capsys.readouterr().out
    with RunStore(tmp_path) as store:
        assert store.serving.serving_version() == 0
        assert store.serving.events()[-1].who == PERSON
        keeper = ServingKeeper(store, recorder, PromotionGate(), NAMES, recall_judge(store))  # type: ignore[arg-type]
        keeper.refresh()
    assert recorder.published[-1].version == 0


@pytest.mark.parametrize(
    ("argv", "error"),
    [
        (
            ("promote", "{run}", "--round", "9"),
            "--round 9: no such committed round (the run has committed rounds 1 to 4)",
        ),
        (
            ("promote", "{run}", "--round", "4"),
            "--round 4: the round was abandoned, its model is the one it started from",
        ),
        (("promote", "{run}", "--round", "0"), "--round 0: W0 (round 0) serves already"),
        (("rollback", "{run}"), "no earlier version to roll back to: W0 (round 0) is the first that served"),
        (("promote", "{missing}", "--round", "1"), "is not a run directory (no run.sqlite)"),
        (("rollback", "{missing}"), "is not a run directory (no run.sqlite)"),
    ],
)
def test_bad_requests_are_one_line_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: tuple[str, ...], error: str
) -> None:
    filled_run(tmp_path / "run")
    given = [part.format(run=tmp_path / "run", missing=tmp_path / "nothing") for part in argv]
    assert coordinator_cli(*given) == 2
    shown = capsys.readouterr().err.strip()
    assert error in shown
    assert len(shown.splitlines()) == 1
    with RunStore(tmp_path / "run") as store:
        assert store.serving.events() == []


def test_a_promotion_with_no_round_committed_says_so(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with RunStore(tmp_path) as store:
        store.set_config({"run_id": "r"})
    assert coordinator_cli("promote", str(tmp_path), "--round", "1") == 2
    assert "no such committed round (the run has committed none yet)" in capsys.readouterr().err


def test_the_dashboard_metrics_and_report_show_what_serves_and_why_a_round_does_not(tmp_path: Path) -> None:
    filled_run(tmp_path / "run")
    with RunStore(tmp_path / "run") as store:
        ServingKeeper(store, ServingRecorder(), PromotionGate(), NAMES, recall_judge(store)).refresh()  # type: ignore[arg-type]
    snapshot = load_snapshot(tmp_path / "run")
    serving = run_view(snapshot, None)["serving"]
    assert serving["version"] == 3 and serving["held"]["round"] == 4
    assert (
        serving["summary"]
        == "round 3; round 4 not promoted: the round was abandoned: its model is the one it started from"
    )
    assert [row["serving"]["decision"] for row in rounds_view(snapshot)] == [PROMOTED, HELD, PROMOTED, HELD]
    with Dashboard(ListenAddress("127.0.0.1", 0), tmp_path / "run", None, None) as dashboard:
        metrics = urllib.request.urlopen(dashboard.url + "metrics", timeout=10).read().decode()
    assert "\nfl_serving_version 3\n" in metrics
    page = write_report(tmp_path / "run").read_text()
    assert "<h2>Serving version</h2>" in page and "accuracy fell 20.0 points (0.6000 to 0.4000)" in page


def test_the_serving_model_stays_retained_while_the_latest_moves_on() -> None:
    session = FakeSession("f")
    publisher = RetainedPublisher(session, "f", "r", Artefacts())  # type: ignore[arg-type]
    models = {name: weights_of(index) for index, name in enumerate("abc")}
    hashes = {name: weights_hash(weights) for name, weights in models.items()}

    def model_topics() -> list[tuple[str, bool]]:
        """(model name, cleared) of each publication on a model topic since the last call."""
        names = {topics.MODEL.build(fleet="f", hash=model_hash): name for name, model_hash in hashes.items()}
        found = [(names[topic], payload == b"") for topic, payload in session.published if topic in names]
        session.published.clear()
        return found

    publisher.publish_serving(ServingMessage("r", 0, hashes["a"], 1.0), models["a"])
    publisher.publish_model(models["a"], hashes["a"])
    assert model_topics() == [("a", False)]  # one copy for both roles
    publisher.publish_model(models["b"], hashes["b"])
    publisher.publish_model(models["c"], hashes["c"])
    assert model_topics() == [("b", False), ("c", False), ("b", True)]  # a serves: never cleared
    publisher.publish_serving(ServingMessage("r", 3, hashes["c"], 2.0), models["c"])
    assert model_topics() == [("a", True)]  # c is retained already; a no longer serves


def test_a_store_from_before_serving_versions_reads_and_catches_up(tmp_path: Path) -> None:
    filled_run(tmp_path)
    with sqlite3.connect(tmp_path / "run.sqlite") as connection:  # as an unversioned store of release 0.1.0 was
        connection.execute("DROP TABLE serving")
        connection.execute("PRAGMA user_version = 0")
    with RunStore(tmp_path, read_only=True) as store:  # a report of an old run: nothing to create, nothing served
        assert store.serving.events() == [] and store.revision()[3] is None
    assert run_view(load_snapshot(tmp_path), None)["serving"]["version"] == 0
    with RunStore(tmp_path) as store:  # its coordinator restarted: the table made, every round decided in order
        ServingKeeper(store, ServingRecorder(), PromotionGate(), NAMES, recall_judge(store)).refresh()  # type: ignore[arg-type]
        assert store.serving.serving_version() == 3 and store.serving.undecided_rounds() == []
