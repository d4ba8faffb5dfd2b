# FAST's no-download encoder: PCA of unlabelled images (hand-computed cases), its ONNX graph against numpy, and
# `fl-coordinator encoder` on a folder of images and on Fashion-MNIST, with its refusals.
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from coordinator.cli import main as coordinator_main
from coordinator.setup.encoder import load_encoder
from edge_agent.data.image_arrays import model_input
from edge_agent.learning.encoder import OnnxEncoder
from export.pca_encoder import PcaBasis, fit_pca, pca_encoder_onnx
from protocol.model_spec import DEFAULT_SPEC


def test_points_on_a_line_give_that_line_as_the_one_direction_with_all_the_variance() -> None:
    inputs = np.array([[-1.0, 5.0], [1.0, 5.0], [-2.0, 5.0], [2.0, 5.0]]).reshape(4, 1, 1, 2)
    basis = fit_pca(inputs, 1)
    np.testing.assert_allclose(basis.mean, [0.0, 5.0])
    np.testing.assert_allclose(basis.components, [[1.0, 0.0]], atol=1e-7)
    assert basis.explained == pytest.approx(1.0)
    np.testing.assert_allclose(basis.embed(np.array([3.0, 5.0]).reshape(1, 1, 1, 2)), [[3.0]], atol=1e-6)


def test_components_are_orthonormal_signed_and_ordered_by_variance() -> None:
    rng = np.random.default_rng(0)
    inputs = (rng.normal(size=(200, 3)) * [5.0, 2.0, 0.5]).reshape(200, 1, 1, 3)
    basis = fit_pca(inputs, 3)
    np.testing.assert_allclose(basis.components @ basis.components.T, np.eye(3), atol=1e-5)
    np.testing.assert_allclose(np.abs(basis.components), np.eye(3), atol=0.1)
    assert np.all(basis.components[np.arange(3), np.argmax(np.abs(basis.components), axis=1)] > 0)
    assert fit_pca(inputs, 1).explained == pytest.approx(25 / (25 + 4 + 0.25), abs=0.05)


def test_a_seeded_draw_of_the_images_is_fitted_the_same_way_twice() -> None:
    inputs = np.random.default_rng(1).random((50, 1, 2, 2))
    first, second = fit_pca(inputs, 2, fit_images=10, seed=3), fit_pca(inputs, 2, fit_images=10, seed=3)
    np.testing.assert_array_equal(first.components, second.components)
    assert not np.allclose(first.mean, fit_pca(inputs, 2).mean)


def test_too_few_images_or_dimensions_out_of_range_are_refused() -> None:
    with pytest.raises(ValueError, match="at least 2 images, got 1"):
        fit_pca(np.zeros((1, 1, 2, 2)), 1)
    with pytest.raises(ValueError, match=r"dimensions must be in 1\.\.3 for 3 images of 4 values, got 4"):
        fit_pca(np.random.default_rng(0).random((3, 1, 2, 2)), 4)
    with pytest.raises(ValueError, match="got 0"):
        fit_pca(np.random.default_rng(0).random((3, 1, 2, 2)), 0)


def test_the_onnx_graph_embeds_uint8_images_as_numpy_does() -> None:
    rng = np.random.default_rng(2)
    images = rng.integers(0, 256, (40, 28, 28), dtype=np.uint8)
    basis = fit_pca(model_input(images), 5)
    embedded = OnnxEncoder(pca_encoder_onnx(basis, DEFAULT_SPEC.input_shape)).embed(images[:7])
    assert embedded.shape == (7, 5)
    np.testing.assert_allclose(embedded, basis.embed(model_input(images[:7])), atol=1e-4)


def test_a_basis_for_other_images_is_refused_by_the_graph_builder() -> None:
    basis = PcaBasis(np.zeros(4, np.float32), np.eye(2, 4, dtype=np.float32), 1.0)
    with pytest.raises(ValueError, match="fitted on 4 values per image, the input has 784"):
        pca_encoder_onnx(basis, DEFAULT_SPEC.input_shape)


def _write_pngs(folder: Path, count: int) -> np.ndarray:
    """`count` random 28x28 grey PNGs in a folder; their pixels."""
    folder.mkdir()
    pixels = np.random.default_rng(4).integers(0, 256, (count, 28, 28), dtype=np.uint8)
    for index, image in enumerate(pixels):
        Image.fromarray(image, mode="L").save(folder / f"{index:02d}.png")
    return pixels


def test_encoder_command_fits_a_folder_of_images_as_the_device_will_see_them(tmp_path: Path, capsys) -> None:
    pixels = _write_pngs(tmp_path / "photos", 12)
    out = tmp_path / "encoders" / "pca.onnx"
    assert coordinator_main(["encoder", "--images", str(tmp_path / "photos"), "--pca", "3", "--out", str(out)]) == 0
    assert "PCA encoder, 3 dimensions" in capsys.readouterr().out
    expected = fit_pca(model_input(pixels), 3).embed(model_input(pixels))
    np.testing.assert_allclose(OnnxEncoder(load_encoder(out, DEFAULT_SPEC)).embed(pixels), expected, atol=1e-4)


def test_encoder_command_on_fashion_mnist_and_its_refusals_leave_no_file(tmp_path: Path, capsys) -> None:
    out = tmp_path / "pca.onnx"
    assert coordinator_main(["encoder", "--fit-images", "300", "--pca", "8", "--out", str(out)]) == 0
    assert OnnxEncoder(load_encoder(out, DEFAULT_SPEC)).embed(np.zeros((2, 28, 28), np.uint8)).shape == (2, 8)
    refused = tmp_path / "refused.onnx"
    assert coordinator_main(["encoder", "--fit-images", "300", "--pca", "0", "--out", str(refused)]) == 2
    assert coordinator_main(["encoder", "--fit-images", "1", "--out", str(refused)]) == 2
    assert coordinator_main(["encoder", "--images", str(tmp_path / "none"), "--out", str(refused)]) == 2
    errors = capsys.readouterr().err.splitlines()
    assert [line.split(":")[0] for line in errors] == ["fl-coordinator"] * 3
    assert "got 0" in errors[0] and "--fit-images must be at least 2" in errors[1] and "does not exist" in errors[2]
    assert sorted(path.name for path in tmp_path.iterdir()) == ["pca.onnx"]
