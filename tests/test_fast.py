# FAST (ALGORITHMS.md section 5): prototype similarities and entropy, kNN weak labels, the query count, weak
# labels that never overwrite human ones, and a frozen encoder (W0's penultimate layers, ONNX via onnxruntime);
# the core-set on the same device acquirer (its labelled features are the device's human labels).
from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from bench.oracle import SimulatedOracle
from bench.shard import Shard, open_device_data
from coordinator.setup.encoder import load_encoder
from edge_agent.data.device_data import DeviceData
from edge_agent.data.fashion_mnist import load_fashion_mnist
from edge_agent.data.image_arrays import model_input
from edge_agent.learning.acquisition_scores import knn_labels, prototype_entropy, prototype_similarities
from edge_agent.learning.batch_selection import k_center_greedy
from edge_agent.learning.encoder import OnnxEncoder, encoder_hash
from edge_agent.learning.learner_choice import make_learner
from edge_agent.learning.models import build_model, get_weights
from edge_agent.learning.sampling import make_sampler
from edge_agent.loop.agent import Agent
from edge_agent.loop.agent_settings import AgentSettings
from edge_agent.loop.round_inputs import RoundModels
from export.onnx_graphs import export_encoder
from protocol import messages, topics, wire
from protocol.model_spec import DEFAULT_SPEC
from protocol.mqtt import BrokerAddress, MqttSession

embedding_sets = arrays(np.float64, st.tuples(st.integers(1, 8), st.just(4)), elements=st.floats(-5, 5))


@settings(max_examples=60, deadline=None)
@given(embedding_sets, embedding_sets, st.integers(0, 2**31))
def test_similarities_lie_in_minus_one_one_and_entropy_is_at_most_ln_c(pool, reference, seed) -> None:
    labels = np.random.default_rng(seed).integers(0, 5, len(reference))
    similarities, seeded = prototype_similarities(pool, reference, labels, num_classes=5)
    assert np.all(similarities >= -1.0) and np.all(similarities <= 1.0)
    assert seeded.tolist() == [c in labels for c in range(5)]
    assert np.all(prototype_entropy(similarities, seeded) <= np.log(seeded.sum()) + 1e-12)


def test_similarity_is_the_mean_cosine_to_each_class_s_seeds() -> None:
    reference = np.array([[1.0, 0.0], [0.0, 1.0], [-1.0, 0.0]])
    similarities, seeded = prototype_similarities(np.array([[2.0, 0.0]]), reference, np.array([0, 0, 2]), 3)
    np.testing.assert_allclose(similarities, [[0.5, 0.0, -1.0]])
    assert seeded.tolist() == [True, False, True]


def test_entropy_equals_ln_c_exactly_when_all_similarities_are_equal() -> None:
    seeded = np.ones(10, dtype=bool)
    flat = np.full((3, 10), 0.3)
    np.testing.assert_allclose(prototype_entropy(flat, seeded), np.log(10))
    uneven = flat.copy()
    uneven[:, 4] = 0.31
    assert np.all(prototype_entropy(uneven, seeded) < np.log(10))
    masked = np.array([True, False, True])
    np.testing.assert_allclose(prototype_entropy(np.array([[0.2, 0.9, 0.2]]), masked), np.log(2))


def test_k_one_gives_the_nearest_seed_s_label_and_votes_tie_to_the_lowest_class() -> None:
    rng = np.random.default_rng(0)
    pool, reference = rng.normal(size=(50, 6)), rng.normal(size=(20, 6))
    labels = rng.integers(0, 10, 20)
    nearest = np.argmin(((pool[:, None, :] - reference[None, :, :]) ** 2).sum(axis=2), axis=1)
    np.testing.assert_array_equal(knn_labels(pool, reference, labels, 1, 10), labels[nearest])
    tie = knn_labels(np.zeros((1, 1)), np.array([[1.0], [-1.0]]), np.array([7, 3]), 2, 10)
    assert tie.tolist() == [3]
    majority = knn_labels(np.zeros((1, 1)), np.array([[1.0], [2.0], [3.0], [9.0]]), np.array([5, 2, 2, 0]), 3, 10)
    assert majority.tolist() == [2]


@pytest.fixture(scope="module")
def encoder_bytes(tmp_path_factory) -> bytes:
    path = tmp_path_factory.mktemp("encoder") / "encoder.onnx"
    export_encoder(build_model(seed=0), path)
    return path.read_bytes()


def test_exported_encoder_matches_the_model_s_penultimate_layer(encoder_bytes: bytes) -> None:
    images = load_fashion_mnist().test_images[:16]
    model = build_model(seed=0).eval()
    with torch.no_grad():
        expected = model.penultimate(model.prefix(torch.from_numpy(model_input(images)))).numpy()
    embedded = OnnxEncoder(encoder_bytes).embed(images)
    assert embedded.shape == (16, 128)
    np.testing.assert_allclose(embedded, expected, rtol=1e-4, atol=1e-5)


def make_agent(tmp_path: Path, pool_size: int, encoder: bytes) -> Agent:
    fashion = load_fashion_mnist()
    pool = np.arange(3000, 3000 + pool_size)
    seeds = np.concatenate([np.flatnonzero(fashion.test_labels == c)[:2] for c in range(10)])
    shard = Shard(
        fashion.test_images[pool],
        fashion.test_labels[pool].astype(np.int64),
        fashion.test_images[seeds],
        fashion.test_labels[seeds].astype(np.int64),
    )
    settings = AgentSettings(fleet="fast", device_id="dev-f")
    agent = Agent(
        settings,
        MqttSession(BrokerAddress("127.0.0.1", 1), "dev-f"),
        open_device_data(tmp_path / "state", shard),
        SimulatedOracle(shard.all_labels),
    )
    agent.artefacts.on_encoder(messages.EncoderMessage(encoder_hash(encoder), encoder))
    return agent


def round_models(agent: Agent, model, recipe: messages.Recipe) -> RoundModels:
    """The round's models as the agent builds them: a learner over the model's weights, the held encoder."""
    learner = make_learner(agent.settings.compute, agent.data.state_dir, DEFAULT_SPEC, get_weights(model), None)
    return RoundModels(learner, "base", recipe, encoder=agent.artefacts.encoders.get(recipe.encoder))


@pytest.mark.parametrize(("pool_size", "budget"), [(60, 25), (15, 25)])
def test_fast_queries_exactly_min_b_pool_and_weak_labels_never_count_or_overwrite(
    tmp_path, encoder_bytes, pool_size, budget
) -> None:
    agent = make_agent(tmp_path, pool_size, encoder_bytes)
    recipe = messages.Recipe(sampler="fast", labels_per_acquisition=budget, encoder=encoder_hash(encoder_bytes))
    model = build_model(seed=0)
    answered, _labels = agent.rounds.acquirer.acquire(
        round_models(agent, model, recipe), make_sampler("fast"), 1, round_id=1, acquisition=0
    )
    data = agent.data
    assert len(answered) == min(budget, pool_size) == data.count_labels("oracle")
    weak_indices, _weak_labels = data.weak_labels()
    assert len(weak_indices) == pool_size - len(answered) == data.count_labels("weak")
    assert data.num_labelled == len(answered) + 20
    human_indices, human_labels = data.labelled()
    assert not np.isin(weak_indices, human_indices).any()
    truth = SimulatedOracle(np.asarray(agent.oracle.ground_truth)).label(human_indices)[1]
    np.testing.assert_array_equal(human_labels, truth)
    assert set(data.pool_indices().tolist()) == set(weak_indices.tolist())


def test_a_second_acquisition_turns_weak_labels_into_human_ones_and_keeps_human_labels(tmp_path, encoder_bytes) -> None:
    agent = make_agent(tmp_path, 80, encoder_bytes)
    recipe = messages.Recipe(sampler="fast", labels_per_acquisition=10, encoder=encoder_hash(encoder_bytes))
    model = build_model(seed=0)
    first, _ = agent.rounds.acquirer.acquire(
        round_models(agent, model, recipe), make_sampler("fast"), 1, round_id=1, acquisition=0
    )
    weak_before, _ = agent.data.weak_labels()
    second, _ = agent.rounds.acquirer.acquire(
        round_models(agent, model, recipe), make_sampler("fast"), 2, round_id=2, acquisition=0
    )
    assert np.isin(second, weak_before).all() and not np.isin(second, first).any()
    reopened = DeviceData.open(tmp_path / "state")
    assert reopened.count_labels("oracle") == 20 and reopened.count_labels("weak") == 60
    human, labels = reopened.labelled()
    np.testing.assert_array_equal(labels, np.asarray(agent.oracle.ground_truth)[human])
    with pytest.raises(ValueError, match="already labelled by a person"):
        reopened.set_weak_labels(first[:1], np.array([(labels[0] + 1) % 10]))
    with pytest.raises(ValueError, match="weak labels go through set_weak_labels"):
        reopened.add_labels(reopened.pool_indices()[:1], np.array([0]), source="weak")
    assert DeviceData.open(tmp_path / "state").count_labels("oracle") == 20


def test_encoder_stays_frozen_through_acquisitions(tmp_path, encoder_bytes) -> None:
    digest = hashlib.sha256(encoder_bytes).hexdigest()
    agent = make_agent(tmp_path, 40, encoder_bytes)
    probe = load_fashion_mnist().test_images[:8]
    before = OnnxEncoder(encoder_bytes).embed(probe)
    recipe = messages.Recipe(sampler="fast", labels_per_acquisition=5, encoder=digest)
    model = build_model(seed=0)
    for seed in (1, 2):
        agent.rounds.acquirer.acquire(
            round_models(agent, model, recipe), make_sampler("fast"), seed, round_id=seed, acquisition=0
        )
    kept = agent.artefacts.encoders[digest]
    assert hashlib.sha256(kept).hexdigest() == digest
    np.testing.assert_array_equal(OnnxEncoder(kept).embed(probe), before)


def test_an_encoder_with_the_wrong_hash_is_ignored(tmp_path, encoder_bytes) -> None:
    agent = make_agent(tmp_path, 10, encoder_bytes)
    agent.artefacts.on_encoder(messages.EncoderMessage("0" * 64, encoder_bytes))
    assert "0" * 64 not in agent.artefacts.encoders


def test_bad_encoder_files_give_one_line_errors(tmp_path) -> None:
    with pytest.raises(ValueError, match="no such file"):
        load_encoder(tmp_path / "missing.onnx", DEFAULT_SPEC)
    (tmp_path / "junk.onnx").write_bytes(b"not onnx")
    with pytest.raises(ValueError, match="cannot embed a 28x28 image") as error:
        load_encoder(tmp_path / "junk.onnx", DEFAULT_SPEC)
    assert "\n" not in str(error.value)


def test_encoder_message_round_trips_and_its_topic_names_the_hash(encoder_bytes) -> None:
    message = messages.EncoderMessage(encoder_hash(encoder_bytes), encoder_bytes)
    assert wire.decode(wire.encode(message), messages.EncoderMessage) == message
    assert topics.ENCODER.build(fleet="f", hash=message.encoder_hash) == f"fl/f/encoder/{message.encoder_hash}"
    with pytest.raises(wire.WireError, match="expected a 'encoder' message"):
        wire.decode(wire.encode(messages.Ack("d", 1, "u", True)), messages.EncoderMessage)


def test_the_device_gives_the_coreset_its_human_labels_features_as_centres(tmp_path, encoder_bytes) -> None:
    """The acquirer's labelled_features are the learner's features of data.labelled(); the core-set's batch is
    greedy k-center from them, as batch_selection computes it directly."""
    agent = make_agent(tmp_path, 50, encoder_bytes)
    recipe = messages.Recipe(sampler="coreset", labels_per_acquisition=6)
    models = round_models(agent, build_model(seed=0), recipe)
    pool = agent.data.pool_indices()
    context = agent.rounds.acquirer.context(models, pool, 3)
    human, _ = agent.data.labelled()
    expected_centres = models.learner.features(agent.data.samples(human))
    assert len(human) == 20 and expected_centres.shape == (20, 128)
    np.testing.assert_array_equal(context.labelled_features(), expected_centres)
    expected = pool[k_center_greedy(context.features(), expected_centres, 6, np.random.default_rng(3))]
    answered, _ = agent.rounds.acquirer.acquire(models, make_sampler("coreset"), 3, round_id=1, acquisition=0)
    assert sorted(answered.tolist()) == sorted(expected.tolist())
