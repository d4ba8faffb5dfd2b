# The feature cache: a frozen prefix runs once per image across rounds, a new backbone or a damaged file recomputes.
from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from test_imports import imported_packages

from bench.oracle import SimulatedOracle
from edge_agent.data.device_data import DeviceData, initialise_store
from edge_agent.data.feature_cache import FEATURES_FOLDER, FeatureCache, content_digests
from edge_agent.field.parts import PoolFeatures
from edge_agent.learning.batch_samplers import BalancedMargin, TypicalitySampler
from edge_agent.learning.bundle import Bundle, load_bundle
from edge_agent.learning.cached_prefix import CachedPrefix, prefix_width
from edge_agent.learning.learner_choice import make_learner
from edge_agent.learning.local_data import training_view
from edge_agent.learning.models import build_model, get_weights
from edge_agent.learning.onnx_initializers import OnnxGraphError, output_shape
from edge_agent.learning.ort_scorer import OrtMCDropout
from edge_agent.learning.sampling import make_sampler
from edge_agent.loop.acquisition import Acquirer
from edge_agent.loop.agent import LatestModel
from edge_agent.loop.agent_settings import AgentSettings
from edge_agent.loop.footprint import PhaseMeter
from edge_agent.loop.round_inputs import RoundModels
from edge_agent.score_command import score_pool
from export.bundle_writer import write_bundle
from export.graph_names import IMAGES_INPUT
from protocol import messages
from protocol.errors import UsageError
from protocol.model_spec import ModelSpec
from protocol.tensors import Weights, weights_hash

SPEC = ModelSpec(
    architecture="rgb-cnn",
    channels=3,
    height=16,
    width=16,
    mean=[0.5] * 3,
    std=[0.25] * 3,
    class_names=["a", "b", "c"],
    width_multiplier=0.25,
    trainable="head",
)
HEAD = AgentSettings("f", "d", trainer="head", backend="onnxruntime", inference_batch=16)
IMAGES = 60


@pytest.fixture
def backbone_rows(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """Counts the images every onnxruntime graph that takes images (a prefix: the backbone) is run on."""
    counted: list[int] = []
    original = ort.InferenceSession.run

    def counting(session: ort.InferenceSession, outputs, feeds, *args, **kwargs):  # type: ignore[no-untyped-def]
        if IMAGES_INPUT in feeds:
            counted.append(len(feeds[IMAGES_INPUT]))
        return original(session, outputs, feeds, *args, **kwargs)

    monkeypatch.setattr(ort.InferenceSession, "run", counting)
    yield counted


def export(weights: Weights, folder: Path, spec: ModelSpec = SPEC) -> Bundle:
    """The fp32 bundle of these weights."""
    write_bundle(weights, folder, spec)
    return load_bundle(folder)


def with_new_classifier(weights: Weights, seed: int) -> Weights:
    """The weights with another classifier (what a head-only round changes)."""
    rng = np.random.default_rng(seed)
    return {
        name: (rng.normal(size=value.shape).astype(np.float32) if name.startswith("fc2.") else value)
        for name, value in weights.items()
    }


class FixedImages:
    """An image source of a fixed stack held in memory."""

    def __init__(self, images: np.ndarray) -> None:
        self.stack = images

    def images(self) -> np.ndarray:
        """The stack."""
        return self.stack

    def read(self, indices: np.ndarray) -> np.ndarray:
        """A copy of the images at these indices."""
        return self.stack[indices]

    def refresh(self) -> int:
        """Never grows."""
        return 0

    def digests(self, indices: np.ndarray) -> np.ndarray:
        """The content digests of the images at these indices."""
        return content_digests(self.stack[indices])


def device(tmp_path: Path) -> tuple[DeviceData, np.ndarray]:
    """A device of random 16x16 colour images and their true labels."""
    rng = np.random.default_rng(0)
    state_dir = tmp_path / "device"
    state_dir.mkdir()
    initialise_store(state_dir, num_classes=3)
    source = FixedImages(rng.integers(0, 256, (IMAGES, 16, 16, 3), dtype=np.uint8))
    return DeviceData(state_dir, source), rng.integers(0, 3, IMAGES)


def test_a_head_only_device_runs_the_backbone_once_per_image_across_three_rounds(
    tmp_path: Path, backbone_rows: list[int]
) -> None:
    data, truth = device(tmp_path)
    acquirer = Acquirer(HEAD, data, SimulatedOracle(truth), PhaseMeter())
    weights = get_weights(build_model(SPEC, seed=0))
    recipe = messages.Recipe(labels_per_acquisition=5, epochs=1, batch_size=8, mc_passes=4)
    for round_id, sampler in enumerate(("entropy", "badge", "bald"), start=1):
        weights = with_new_classifier(weights, round_id)
        bundle = export(weights, tmp_path / f"bundle{round_id}")
        learner = make_learner(HEAD.compute, data.state_dir, SPEC, weights, bundle)
        models = RoundModels(learner, "", messages.Recipe(**{**recipe.__dict__, "sampler": sampler}), bundle)
        new, labels = acquirer.acquire(models, make_sampler(sampler), round_id, round_id, 0)
        assert len(new) == 5
        metrics = learner.train(training_view(data, new, labels, 1, learner.rows), recipe, round_id)
        assert metrics["train_samples"] == 5 * round_id
        assert learner.weights()["fc2.weight"].tobytes() != weights["fc2.weight"].tobytes()
    assert sum(backbone_rows) == IMAGES
    assert len(list((data.state_dir / FEATURES_FOLDER).glob("*.rows"))) == 1


def test_a_head_only_device_runs_the_camera_default_on_its_cached_rows(
    tmp_path: Path, backbone_rows: list[int]
) -> None:
    """typical-then-balanced-margin on a head-only device: its TypiClust phase clusters the feature cache's rows
    (the pool's and, once labelled, the human labels'), its margin phase scores them; the backbone runs once per
    image over both phases, and the TypiClust batch is the one batch_selection computes from the cached rows."""
    data, truth = device(tmp_path)
    acquirer = Acquirer(HEAD, data, SimulatedOracle(truth), PhaseMeter())
    weights = get_weights(build_model(SPEC, seed=0))
    options = {"first_labels": 5.0, "typical_clusters": 8.0}
    recipe = messages.Recipe(
        sampler="typical-then-balanced-margin", labels_per_acquisition=5, epochs=1, batch_size=8, mc_passes=4
    )
    recipe = messages.Recipe(**{**recipe.__dict__, "options": options})
    sampler = make_sampler(recipe.sampler)
    for round_id in (1, 2):
        bundle = export(with_new_classifier(weights, round_id), tmp_path / f"bundle{round_id}")
        learner = make_learner(HEAD.compute, data.state_dir, SPEC, weights, bundle)
        models = RoundModels(learner, "", recipe, bundle)
        context = acquirer.context(models, data.pool_indices(), round_id)
        assert type(sampler.phase(context)) is (TypicalitySampler if round_id == 1 else BalancedMargin)
        expected = data.pool_indices()[sampler.phase(context).select(context, 5)]
        new, labels = acquirer.acquire(models, sampler, round_id, round_id, 0)
        assert sorted(new.tolist()) == sorted(expected.tolist())
        learner.train(training_view(data, new, labels, 1, learner.rows), recipe, round_id)
    assert sum(backbone_rows) == IMAGES


def cached_scores(data: DeviceData, bundle: Bundle, weights: Weights) -> np.ndarray:
    """MC-dropout outputs of every sample through a head learner (and so the device's feature cache)."""
    learner = make_learner(HEAD.compute, data.state_dir, SPEC, weights, bundle)
    return learner.probabilities(bundle, data.samples(np.arange(IMAGES)), 6, 3)


def test_cached_scores_equal_uncached_ones_within_float16(tmp_path: Path) -> None:
    data, _ = device(tmp_path)
    weights = get_weights(build_model(SPEC, seed=0))
    bundle = export(weights, tmp_path / "bundle")
    uncached = OrtMCDropout(bundle, 16).probabilities(data.images(np.arange(IMAGES)), 6, 3)
    cached = cached_scores(data, bundle, weights)
    assert np.abs(cached - uncached).max() < 2e-3 and np.abs(cached - uncached).max() > 0


def test_a_changed_backbone_recomputes_the_cache_and_removes_the_old_one(
    tmp_path: Path, backbone_rows: list[int]
) -> None:
    data, _ = device(tmp_path)
    first = get_weights(build_model(SPEC, seed=0))
    cached_scores(data, export(first, tmp_path / "one"), first)
    other = get_weights(build_model(SPEC, seed=1))
    bundle = export(other, tmp_path / "two")
    scores = cached_scores(data, bundle, other)
    assert sum(backbone_rows) == 2 * IMAGES
    assert len(list((data.state_dir / FEATURES_FOLDER).iterdir())) == 2  # one key's rows and meta
    fresh = OrtMCDropout(bundle, 16).probabilities(data.images(np.arange(IMAGES)), 6, 3)
    assert np.abs(scores - fresh).max() < 2e-3


def test_a_head_only_field_device_caches_new_images_between_rounds_and_its_round_runs_no_backbone(
    tmp_path: Path, backbone_rows: list[int]
) -> None:
    """PoolFeatures (a field device's between-round work) computes the features of images that entered the pool,
    once; the round then scores from the cache alone. A bundle that is not the model's computes nothing."""
    data, _ = device(tmp_path)
    weights = get_weights(build_model(SPEC, seed=0))
    bundle = export(weights, tmp_path / "bundle")
    features = PoolFeatures(HEAD, data)
    other_weights = get_weights(build_model(SPEC, seed=1))
    other = LatestModel(SPEC, other_weights, messages.Recipe(), bundle, weights_hash(other_weights))
    features.take_in(other)
    assert backbone_rows == [] and features.seen == 0
    features.take_in(LatestModel(SPEC, weights, messages.Recipe(), bundle, weights_hash(weights)))
    assert sum(backbone_rows) == IMAGES and features.seen == IMAGES
    features.take_in(LatestModel(SPEC, weights, messages.Recipe(), bundle, weights_hash(weights)))
    cached_scores(data, bundle, weights)
    assert sum(backbone_rows) == IMAGES


def flip_bytes(path: Path) -> None:
    """Flips a few bytes an eighth into a file (inside the rows a device of 60 images wrote in a 256-row file)."""
    raw = bytearray(path.read_bytes())
    at = len(raw) // 8
    raw[at : at + 8] = bytes(255 - byte for byte in raw[at : at + 8])
    path.write_bytes(bytes(raw))


def nan_rows(path: Path, meta: Path) -> None:
    """Every row's values NaN (their tags kept)."""
    record = np.dtype([("tag", np.uint8, (32,)), ("row", "<f2", (json.loads(meta.read_text())["dim"],))])
    records = np.fromfile(path, dtype=record)
    records["row"] = np.nan
    records.tofile(path)


@pytest.mark.parametrize(
    "damage",
    [
        ("flipped", lambda rows, meta: flip_bytes(rows)),
        ("nan", nan_rows),
        ("truncated", lambda rows, meta: rows.write_bytes(rows.read_bytes()[:1000])),
        ("bad meta", lambda rows, meta: meta.write_text("{not json")),
        ("meta of another version", lambda rows, meta: meta.write_text(json.dumps({"version": 1}))),
    ],
    ids=lambda damage: damage[0],
)
def test_a_damaged_cache_is_rebuilt_with_a_warning_and_scores_as_a_fresh_one(
    tmp_path: Path, backbone_rows: list[int], caplog: pytest.LogCaptureFixture, damage
) -> None:
    data, _ = device(tmp_path)
    weights = get_weights(build_model(SPEC, seed=0))
    bundle = export(weights, tmp_path / "bundle")
    fresh = cached_scores(data, bundle, weights)
    [rows] = (data.state_dir / FEATURES_FOLDER).glob("*.rows")
    damage[1](rows, rows.with_suffix(".json"))
    with caplog.at_level(logging.WARNING):
        rebuilt = cached_scores(data, bundle, weights)
    assert "feature cache" in caplog.text and sum(backbone_rows) > IMAGES
    assert np.array_equal(rebuilt, fresh)
    backbone_rows.clear()
    assert np.array_equal(cached_scores(data, bundle, weights), fresh) and sum(backbone_rows) == 0


def test_a_trained_prefix_or_a_full_model_device_keeps_no_cache(tmp_path: Path) -> None:
    data, _ = device(tmp_path)
    whole = ModelSpec(**{**SPEC.__dict__, "trainable": "all"})
    weights = get_weights(build_model(whole, seed=0))
    learner = make_learner(HEAD.compute, data.state_dir, whole, weights, export(weights, tmp_path / "bundle", whole))
    assert learner.probabilities(learner.bundle, data.samples(np.arange(4)), 2, 0).shape == (2, 4, 3)  # type: ignore[attr-defined]
    assert not (data.state_dir / FEATURES_FOLDER).exists()


def test_edge_agent_score_with_a_cache_dir_runs_the_backbone_once_and_selects_the_same(
    tmp_path: Path, backbone_rows: list[int]
) -> None:
    weights = get_weights(build_model(SPEC, seed=0))
    export(weights, tmp_path / "bundle")
    pool = tmp_path / "pool.npy"
    np.save(pool, np.random.default_rng(2).integers(0, 256, (40, 16, 16, 3), dtype=np.uint8))
    plain = score_pool(tmp_path / "bundle", pool, 5, 10, "entropy", batch_size=16)
    backbone_rows.clear()
    runs = [score_pool(tmp_path / "bundle", pool, 5, 10, "entropy", batch_size=16, cache_dir=tmp_path / "c")]
    runs.append(score_pool(tmp_path / "bundle", pool, 5, 10, "entropy", batch_size=16, cache_dir=tmp_path / "c"))
    assert sum(backbone_rows) == 40
    assert runs[0]["indices"] == runs[1]["indices"] and len(set(runs[0]["indices"]) & set(plain["indices"])) >= 8
    with pytest.raises(UsageError, match="--cache-dir keeps the fp32 prefix"):
        score_pool(tmp_path / "bundle", pool, 5, 10, "entropy", precision="int8", cache_dir=tmp_path / "c")


def test_the_cache_refuses_a_bad_key_bad_digests_and_rows_of_another_width_within_one_read(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with pytest.raises(ValueError, match="a feature cache key is a hex digest"):
        FeatureCache(tmp_path, "../escape")
    cache = FeatureCache(tmp_path, "ab12", batch_size=1)
    digests = np.zeros((2, 32), np.uint8)
    rows = cache.rows(
        np.array([0, 5]), digests, lambda indices: np.ones((len(indices), 3), np.float32) * indices[:, None]
    )
    assert rows.dtype == np.float16 and rows[:, 0].tolist() == [0.0, 5.0]
    widths = iter([3, 4])
    with pytest.raises(ValueError, match=r"the prefix gave rows \(1, 4\), the cache holds rows of 3"):
        cache.rows(np.array([7, 8]), digests, lambda indices: np.ones((1, next(widths)), np.float32))
    with caplog.at_level(logging.WARNING):
        wider = cache.rows(np.array([9]), digests[:1], lambda indices: np.ones((1, 4), np.float32))
    assert wider.shape == (1, 4) and "rows do not fit its meta, starting again" in caplog.text
    with pytest.raises(ValueError, match="sample indices must be non-negative"):
        cache.rows(np.array([-1]), digests[:1], lambda indices: np.ones((1, 3), np.float32))
    with pytest.raises(ValueError, match=r"content digests must be \(2, 32\) uint8"):
        cache.rows(np.array([0, 1]), digests[:1], lambda indices: np.ones((2, 3), np.float32))


def test_the_prefix_width_is_what_the_prefix_graph_declares_read_without_onnx(tmp_path: Path) -> None:
    """prefix_width reads the fp32 prefix graph's output shape from its bytes (16x4x4 for SPEC: 256 values a row,
    what the prefix computes); a graph whose axis past the batch is dynamic gives no width to check against, and
    bytes holding no graph are refused."""
    bundle = export(get_weights(build_model(SPEC, seed=0)), tmp_path / "bundle")
    rows = CachedPrefix(bundle, tmp_path / "cache", get_weights(build_model(SPEC, seed=0)), 8).extract(
        np.zeros((2, 16, 16, 3), np.uint8)
    )
    assert prefix_width(bundle) == rows.shape[1] == 256
    path = bundle.graph_path("fp32", "prefix")
    model = onnx.load(str(path))
    model.graph.output[0].type.tensor_type.shape.dim[1].dim_param = "channels"
    onnx.save(model, str(path))
    assert prefix_width(bundle) is None
    with pytest.raises(OnnxGraphError, match="the bytes hold no graph"):
        output_shape(b"")


def test_the_cache_itself_needs_numpy_only() -> None:
    module = Path(__file__).resolve().parent.parent / "edge_agent" / "data" / "feature_cache.py"
    assert imported_packages(module) <= {
        "__future__",
        "hashlib",
        "json",
        "logging",
        "os",
        "collections",
        "dataclasses",
        "pathlib",
        "typing",
        "numpy",
        "protocol",
    }
