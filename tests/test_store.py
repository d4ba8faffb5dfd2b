# Tests for coordinator.storage.store: records, checkpoints, rejections and the spool, on real files, across reopen.
from __future__ import annotations

import sqlite3

import numpy as np
import pytest

from coordinator.storage.store import DeviceRoundRecord, RoundRecord, RunStore
from edge_agent.learning.models import build_model, get_weights
from protocol.files import save_arrays
from protocol.tensors import weights_hash


@pytest.fixture
def store(tmp_path):
    """A fresh RunStore in a temporary run directory, closed after the test."""
    with RunStore(tmp_path / "run") as run_store:
        yield run_store


def round_record(round_id: int, model_hash: str = "ab" * 32) -> RoundRecord:
    """A plausible closed round with nested report and metrics."""
    return RoundRecord(
        round_id=round_id,
        started_at=1000.0 + round_id,
        closed_at=1010.5 + round_id,
        model_hash=model_hash,
        accuracy=0.5 + round_id / 100,
        labels=400 * (round_id + 1),
        accepted=2,
        rejected=1,
        report={"strategy": "avefl", "weights": {"dev-a": 0.25, "dev-b": 0.75}},
        metrics={"loss": 1.25, "per_class": [0.1] * 10},
    )


def device_record(round_id: int, device_id: str, accepted: bool = True) -> DeviceRoundRecord:
    """A plausible per-device record, using numpy scalars the way the round code produces them."""
    return DeviceRoundRecord(
        round_id=round_id,
        device_id=device_id,
        accepted=accepted,
        reason="" if accepted else "stale base hash",
        num_samples=int(np.int64(120)),
        class_counts=list(np.arange(10, dtype=np.int64)),
        local_accuracy=None if not accepted else float(np.float32(0.75)),
        divergence={"conv1.weight": np.float32(0.5), "fc2.bias": 0.125},
        update_bytes=123456,
        received_at=1005.25,
    )


def test_layout_and_wal(tmp_path):
    with RunStore(tmp_path / "run"):
        assert (tmp_path / "run" / "run.sqlite").is_file()
        assert (tmp_path / "run" / "checkpoints").is_dir()
    connection = sqlite3.connect(tmp_path / "run" / "run.sqlite")
    assert connection.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    connection.close()


def test_config_round_trip(store):
    assert store.config() is None
    store.set_config({"strategy": "avefl", "devices": 4, "sampler": {"name": "entropy", "passes": 10}})
    store.set_config({"strategy": "optfl", "devices": 4})
    assert store.config() == {"strategy": "optfl", "devices": 4}


def test_round_records_round_trip(store):
    store.commit_round(round_record(0), [device_record(0, "dev-b"), device_record(0, "dev-a", accepted=False)])
    store.commit_round(round_record(1), [device_record(1, "dev-a")])
    assert store.rounds() == [round_record(0), round_record(1)]
    assert store.last_committed_round() == 1
    records = store.device_rounds(0)
    assert [r.device_id for r in records] == ["dev-a", "dev-b"]
    assert records[0].accepted is False and records[0].reason == "stale base hash"
    assert records[0].local_accuracy is None and records[1].local_accuracy == 0.75
    assert records[1].class_counts == list(range(10))
    assert records[1].divergence == {"conv1.weight": 0.5, "fc2.bias": 0.125}
    assert [(r.round_id, r.device_id) for r in store.device_rounds()] == [(0, "dev-a"), (0, "dev-b"), (1, "dev-a")]


def test_committing_a_round_twice_raises_and_keeps_the_first(store):
    store.commit_round(round_record(3), [device_record(3, "dev-a")])
    changed = round_record(3, model_hash="cd" * 32)
    with pytest.raises(ValueError, match="round 3 is already committed"):
        store.commit_round(changed, [device_record(3, "dev-z")])
    assert store.rounds() == [round_record(3)]
    assert [r.device_id for r in store.device_rounds(3)] == ["dev-a"]


def test_commit_is_all_or_nothing(store):
    with pytest.raises(ValueError, match="listed twice"):
        store.commit_round(round_record(0), [device_record(0, "dev-a"), device_record(0, "dev-a")])
    with pytest.raises(ValueError, match="report is not JSON"):
        store.commit_round(RoundRecord(**{**vars(round_record(0)), "report": {"x": object()}}), [])
    with pytest.raises(ValueError, match="invalid device id"):
        store.commit_round(round_record(0), [device_record(0, "../etc")])
    with pytest.raises(ValueError, match="record is for round 1, not 0"):
        store.commit_round(round_record(0), [device_record(1, "dev-a")])
    assert store.last_committed_round() is None and store.rounds() == [] and store.device_rounds() == []
    store.commit_round(round_record(0), [device_record(0, "dev-a")])
    assert store.last_committed_round() == 0


def test_checkpoint_round_trip_with_real_model(store):
    weights = get_weights(build_model(seed=0))
    saved_hash = store.checkpoints.save(3, weights)
    assert saved_hash == weights_hash(weights)
    assert (store.run_dir / "checkpoints" / "round_0003.npz").is_file()
    loaded = store.checkpoints.load(3)
    assert set(loaded) == set(weights)
    assert all(
        np.array_equal(loaded[name], weights[name]) and loaded[name].dtype == weights[name].dtype for name in weights
    )
    assert store.checkpoints.latest_round() == 3
    store.checkpoints.save(1, weights)
    assert store.checkpoints.latest_round() == 3


def test_corrupted_checkpoint_detected(store):
    weights = get_weights(build_model(seed=1))
    store.checkpoints.save(2, weights)
    path = store.checkpoints.path(2)
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    path.write_bytes(bytes(raw))
    with pytest.raises(ValueError, match="round_0002.npz"):
        store.checkpoints.load(2)


def test_swapped_checkpoint_fails_hash_check(store):
    store.checkpoints.save(2, get_weights(build_model(seed=1)))
    save_arrays(store.checkpoints.path(2), get_weights(build_model(seed=2)))  # valid npz, wrong model
    with pytest.raises(ValueError, match="round_0002.npz.*differs from the recorded"):
        store.checkpoints.load(2)
    with pytest.raises(FileNotFoundError, match="no checkpoint recorded for round 9"):
        store.checkpoints.load(9)


def test_committed_checkpoint_cannot_be_replaced(store):
    weights = get_weights(build_model(seed=1))
    model_hash = store.checkpoints.save(4, weights)
    store.commit_round(round_record(4, model_hash), [])
    assert store.checkpoints.save(4, weights) == model_hash  # re-saving the same model is harmless
    with pytest.raises(ValueError, match="round 4 is committed"):
        store.checkpoints.save(4, get_weights(build_model(seed=2)))
    assert weights_hash(store.checkpoints.load(4)) == model_hash


def test_rejections_counted_immediately(store):
    store.record_rejection(2, "dev-a", "bad signature", 100)
    store.record_rejection(2, "dev-b", "bad signature", 120)
    store.record_rejection(3, "dev-a", "stale round", 90)
    assert store.rejection_counts() == {"bad signature": 2, "stale round": 1}
    assert store.last_committed_round() is None


def test_spool_round_trip(store):
    store.spool.add(3, "dev-a", b"\x81\xa1a\x01")
    store.spool.add(3, "dev.b_2", b"payload-b")
    store.spool.add(4, "dev-a", b"next round")
    assert [path.name for path in (store.run_dir / "spool" / "round_0003").iterdir()] == ["segment_000001.log"]
    assert store.spool.payloads(3) == {"dev-a": b"\x81\xa1a\x01", "dev.b_2": b"payload-b"}
    assert store.spool.payloads(7) == {}


@pytest.mark.parametrize("device_id", ["../escape", "a/b", "", "x" * 65, "dev a", "dev\n"])
def test_spool_rejects_unsafe_device_ids(store, device_id):
    with pytest.raises(ValueError, match="invalid device id"):
        store.spool.add(1, device_id, b"x")
    assert not (store.run_dir / "spool").exists() or not any((store.run_dir / "spool").rglob("*"))
    assert not (store.run_dir / "escape.msgpack").exists()


def test_reopened_store_resumes(tmp_path):
    weights = get_weights(build_model(seed=0))
    with RunStore(tmp_path / "run") as first:
        first.set_config({"rounds": 10})
        model_hash = first.checkpoints.save(0, weights)
        first.commit_round(round_record(0, model_hash), [device_record(0, "dev-a")])
        first.record_rejection(1, "dev-b", "too large", 10**7)
        first.spool.add(1, "dev-a", b"pending")
    with RunStore(tmp_path / "run") as second:
        assert second.config() == {"rounds": 10}
        assert second.last_committed_round() == 0
        assert second.rounds() == [round_record(0, model_hash)]
        assert [r.device_id for r in second.device_rounds(0)] == ["dev-a"]
        assert second.checkpoints.latest_round() == 0
        assert weights_hash(second.checkpoints.load(0)) == model_hash
        assert second.rejection_counts() == {"too large": 1}
        assert second.spool.payloads(1) == {"dev-a": b"pending"}


def test_committing_a_round_deletes_its_spool_and_earlier_ones_but_not_later_ones(store):
    for round_id in (1, 2, 3):
        store.spool.add(round_id, "dev-a", b"payload")
    store.commit_round(round_record(2), [device_record(2, "dev-a")])
    assert [path.name for path in (store.run_dir / "spool").iterdir()] == ["round_0003"]
    assert store.spool.payloads(3) == {"dev-a": b"payload"}


def test_keep_updates_keeps_the_spool_of_committed_rounds(tmp_path):
    with RunStore(tmp_path / "run", keep_updates=True) as kept:
        kept.spool.add(1, "dev-a", b"payload")
        kept.commit_round(round_record(1), [device_record(1, "dev-a")])
        assert kept.spool.payloads(1) == {"dev-a": b"payload"}
