# The example model specs in examples/: each loads with the real loader and builds a model that runs on its input.
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from edge_agent.learning.models import build_model
from protocol.model_spec import DEFAULT_SPEC, load_model_spec, spec_hash

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
SPEC_FILES = sorted(EXAMPLES.glob("*.toml"))
EXPECTED = {"paper-cnn.toml", "rgb-camera.toml", "mobilenet-camera.toml", "camera-efficientnet.toml"}


def test_the_documented_examples_exist() -> None:
    """The files examples/README.md describes are there (so the parametrised tests below cannot pass on none)."""
    missing = EXPECTED - {path.name for path in SPEC_FILES}
    assert not missing


@pytest.mark.parametrize("path", SPEC_FILES, ids=lambda path: path.name)
def test_example_builds_a_model_with_one_output_per_class(path: Path) -> None:
    """The spec loads, names no weights file it lacks, and its model maps a blank batch to len(names) logits."""
    spec_file = load_model_spec(path)
    spec = spec_file.spec
    assert spec_file.initial_weights is None or spec_file.initial_weights.is_file()
    model = build_model(spec, seed=0).eval()
    with torch.no_grad():
        logits = model(torch.zeros(2, *spec.input_shape))
    assert logits.shape == (2, len(spec.class_names))
    assert torch.isfinite(logits).all()


def test_paper_cnn_example_is_the_default_spec() -> None:
    """examples/paper-cnn.toml is what a run without --model-spec uses, down to the spec hash."""
    spec = load_model_spec(EXAMPLES / "paper-cnn.toml").spec
    assert spec == DEFAULT_SPEC
    assert spec_hash(spec) == spec_hash(DEFAULT_SPEC)


@pytest.mark.parametrize("name", ["rgb-camera.toml", "mobilenet-camera.toml", "camera-efficientnet.toml"])
def test_camera_examples_take_colour_images(name: str) -> None:
    """The camera examples are three-channel specs with their own class names and one mean and std per channel."""
    spec = load_model_spec(EXAMPLES / name).spec
    assert spec.channels == 3 and len(spec.mean) == len(spec.std) == 3
    assert spec.class_names != DEFAULT_SPEC.class_names
    assert spec.image_shape == (spec.height, spec.width, 3)
