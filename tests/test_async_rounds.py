# Asynchronous rounds (FedBuff): the fold's math, stale updates refused, and a killed coordinator resuming its buffer.
from __future__ import annotations

import math
import os
from pathlib import Path

import numpy as np
import pytest
from fleet import FakeDevice, committed_rounds, kill, log_text, perturbed, start_coordinator, wait_exit

from bench.cli import main as bench_main
from coordinator.asynchronous.buffer import delta_of, fold_buffer, staleness_weight
from coordinator.asynchronous.intake import AsyncPolicy, VersionCollector
from coordinator.intake.validation import MAX_REASON_CHARS, Expectation, Rejection, decoded
from coordinator.storage.store import RunStore
from coordinator.strategies.aggregate import ClientUpdate
from coordinator.strategies.means import AveFL
from protocol import messages, wire
from protocol.tensors import spec_of, weights_hash

BASE = {"w": np.array([1.0, 2.0], dtype=np.float32)}


def offer(collector: VersionCollector, device_id: str, payload: bytes) -> tuple[messages.Update, bool]:
    """The collector's verdict on a payload, decoded once as the intake decodes it."""
    return collector.offer(decoded(device_id, payload, collector.expectation))


def test_the_fold_matches_hand_computed_values_in_any_order() -> None:
    """W + eta * (s(0) * d_a + s(3) * d_b) / 2 with s(tau) = 1/sqrt(1 + tau): s(0) = 1, s(3) = 1/2."""
    d_a = {"w": np.array([0.4, -0.2])}
    d_b = {"w": np.array([1.0, 1.0])}
    assert (staleness_weight(0), staleness_weight(3), staleness_weight(8)) == (1.0, 0.5, 1.0 / 3.0)
    folded = fold_buffer(BASE, {"a": (d_a, 0), "b": (d_b, 3)})
    np.testing.assert_allclose(folded["w"], [1.0 + (0.4 + 0.5) / 2, 2.0 + (-0.2 + 0.5) / 2], rtol=1e-7)
    assert folded["w"].dtype == np.float32
    halved = fold_buffer(BASE, {"b": (d_b, 3), "a": (d_a, 0)}, server_lr=0.5)
    np.testing.assert_allclose(halved["w"], [1.0 + 0.5 * 0.45, 2.0 + 0.5 * 0.15], rtol=1e-7)
    assert np.array_equal(fold_buffer(BASE, {"b": (d_b, 3), "a": (d_a, 0)})["w"], folded["w"])
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="staleness is an integer"):
            staleness_weight(bad)  # type: ignore[arg-type]


def test_fresh_updates_with_a_buffer_of_every_device_fold_to_avefls_mean() -> None:
    """At staleness 0, K = every device and eta_g = 1, FedBuff's step is the plain mean of the models."""
    models = [perturbed(BASE, seed) for seed in range(3)]
    folded = fold_buffer(BASE, {str(i): (delta_of(model, BASE), 0) for i, model in enumerate(models)})
    mean = AveFL().aggregate(BASE, [ClientUpdate(str(i), m, 1) for i, m in enumerate(models)], None)[0]
    np.testing.assert_allclose(folded["w"], mean["w"], rtol=1e-6)


def signed_update(device: str, round_id: int, base: dict, tensors: dict, update_id: str = "") -> bytes:
    """An encoded update of `round_id` trained from `base` (its hash), carrying `tensors`."""
    return wire.encode(
        messages.Update(
            *(device, round_id, update_id or os.urandom(8).hex(), weights_hash(base), 10, [1] * 10, 5, {}, tensors),
            nonce=os.urandom(16),
        )
    )


def test_an_update_older_than_the_allowed_staleness_is_refused_as_stale(tmp_path: Path) -> None:
    """S = 1: from version 0 an update is taken at version 0 and 1, refused as `stale` at version 2; a second update
    of a device from the same version is a duplicate, a redelivery is re-acked, one from the future is refused, and a
    device's update arriving while its first still waits goes into the next buffer."""
    models = [BASE, perturbed(BASE, 1), perturbed(BASE, 2)]
    template = Expectation(1, weights_hash(BASE), spec_of(BASE), 10, 1 << 20, base=BASE)
    collector = VersionCollector(template, AsyncPolicy(buffer=2, max_staleness=1), 0, BASE, tmp_path)
    first = signed_update("dev-a", 1, BASE, perturbed(BASE, 5))
    assert offer(collector, "dev-a", first)[0].round_id == 1
    assert offer(collector, "dev-a", first)[1] is False
    with pytest.raises(Rejection) as again:
        offer(collector, "dev-a", signed_update("dev-a", 1, BASE, perturbed(BASE, 6)))
    assert again.value.kind == "duplicate"
    with pytest.raises(Rejection) as future:
        offer(collector, "dev-b", signed_update("dev-b", 2, models[1], perturbed(BASE, 7)))
    assert future.value.kind == "future_round"
    assert not collector.full()

    collector.fold_next(models[1])
    assert offer(collector, "dev-b", signed_update("dev-b", 1, BASE, perturbed(BASE, 8)))[0].round_id == 2
    assert offer(collector, "dev-b", signed_update("dev-b", 2, models[1], perturbed(BASE, 9)))[0].round_id == 3
    assert offer(collector, "dev-a", first) == (offer(collector, "dev-a", first)[0], False)  # folded into 1: re-acked
    collector.fold_next(models[2])
    assert sorted(collector.buffer) == ["dev-b"] and collector.buffer["dev-b"].base == 1
    with pytest.raises(Rejection) as stale:
        offer(collector, "dev-c", signed_update("dev-c", 1, BASE, perturbed(BASE, 10)))
    assert stale.value.kind == messages.RejectionKind.STALE == "stale"
    assert "version 0, 2 behind 2 (at most 1)" in stale.value.reason and len(stale.value.reason) <= MAX_REASON_CHARS


@pytest.mark.parametrize(
    ("flags", "error"),
    [
        (["--buffer", "2"], "--buffer only apply to --mode async"),
        (["--max-staleness", "2"], "--max-staleness only apply to --mode async"),
        (["--async-server-lr", "0.5"], "--async-server-lr only apply to --mode async"),
        (["--mode", "async"], "--mode async needs --buffer K"),
        (["--mode", "async", "--buffer", "0"], "--buffer must be at least 1"),
        (["--mode", "async", "--buffer", "2", "--max-staleness", "-1"], "--max-staleness must be at least 0"),
        (["--mode", "async", "--buffer", "2", "--strategy", "fedavg"], "use --strategy avefl"),
        (["--slow-factor", "0.5"], "--slow-factor must lie in [1, 1000]"),
    ],
)
def test_bad_async_settings_are_one_line_errors(flags: list[str], error: str, capsys, tmp_path: Path) -> None:
    assert bench_main(["simulate", "--run-dir", str(tmp_path), *flags]) == 2
    assert error in capsys.readouterr().err


ASYNC = ("--mode", "async", "--buffer", "2", "--max-staleness", "1", "--rounds", "3")


def publish_until_acked(device: FakeDevice, payload: bytes) -> messages.Ack:
    """Publishes an update and returns its ack."""
    device.publish(payload)
    return device.acks(1)[0]


def checkpoint(run_dir: Path, version: int) -> dict:
    """The committed model of a version."""
    with RunStore(run_dir) as store:
        return store.checkpoints.load(version)


@pytest.mark.integration
def test_versions_fold_stale_weighted_and_a_killed_coordinator_resumes_its_buffer(
    tmp_path: Path, broker, processes
) -> None:
    """K = 2, S = 1 over a real broker and coordinator process. Version 1: a and b, fresh. Version 2: c's update
    from version 0 (one version old) and a's fresh one; c's next update, sent while its first still waits, goes
    into version 3's buffer; b's new update from version 0 is two versions old: `stale`. SIGKILL; the restarted
    coordinator takes c's update back from the spool, re-acks a redelivery of a's folded update without folding it
    again, and folds version 3 from c (one version old, weight 1/sqrt(2)) and a: every version bit for bit as
    computed here from the models the devices sent."""
    run_dir = tmp_path / "run"
    processes.append(start_coordinator(broker.address, run_dir, "buffered", *ASYNC))
    a, b, c = (FakeDevice(broker.address, "buffered", name) for name in ("dev-a", "dev-b", "dev-c"))
    try:
        _, w0 = a.current_round()
        a_1, b_1, c_1 = perturbed(w0, 1), perturbed(w0, 2), perturbed(w0, 3)
        assert publish_until_acked(a, signed_update("dev-a", 1, w0, a_1)).accepted
        assert publish_until_acked(b, signed_update("dev-b", 1, w0, b_1)).accepted
        _, w1 = c.current_round(after=1)
        assert publish_until_acked(c, signed_update("dev-c", 1, w0, c_1)).round_id == 2
        c_2 = perturbed(w1, 4)
        assert publish_until_acked(c, signed_update("dev-c", 2, w1, c_2)).round_id == 3
        a_2 = perturbed(w1, 5)
        a_2_payload = signed_update("dev-a", 2, w1, a_2)
        assert publish_until_acked(a, a_2_payload).accepted
        _, w2 = a.current_round(after=2)
        stale = publish_until_acked(b, signed_update("dev-b", 1, w0, perturbed(w0, 6)))
        assert (stale.accepted, stale.rejection) == (False, "stale")
        kill(processes[0])
        assert committed_rounds(run_dir) == [(1, 2), (2, 2)]

        processes.append(start_coordinator(broker.address, run_dir, "buffered", *ASYNC))
        redelivered = publish_until_acked(a, a_2_payload)
        assert (redelivered.accepted, redelivered.round_id) == (True, 2)
        a_3 = perturbed(w2, 7)
        assert publish_until_acked(a, signed_update("dev-a", 3, w2, a_3)).accepted
    finally:
        for device in (a, b, c):
            device.close()
    assert wait_exit(processes[1], "restarted coordinator") == 0
    assert committed_rounds(run_dir) == [(1, 2), (2, 2), (3, 2)]
    assert "resumed spooled update device=dev-c round=3" in log_text(run_dir / "coordinator.log")
    expected = {
        1: fold_buffer(w0, {"a": (delta_of(a_1, w0), 0), "b": (delta_of(b_1, w0), 0)}),
        2: fold_buffer(w1, {"a": (delta_of(a_2, w1), 0), "c": (delta_of(c_1, w0), 1)}),
        3: fold_buffer(w2, {"a": (delta_of(a_3, w2), 0), "c": (delta_of(c_2, w1), 1)}),
    }
    for version, model in expected.items():
        stored = checkpoint(run_dir, version)
        assert all(np.array_equal(stored[name], model[name]) for name in model), f"version {version} differs"
    with RunStore(run_dir) as store:
        report = store.rounds()[2].report
        assert {item["device"]: item["staleness"] for item in report["folded"]} == {"dev-a": 0, "dev-c": 1}
        assert report["staleness_weights"]["dev-c"] == pytest.approx(1 / math.sqrt(2))
        assert store.rejection_kinds() == {"stale": 1}
        assert list((run_dir / "spool").iterdir()) == []


def test_a_slowdown_below_one_is_a_one_line_error(capsys, tmp_path: Path) -> None:
    """The bench's slow-device knob refuses a device faster than itself before anything starts."""
    shard = tmp_path / "missing.npz"
    argv = ["device", "--broker", "mqtt://127.0.0.1:1", "--fleet", "f", "--device-id", "d", "--data", str(shard)]
    assert bench_main([*argv, "--slowdown", "0.5"]) == 2
    assert "--slowdown must lie in [1, 1000], got 0.5" in capsys.readouterr().err
