# The model spec (TOML, checks, hash, wire and manifest) and the model zoo built from it (split, ONNX, head-only).
from __future__ import annotations

import dataclasses
from pathlib import Path

import msgpack
import numpy as np
import pytest
import torch

from coordinator.setup.resume import check_same_spec
from coordinator.setup.settings import ServerSettings, settings_as_dict
from coordinator.storage.pretrained import merge_initial_weights, read_weight_file
from edge_agent.data.image_arrays import model_input
from edge_agent.learning.bundle import load_bundle
from edge_agent.learning.mc_dropout import TorchMCDropout
from edge_agent.learning.models import build_model, get_weights
from edge_agent.learning.ort_scorer import OrtMCDropout
from edge_agent.learning.training import TrainSettings, train_supervised
from edge_agent.loop.round_runner import announced_spec_problem
from export.bundle_writer import write_bundle
from protocol import messages, wire
from protocol.files import save_arrays
from protocol.model_spec import DEFAULT_SPEC, ModelSpec, SpecError, load_model_spec, spec_hash

CLASSES = ["boot", "bag", "shirt", "trouser", "dress"]
RGB_TOML = """
[model]
architecture = "mobilenet"
width_multiplier = 0.25
dropout = [0.3]

[input]
channels = 3
height = 96
width = 96
mean = [0.5, 0.45, 0.4]
std = [0.25, 0.25, 0.25]

[classes]
names = ["boot", "bag", "shirt", "trouser", "dress"]
"""


def rgb_spec(architecture: str = "mobilenet", side: int = 96, **changes) -> ModelSpec:
    values = {"class_names": CLASSES, "width_multiplier": 0.25, **changes}
    return ModelSpec(architecture, 3, side, side, [0.5, 0.45, 0.4], [0.25, 0.25, 0.25], **values)


def write_spec(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "spec.toml"
    path.write_text(text)
    return path


def test_a_toml_spec_gives_the_fields_it_sets_and_the_default_is_the_paper_cnn(tmp_path: Path) -> None:
    spec = load_model_spec(write_spec(tmp_path, RGB_TOML)).spec
    assert spec == rgb_spec(dropout=[0.3])
    assert spec.num_classes == 5 and spec.input_shape == (3, 96, 96) and spec.image_shape == (96, 96, 3)
    assert DEFAULT_SPEC.architecture == "paper-cnn" and DEFAULT_SPEC.image_shape == (28, 28)
    assert DEFAULT_SPEC.class_names[9] == "Ankle boot" and DEFAULT_SPEC.num_classes == 10
    assert spec_hash(spec) == spec_hash(load_model_spec(write_spec(tmp_path, RGB_TOML)).spec)
    assert spec_hash(spec) != spec_hash(dataclasses.replace(spec, class_names=[*CLASSES[:4], "skirt"]))


@pytest.mark.parametrize(
    ("change", "fragment"),
    [
        (("[classes]", "[labels]"), "unknown section [labels]"),
        (('architecture = "mobilenet"', 'architecture = "mobilenet"\ncolour = 1'), "unknown key model.colour"),
        (('architecture = "mobilenet"', 'architecture = "resnet"'), "model.architecture 'resnet' is not in the zoo"),
        (('architecture = "mobilenet"', 'architecture = "paper-cnn"'), "paper-cnn takes 28x28 inputs"),
        (("channels = 3", 'channels = "3"'), "input.channels must be an integer"),
        (("channels = 3", "channels = 7"), "input.channels must lie in 1..4"),
        (("height = 96", "height = 4"), "input.height must lie in 8..1024"),
        (("mean = [0.5, 0.45, 0.4]", "mean = [0.5]"), "input.mean needs 3 finite numbers"),
        (("std = [0.25, 0.25, 0.25]", "std = [0.25, 0, 0.25]"), "input.std must be positive"),
        (('"dress"]', '"boot"]'), "classes.names repeats a name"),
        (('names = ["boot", "bag", "shirt", "trouser", "dress"]', 'names = ["boot"]'), "needs 2..1000 names"),
        (('names = ["boot", "bag", "shirt", "trouser", "dress"]', "names = [1, 2]"), "must be a list of strings"),
        (("dropout = [0.3]", "dropout = [0.3, 0.3]"), "model.dropout needs 1 rates for mobilenet"),
        (("dropout = [0.3]", "dropout = [1.0]"), "model.dropout rates must lie in [0, 1)"),
        (("width_multiplier = 0.25", "width_multiplier = 64"), "model.width_multiplier must lie in"),
        (("[input]", "[input"), "not valid TOML"),
    ],
)
def test_a_bad_spec_is_one_line_naming_the_file_and_the_key(tmp_path: Path, change, fragment) -> None:
    path = write_spec(tmp_path, RGB_TOML.replace(*change))
    with pytest.raises(SpecError) as caught:
        load_model_spec(path)
    message = str(caught.value)
    assert fragment in message and message.startswith(str(path)) and "\n" not in message


def test_a_missing_spec_file_and_a_huge_bad_value_give_short_errors(tmp_path: Path) -> None:
    with pytest.raises(SpecError, match="no such model spec file"):
        load_model_spec(tmp_path / "absent.toml")
    path = write_spec(tmp_path, RGB_TOML.replace('"mobilenet"', '"' + "x" * 100_000 + '"'))
    with pytest.raises(SpecError) as caught:
        load_model_spec(path)
    assert len(str(caught.value)) < 300


def test_the_spec_travels_in_the_model_message_and_a_bad_one_is_a_wire_error() -> None:
    weights = get_weights(build_model(rgb_spec(), seed=0))
    message = messages.ModelMessage("ab" * 32, rgb_spec(), weights)
    decoded = wire.decode(wire.encode(message), messages.ModelMessage)
    assert decoded.spec == rgb_spec() and spec_hash(decoded.spec) == spec_hash(rgb_spec())
    raw = msgpack.unpackb(wire.encode(message))
    raw["spec"]["channels"] = 0
    with pytest.raises(wire.WireError, match="input.channels must lie in 1..4"):
        wire.decode(msgpack.packb(raw, use_bin_type=True), messages.ModelMessage)


@pytest.mark.parametrize("architecture", ["rgb-cnn", "mobilenet"])
def test_every_zoo_model_keeps_the_mc_dropout_split(architecture: str) -> None:
    spec = rgb_spec(architecture, side=64)
    model = build_model(spec, seed=1).eval()
    images = torch.rand(4, 3, 64, 64)
    with torch.no_grad():
        features = model.prefix(images)
        ones = [torch.ones(4, *shape) for shape in model.dropout_mask_shapes]
        logits = model.tail_with_masks(features, ones)
    assert logits.shape == (4, 5) and torch.allclose(logits, model(images), atol=1e-6)
    assert len(model.dropout_mask_shapes) == len(model.dropout_rates)


def test_the_models_standardise_with_the_specs_statistics_and_never_ship_them_as_weights() -> None:
    model = build_model(rgb_spec("rgb-cnn", side=32))
    pixels = torch.full((1, 3, 32, 32), 0.5)
    standardised = model.standardise(pixels)
    assert torch.allclose(standardised[0, :, 0, 0], torch.tensor([0.0, 0.2, 0.4]), atol=1e-6)
    assert not any("input_" in name for name in get_weights(model))


def test_mobilenet_at_full_width_is_a_camera_class_model() -> None:
    spec = dataclasses.replace(rgb_spec(side=224), width_multiplier=1.0)
    weights = get_weights(build_model(spec))
    megabytes = sum(array.nbytes for array in weights.values()) / 1e6
    assert 12.0 < megabytes < 14.0  # MobileNet v1's 3.2M parameters in float32


@pytest.mark.parametrize("architecture", ["rgb-cnn", "mobilenet"])
def test_a_zoo_bundle_scores_like_torch_and_carries_its_spec(tmp_path: Path, architecture: str) -> None:
    spec = rgb_spec(architecture, side=64)
    model = build_model(spec, seed=2)
    write_bundle(get_weights(model), tmp_path / "bundle", spec)
    bundle = load_bundle(tmp_path / "bundle")
    assert bundle.manifest.spec == spec and bundle.manifest.class_names == CLASSES
    assert bundle.manifest.input_shape == [3, 64, 64]
    pixels = np.random.default_rng(0).integers(0, 256, (20, 64, 64, 3), dtype=np.uint8)
    torch_probs = TorchMCDropout(model, batch_size=8).probabilities(model_input(pixels), 5, seed=3)
    ort_probs = OrtMCDropout(bundle, batch_size=8).probabilities(pixels, 5, seed=3)
    assert torch_probs.shape == (5, 20, 5) and float(np.max(np.abs(torch_probs - ort_probs))) <= 1e-5


def test_a_head_only_spec_trains_the_classifier_and_nothing_else() -> None:
    spec = rgb_spec("rgb-cnn", side=32, trainable="head")
    model = build_model(spec, seed=4)
    before = get_weights(model)
    rng = np.random.default_rng(1)
    images = rng.integers(0, 256, (64, 32, 32, 3), dtype=np.uint8)
    train_supervised(
        model, images, rng.integers(0, 5, 64), TrainSettings(epochs=1, batch_size=16, learning_rate=0.01, seed=0)
    )
    changed = {name for name, array in get_weights(model).items() if not np.array_equal(array, before[name])}
    assert changed == {"fc2.weight", "fc2.bias"}


def test_initial_weights_load_a_backbone_by_name_and_keep_a_fresh_classifier(tmp_path: Path) -> None:
    ten_classes = get_weights(build_model(rgb_spec("rgb-cnn", side=32, class_names=[f"c{i}" for i in range(10)])))
    save_arrays(tmp_path / "backbone.npz", ten_classes)
    fresh = get_weights(build_model(rgb_spec("rgb-cnn", side=32), seed=5))
    merged = merge_initial_weights(fresh, read_weight_file(tmp_path / "backbone.npz"), "fc2", "backbone.npz")
    assert np.array_equal(merged["conv1.weight"], ten_classes["conv1.weight"])
    assert np.array_equal(merged["fc2.weight"], fresh["fc2.weight"]) and merged["fc2.weight"].shape == (5, 128)
    wider = get_weights(build_model(dataclasses.replace(rgb_spec("rgb-cnn", side=32), width_multiplier=0.5)))
    with pytest.raises(ValueError, match=r"shapes differ from the model's for \['conv1.weight'"):
        merge_initial_weights(fresh, wider, "fc2", "wider.npz")
    with pytest.raises(ValueError, match="no tensor matches"):
        merge_initial_weights(fresh, {"other": np.zeros(3, dtype=np.float32)}, "fc2", "other.npz")


def test_initial_weights_come_from_an_onnx_files_initializers(tmp_path: Path) -> None:
    spec = rgb_spec("rgb-cnn", side=32)
    source = get_weights(build_model(spec, seed=6))
    write_bundle(source, tmp_path / "bundle", spec)
    found = read_weight_file(tmp_path / "bundle" / "prefix.onnx")
    assert np.array_equal(found["conv1.weight"], source["conv1.weight"])
    with pytest.raises(ValueError, match="not a readable ONNX file"):
        (tmp_path / "junk.onnx").write_bytes(b"not onnx")
        read_weight_file(tmp_path / "junk.onnx")


def test_a_run_resumes_only_with_the_spec_it_started_with(tmp_path: Path) -> None:
    config = {"settings": settings_as_dict(ServerSettings(run_dir=tmp_path, spec=rgb_spec()))}
    check_same_spec(config, rgb_spec())
    with pytest.raises(ValueError, match="started with model spec .* \\(mobilenet\\), not .* \\(paper-cnn\\)"):
        check_same_spec(config, DEFAULT_SPEC)
    check_same_spec({"settings": {"model_name": "paper-cnn"}}, DEFAULT_SPEC)  # a run from before specs


def test_a_model_whose_spec_is_not_the_announced_one_refuses_the_round() -> None:
    recipe, spec = messages.Recipe(), rgb_spec()
    announced = messages.RoundAnnouncement("run", 1, "ab" * 32, recipe, 0.0, spec_hash=spec_hash(spec))
    assert announced_spec_problem(announced, spec) is None
    assert announced_spec_problem(dataclasses.replace(announced, spec_hash=""), spec) is None
    problem = announced_spec_problem(announced, DEFAULT_SPEC)
    assert (
        problem
        == f"the model's spec hashes to {spec_hash(DEFAULT_SPEC)[:12]}, the round announced {spec_hash(spec)[:12]}"
    )
