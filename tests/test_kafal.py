# KAFAL (ALGORITHMS.md section 2): KSAS scores, KCFU losses, Eq. 7 weights, partial participation, the schedule.
from __future__ import annotations

import dataclasses
import math
import threading
import time

import msgpack
import numpy as np
import pytest
import torch
from coordinators import local_coordinator
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from bench.oracle import SimulatedOracle
from bench.shard import Shard, open_device_data
from coordinator.intake.update_intake import RoundCollector
from coordinator.intake.validation import Expectation
from coordinator.rounds.evaluation import Evaluator, LabelledSplit
from coordinator.rounds.mode import choose_participants
from coordinator.rounds.rules import RoundPolicy
from coordinator.storage.store import RunStore
from coordinator.strategies.aggregate import ClientUpdate
from coordinator.strategies.registry import make_strategy
from edge_agent.data.device_data import DeviceData
from edge_agent.learning.acquisition_scores import class_prior_bias, ksas_scores
from edge_agent.learning.local_data import LocalData, training_view
from edge_agent.learning.local_rules import KCFU, KeptLabels, make_local_rule
from edge_agent.learning.models import build_model, get_weights, weight_spec
from edge_agent.learning.rule_losses import balanced_cross_entropy, compensation_loss, compensation_weights
from edge_agent.learning.torch_learner import OWN_MODEL_FILE
from edge_agent.learning.torch_rules import train_rule
from edge_agent.learning.training import TrainSettings, run_epochs
from edge_agent.loop.agent import LAST_ROUND_KEY, Agent, last_will
from edge_agent.loop.agent_settings import AgentSettings
from edge_agent.loop.schedule import acquires_in_round, labels_per_acquisition, round_in_active_round
from protocol import messages, topics, wire
from protocol.errors import UsageError
from protocol.model_spec import DEFAULT_SPEC
from protocol.mqtt import MqttSession
from protocol.recipe_flags import declared_fields
from protocol.tensors import weights_hash

logits_strategy = arrays(np.float64, (6, 5), elements=st.floats(-8, 8))
counts_strategy = arrays(np.int64, (5,), elements=st.integers(0, 50))


def softmax(logits: np.ndarray) -> np.ndarray:
    shifted = np.exp(logits - logits.max(axis=1, keepdims=True))
    return shifted / shifted.sum(axis=1, keepdims=True)


def test_lambda_zero_gives_the_symmetric_kl_of_the_plain_softmaxes() -> None:
    rng = np.random.default_rng(0)
    own, glob = rng.normal(size=(20, 10)) * 3, rng.normal(size=(20, 10)) * 3
    p, q = softmax(own), softmax(glob)
    symmetric_kl = np.sum(p * np.log(p / q), axis=1) + np.sum(q * np.log(q / p), axis=1)
    counts = np.array([0, 3, 9, 1, 0, 40, 2, 2, 7, 5])
    np.testing.assert_allclose(ksas_scores(own, glob, counts, lam=0.0), symmetric_kl, rtol=1e-10)
    assert not np.allclose(ksas_scores(own, glob, counts, lam=1.0), symmetric_kl)


@settings(max_examples=60, deadline=None)
@given(logits_strategy, logits_strategy, counts_strategy, st.floats(1.5, 1000), st.floats(0, 3))
def test_scaling_every_count_by_a_constant_leaves_d_unchanged(own, glob, counts, scale, lam) -> None:
    np.testing.assert_allclose(
        ksas_scores(own, glob, counts, lam), ksas_scores(own, glob, counts * scale, lam), rtol=1e-7, atol=1e-9
    )


@settings(max_examples=60, deadline=None)
@given(logits_strategy, logits_strategy, counts_strategy, st.floats(0, 3))
def test_d_is_non_negative_finite_and_zero_when_the_models_agree(own, glob, counts, lam) -> None:
    scores = ksas_scores(own, glob, counts, lam)
    assert np.all(np.isfinite(scores)) and np.all(scores >= -1e-12)
    np.testing.assert_allclose(ksas_scores(own, own, counts, lam), 0.0, atol=1e-12)


def test_classes_without_labels_are_masked_not_nan() -> None:
    """n_c = 0 makes P_c = Q_c = 0; D equals the symmetric KL over the labelled classes' renormalised softmax."""
    rng = np.random.default_rng(1)
    own, glob = rng.normal(size=(8, 4)), rng.normal(size=(8, 4))
    counts = np.array([5, 0, 20, 0])
    seen = counts > 0
    p = softmax(own[:, seen] + np.log(counts[seen]))
    q = softmax(glob[:, seen] + np.log(counts[seen]))
    expected = np.sum((p - q) * (np.log(p) - np.log(q)), axis=1)
    np.testing.assert_allclose(ksas_scores(own, glob, counts, lam=1.0), expected, rtol=1e-10)
    assert class_prior_bias(counts, 1.0)[1] == -np.inf and class_prior_bias(np.zeros(4), 1.0).tolist() == [0.0] * 4


def test_equal_counts_make_the_balanced_loss_plain_cross_entropy() -> None:
    logits = torch.randn(16, 10, generator=torch.Generator().manual_seed(0))
    targets = torch.randint(10, (16,), generator=torch.Generator().manual_seed(1))
    plain = torch.nn.functional.cross_entropy(logits, targets)
    assert torch.allclose(balanced_cross_entropy(logits, targets, np.full(10, 7)), plain)
    skewed = np.array([1, 100, 1, 1, 1, 1, 1, 1, 1, 1])
    expected = torch.nn.functional.cross_entropy(logits + torch.log(torch.tensor(skewed, dtype=torch.float32)), targets)
    assert torch.allclose(balanced_cross_entropy(logits, targets, skewed), expected)
    assert not torch.allclose(expected, plain)


def test_balanced_loss_with_an_unlabelled_class_has_finite_gradients() -> None:
    logits = torch.randn(4, 3, requires_grad=True)
    loss = balanced_cross_entropy(logits, torch.tensor([0, 2, 2, 0]), np.array([3, 0, 5]))
    loss.backward()
    assert torch.isfinite(loss) and torch.all(torch.isfinite(logits.grad))
    assert torch.all(logits.grad[:, 1] == 0)


def test_compensation_weights_are_the_paper_s_total_over_count_up_to_a_constant_and_zero_without_labels() -> None:
    counts = np.array([10, 30, 0, 60])
    gamma = compensation_weights(counts)
    paper = counts.sum() / counts[[0, 1, 3]]
    np.testing.assert_allclose(gamma[[0, 1, 3]] / paper, gamma[0] / paper[0])
    assert gamma[2] == 0.0 and gamma.sum() == pytest.approx(1.0)
    np.testing.assert_allclose(gamma, [2 / 3, 2 / 9, 0.0, 1 / 9])
    assert compensation_weights(np.zeros(4)).tolist() == [0.0] * 4


def test_compensation_loss_vanishes_when_student_equals_teacher_and_grows_otherwise() -> None:
    torch.manual_seed(0)
    teacher = build_model(seed=1).eval()
    student = build_model(seed=1).eval()
    batch = torch.randn(12, 1, 28, 28)
    counts = np.array([5, 1, 0, 9, 3, 3, 3, 3, 3, 3])
    same = compensation_loss(student, teacher, batch, counts, torch.Generator().manual_seed(2))
    assert abs(same.item()) < 1e-6
    other = build_model(seed=2).eval()
    torch.manual_seed(5)
    loss = compensation_loss(other, teacher, batch, counts, torch.Generator().manual_seed(2)).item()
    torch.manual_seed(5)
    partner = torch.randperm(12, generator=torch.Generator().manual_seed(2))
    beta = torch.distributions.Beta(2.0, 2.0).sample((12,))
    with torch.no_grad():
        mixed = beta.view(-1, 1, 1, 1) * batch + (1 - beta.view(-1, 1, 1, 1)) * batch[partner]
        gamma = torch.tensor(compensation_weights(counts), dtype=torch.float32)[teacher(batch).argmax(1)]
        gamma = beta * gamma + (1 - beta) * gamma[partner]
        p = torch.softmax(teacher(mixed), 1)
        q = torch.softmax(other(mixed), 1)
        expected = torch.mean(gamma * torch.sum(p * torch.log(p / q), 1)).item()
    assert loss == pytest.approx(expected, rel=1e-4) and loss > 0


def local_data(fashion, round_in_active: int) -> LocalData:
    images, labels = fashion.test_images[:64], fashion.test_labels[:64].astype(np.int64)
    return LocalData(
        images[:0],
        labels[:0],
        images[:0],
        labels[:0],
        images,
        labels,
        lambda: fashion.test_images[100:228],
        round_in_active_round=round_in_active,
    )


def test_kcfu_uses_only_the_balanced_loss_in_the_first_round_of_an_active_round(fashion) -> None:
    recipe = messages.Recipe(local_rule="kcfu", epochs=1, batch_size=16, learning_rate=0.05)
    start = build_model(seed=3)
    global_model = build_model(seed=3).eval()
    runs = {}
    for round_in_active in (1, 2):
        model = build_model(seed=3)
        metrics = train_rule(KCFU(), model, local_data(fashion, round_in_active), global_model, recipe, seed=7)
        runs[round_in_active] = (get_weights(model), metrics)
    reference = build_model(seed=3)
    counts = np.bincount(fashion.test_labels[:64], minlength=10)
    run_epochs(
        [reference],
        fashion.test_images[:64],
        fashion.test_labels[:64].astype(np.int64),
        TrainSettings.from_recipe(recipe, 7),
        lambda x, y: balanced_cross_entropy(reference(x), y, counts),
    )
    first, second = runs[1][0], runs[2][0]
    assert all(np.array_equal(first[k], v) for k, v in get_weights(reference).items())
    assert any(not np.array_equal(first[k], second[k]) for k in first)
    assert runs[1][1]["compensation"] == 0.0 and runs[2][1]["compensation"] == 1.0
    assert any(not np.array_equal(first[k], v) for k, v in get_weights(start).items())


def test_the_logit_adjustment_scales_ln_n_by_tau_as_computed_by_hand() -> None:
    logits = torch.zeros(1, 3)
    counts = np.array([1.0, math.e**2, 0.0])
    adjusted = balanced_cross_entropy(logits, torch.tensor([0]), counts, tau=0.5)
    assert adjusted.item() == pytest.approx(math.log(1 + math.e), rel=1e-6)
    assert balanced_cross_entropy(logits, torch.tensor([0]), counts, tau=0.0).item() == pytest.approx(math.log(3))


def test_kept_labels_trains_plain_ce_at_tau_zero_and_the_adjusted_loss_at_tau_one(fashion) -> None:
    data = local_data(fashion, 1)
    images, labels = data.kept_set(0, seed=7)
    counts = np.bincount(labels, minlength=10)
    trained = {}
    for tau in (0.0, 1.0):
        recipe = messages.Recipe(epochs=1, batch_size=16, learning_rate=0.05, options={"logit_adjustment": tau})
        model = build_model(seed=3)
        train_rule(KeptLabels(), model, data, build_model(seed=3).eval(), recipe, seed=7)
        reference = build_model(seed=3)
        run_epochs(
            [reference],
            images,
            labels,
            TrainSettings.from_recipe(recipe, 7),
            lambda x, y, net=reference, t=tau: balanced_cross_entropy(net(x), y, counts, t),
        )
        assert all(np.array_equal(get_weights(model)[k], v) for k, v in get_weights(reference).items())
        trained[tau] = get_weights(model)
    assert any(not np.array_equal(trained[0.0][k], trained[1.0][k]) for k in trained[0.0])


def test_a_negative_logit_adjustment_is_refused_naming_its_flag() -> None:
    with pytest.raises(ValueError, match="--logit-adjustment must be at least 0"):
        KeptLabels().option_value({"logit_adjustment": -1.0}, "logit_adjustment")


def test_eq7_weights_are_labelled_counts_of_the_participants_and_sum_to_one() -> None:
    weights = [{"w": np.full(3, float(i), dtype=np.float32)} for i in range(3)]
    counts = [10, 30, 60]
    updates = [ClientUpdate(f"d{i}", w, n) for i, (w, n) in enumerate(zip(weights, counts))]
    aggregate, report = make_strategy("fedavg").aggregate({"w": np.zeros(3, np.float32)}, updates, None)
    coefficients = report["coefficients"]
    assert math.isclose(sum(coefficients.values()), 1.0)
    assert coefficients == pytest.approx({"d0": 0.1, "d1": 0.3, "d2": 0.6})
    np.testing.assert_allclose(aggregate["w"], 0.1 * 0 + 0.3 * 1 + 0.6 * 2, rtol=1e-6)


def test_participants_are_a_seeded_ceil_r_k_subset_of_the_online_devices() -> None:
    online = [f"dev-{i:02d}" for i in range(10)]
    chosen = choose_participants(online, 0.8, seed=0, round_id=3)
    assert len(chosen) == 8 == len(set(chosen)) and set(chosen) <= set(online) and chosen == sorted(chosen)
    assert chosen == choose_participants(list(reversed(online)), 0.8, seed=0, round_id=3)
    assert len({tuple(choose_participants(online, 0.8, 0, r)) for r in range(1, 11)}) > 1
    assert len(choose_participants(online[:4], 0.8, 0, 1)) == 4 and len(choose_participants(online[:4], 0.5, 0, 1)) == 2
    assert choose_participants(online, 1.0, 0, 1) == []


def test_schedule_acquires_at_the_start_of_each_active_round_after_the_initial_one() -> None:
    kafal = messages.Recipe(rounds_per_acquisition=3, initial_label_fraction=0.1, label_fraction=0.05)
    assert [acquires_in_round(r, kafal) for r in range(1, 10)] == [
        False,
        False,
        False,
        True,
        False,
        False,
        True,
        False,
        False,
    ]
    assert [round_in_active_round(r, kafal) for r in range(1, 8)] == [1, 2, 3, 1, 2, 3, 1]
    assert all(acquires_in_round(r, messages.Recipe()) for r in range(1, 5))
    assert labels_per_acquisition(kafal, 301) == 16 and labels_per_acquisition(messages.Recipe(), 301) == 400
    declared = {field.name: field for field in declared_fields(messages.Recipe)}
    with pytest.raises(UsageError, match="--rounds-per-acquisition must be at least 1, got 0"):
        declared["rounds_per_acquisition"].check(0, ())
    with pytest.raises(UsageError, match=r"--label-fraction must lie in \[0, 1\], got 1.5"):
        declared["label_fraction"].check(1.5, ())


def test_unselected_device_acquires_but_never_trains_nor_sends(broker, tmp_path, fashion) -> None:
    """A round whose participants exclude the device: it takes its initial labels and its acquisition, keeps no
    trained model and publishes no update; a later round that selects it gets an update."""
    pool = np.arange(2000, 2100)
    shard = Shard(fashion.test_images[pool], fashion.test_labels[pool].astype(np.int64))
    settings = AgentSettings(fleet="kafal", device_id="dev-x")
    session = MqttSession(broker.address, client_id="dev-x", last_will=last_will(settings))
    agent = Agent(settings, session, open_device_data(tmp_path / "state", shard), SimulatedOracle(shard.all_labels))
    coordinator = MqttSession(broker.address, client_id="coordinator")
    coordinator.connect(timeout=10)
    coordinator.subscribe(topics.UPDATE.filter(fleet="kafal"))
    recipe = messages.Recipe(
        sampler="ksas",
        local_rule="kcfu",
        epochs=1,
        batch_size=16,
        rounds_per_acquisition=1,
        initial_label_fraction=0.1,
        label_fraction=0.05,
    )
    weights = get_weights(build_model(seed=0))

    def announce(round_id: int, participants: list[str]) -> None:
        model_hash = weights_hash(weights)
        model = messages.ModelMessage(model_hash, DEFAULT_SPEC, weights)
        coordinator.publish(
            topics.MODEL.build(fleet="kafal", hash=model_hash), wire.encode(model), retain=True, wait=10
        )
        coordinator.publish(
            topics.ROUND.build(fleet="kafal"),
            wire.encode(
                messages.RoundAnnouncement(
                    "run", round_id, model_hash, recipe, time.time() + 60, participants=participants
                )
            ),
            retain=True,
            wait=10,
        )

    def next_update(timeout: float):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            message = coordinator.next_message(timeout=0.2)
            if message is not None and message.topic.endswith("/update"):
                return wire.decode(message.payload, messages.Update)
        return None

    session.connect(timeout=10)
    thread = threading.Thread(target=agent.run, daemon=True)
    thread.start()
    try:
        announce(1, ["dev-other"])
        announce(2, ["dev-other"])
        assert next_update(8) is None
        deadline = time.monotonic() + 30
        while DeviceData.open(tmp_path / "state").get_state(LAST_ROUND_KEY, 0) < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        on_disk = DeviceData.open(tmp_path / "state")
        assert on_disk.get_state(LAST_ROUND_KEY) == 2
        assert on_disk.count_labels("oracle") == 10 + 5
        assert not (tmp_path / "state" / OWN_MODEL_FILE).exists()
        announce(3, ["dev-x"])
        update = next_update(60)
        assert update is not None and update.round_id == 3 and update.acquired_labels == 20
        assert (tmp_path / "state" / OWN_MODEL_FILE).exists()
    finally:
        agent.stop_event.set()
        thread.join(timeout=20)
        session.close()
        coordinator.close()


def test_only_participants_may_send_and_the_quorum_counts_them(broker, tmp_path, fashion) -> None:
    """With participants [dev-a, dev-b] the round needs 2 updates whatever the quorum; dev-c's update is refused
    with 'not selected', counted in the store, and never reaches the collector; the announcement names them."""
    weights = get_weights(build_model(seed=0))
    model_hash = weights_hash(weights)
    split = LabelledSplit.from_uint8(fashion.test_images[:20], fashion.test_labels[:20])
    session = MqttSession(broker.address, client_id="coordinator")
    observer = MqttSession(broker.address, client_id="observer")
    with RunStore(tmp_path / "run") as store:
        policy = RoundPolicy(rounds=1, quorum=10, participation=0.5)
        evaluator = Evaluator(DEFAULT_SPEC, split, split, 1, 0)
        coordinator = local_coordinator("kafal", session, store, make_strategy("fedavg"), evaluator, policy)
        session.connect(timeout=10)
        observer.connect(timeout=10)
        observer.subscribe(topics.ROUND.build(fleet="kafal"))
        presence, intake = coordinator.parts.presence, coordinator.parts.intake
        for device in ("dev-a", "dev-b", "dev-c", "dev-d"):
            presence.statuses[device] = messages.Status(device, "online", time.time())
        participants = choose_participants(sorted(presence.online()), 0.5, 0, 1)
        coordinator.parts.publisher.announce(1, model_hash, messages.Recipe(), time.time() + 60, participants)
        announced = None
        while announced is None:
            message = observer.next_message(timeout=5)
            announced = wire.decode(message.payload, messages.RoundAnnouncement)
        assert announced.participants == participants and len(announced.participants) == 2
        outsider = sorted(set(presence.statuses) - set(participants))[0]
        collector = RoundCollector(Expectation(1, model_hash, weight_spec(build_model()), 10, 1 << 24))
        update = messages.Update(outsider, 1, "u1", model_hash, 10, [1] * 10, 10, {}, weights)
        intake.on_update(outsider, wire.encode(update), collector, participants)
        assert collector.accepted == {} and collector.rejected[outsider].startswith("not selected")
        assert presence.needed(policy.quorum, policy.min_devices, participants, collector.accepted) == 2
        insider = participants[0]
        intake.on_update(insider, wire.encode(dataclasses.replace(update, device_id=insider)), collector, participants)
        assert list(collector.accepted) == [insider]
        assert any(reason.startswith("not selected") for reason in store.rejection_counts())
    session.close()
    observer.close()


def test_participants_and_schedule_fields_cross_the_wire_and_bad_ones_are_refused() -> None:
    recipe = messages.Recipe(
        sampler="ksas",
        rounds_per_acquisition=3,
        initial_label_fraction=0.1,
        label_fraction=0.05,
        options={"lambda": 1.0, "nu": 0.5},
    )
    announcement = messages.RoundAnnouncement("run", 4, "h" * 64, recipe, 1.0, participants=["dev-01", "dev-03"])
    assert wire.decode(wire.encode(announcement), messages.RoundAnnouncement) == announcement
    raw = msgpack.unpackb(wire.encode(announcement))
    raw["participants"] = ["dev-01", 3]
    with pytest.raises(wire.WireError, match="participants must be a list of strings"):
        wire.decode(msgpack.packb(raw), messages.RoundAnnouncement)


def test_the_training_view_reads_the_pool_only_for_the_rule_that_asks(tmp_path, fashion) -> None:
    data = DeviceData.create(tmp_path / "state", fashion.test_images[:80])
    data.add_labels(np.arange(16), fashion.test_labels[:16].astype(np.int64))
    recipe = messages.Recipe(epochs=1, batch_size=8)
    model = build_model(seed=1)
    view = training_view(data, np.arange(8), fashion.test_labels[:8].astype(np.int64), round_in_active=2)
    train_rule(make_local_rule("online-replay"), model, view, build_model(seed=1).eval(), recipe, seed=0)
    assert view.unlabelled.cache_info().misses == 0  # type: ignore[attr-defined]
    train_rule(make_local_rule("kcfu"), model, view, build_model(seed=1).eval(), recipe, seed=0)
    assert view.unlabelled.cache_info().misses == 1  # type: ignore[attr-defined]
    assert len(view.unlabelled()) == 64
