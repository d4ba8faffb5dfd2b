# The two MC-dropout back ends: same seed -> same masks -> same probabilities; the score command and its JSON.
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from bench.shard import Shard, save_shard
from edge_agent.data.fashion_mnist import load_fashion_mnist
from edge_agent.data.image_arrays import model_input
from edge_agent.learning.acquisition_scores import entropy_scores, top_k
from edge_agent.learning.bundle import load_bundle
from edge_agent.learning.mc_dropout import TorchMCDropout
from edge_agent.learning.mc_scorer import DropoutSpec, batch_masks, dropout_masks
from edge_agent.learning.models import build_model, get_weights
from edge_agent.learning.ort_scorer import OrtMCDropout, session_options
from edge_agent.learning.training import TrainSettings, train_supervised
from edge_agent.score_command import load_pool_images
from export.bundle_writer import write_bundle


@pytest.fixture(scope="module")
def images() -> np.ndarray:
    return load_fashion_mnist().test_images[:300]


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    """Briefly trained, so that entropies are spread out and a top-k is not decided by float rounding."""
    dataset = load_fashion_mnist()
    trained = build_model(seed=3)
    train_supervised(
        trained,
        dataset.train_images[:1000],
        dataset.train_labels[:1000],
        TrainSettings(epochs=2, batch_size=32, learning_rate=1e-3, optimizer="adam", seed=3),
    )
    return trained


@pytest.fixture(scope="module")
def bundle_dir(tmp_path_factory: pytest.TempPathFactory, model: torch.nn.Module) -> Path:
    out = tmp_path_factory.mktemp("bundle")
    write_bundle(get_weights(model), out)
    return out


def test_masks_are_scaled_binary_and_seeded() -> None:
    spec = DropoutSpec((0.25, 0.5), ((4, 3), (7,)))
    first = dropout_masks(np.random.default_rng(5), 2000, spec)
    again = dropout_masks(np.random.default_rng(5), 2000, spec)
    assert all(np.array_equal(a, b) for a, b in zip(first, again))
    assert set(np.unique(first[0])) == {0.0, np.float32(1 / 0.75)} and first[1].shape == (2000, 7)
    assert abs(float(np.mean(first[1] == 0)) - 0.5) < 0.02


def test_all_ones_masks_give_the_eval_mode_tail(model: torch.nn.Module, images: np.ndarray) -> None:
    model.eval()
    with torch.no_grad():
        features = model.prefix(torch.from_numpy(model_input(images[:16])))
        ones = [torch.ones(16, *shape) for shape in model.dropout_mask_shapes]
        assert torch.equal(model.tail_with_masks(features, ones), model.tail(features))


def test_torch_and_onnxruntime_agree_under_the_same_masks(model, bundle_dir: Path, images: np.ndarray) -> None:
    normalised = model_input(images)
    torch_probs = TorchMCDropout(model, batch_size=64).probabilities(normalised, 8, seed=11)
    ort_probs = OrtMCDropout(load_bundle(bundle_dir), batch_size=64).probabilities(normalised, 8, seed=11)
    assert torch_probs.shape == ort_probs.shape == (8, 300, 10)
    assert float(np.max(np.abs(torch_probs - ort_probs))) <= 1e-5
    assert np.array_equal(top_k(entropy_scores(torch_probs), 50), top_k(entropy_scores(ort_probs), 50))


def test_the_batch_size_does_not_change_the_passes(model, bundle_dir: Path, images: np.ndarray) -> None:
    """Masks are drawn per image, so torch at batch 256 and onnxruntime at batch 7 give the same passes."""
    inputs = model_input(images[:40])
    torch_probs = TorchMCDropout(model, 256).probabilities(inputs, 5, seed=11)
    ort_probs = OrtMCDropout(load_bundle(bundle_dir), batch_size=7).probabilities(inputs, 5, seed=11)
    assert np.abs(torch_probs - ort_probs).max() <= 1e-5
    assert np.abs(torch_probs - TorchMCDropout(model, 3).probabilities(inputs, 5, seed=11)).max() <= 1e-6


def test_onnxruntime_passes_differ_so_dropout_survived(bundle_dir: Path, images: np.ndarray) -> None:
    scorer = OrtMCDropout(load_bundle(bundle_dir), batch_size=100)
    normalised = model_input(images[:100])
    probs = scorer.probabilities(normalised, 4, seed=1)
    other_seed = scorer.probabilities(normalised, 4, seed=2)
    assert float(np.max(np.abs(probs[0] - probs[1]))) > 1e-3
    assert float(np.max(np.abs(probs - other_seed))) > 1e-3
    assert np.array_equal(probs, scorer.probabilities(normalised, 4, seed=1))


def test_bad_pass_count_is_one_clear_error(model) -> None:
    with pytest.raises(ValueError, match="at least 1"):
        TorchMCDropout(model).probabilities(np.zeros((2, 1, 28, 28), np.float32), 0, seed=0)


@pytest.fixture(scope="module")
def pool_file(tmp_path_factory: pytest.TempPathFactory, images: np.ndarray) -> Path:
    path = tmp_path_factory.mktemp("pool") / "pool.npz"
    save_shard(path, Shard(images, np.zeros(len(images), dtype=np.int64)))
    return path


def _score(bundle_dir: Path, pool: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "edge_agent",
            "score",
            "--bundle",
            str(bundle_dir),
            "--pool",
            str(pool),
            "--passes",
            "5",
            "--top",
            "30",
            "--json",
            *extra,
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize("backend", ["onnxruntime", "torch"])
def test_score_command_prints_the_json_keys(bundle_dir: Path, pool_file: Path, backend: str) -> None:
    result = _score(bundle_dir, pool_file, "--backend", backend, "--batch", "64", "--limit", "200")
    assert result.returncode == 0, result.stderr
    record = json.loads(result.stdout)
    assert {"images_per_second", "peak_rss_mb", "selected", "backend", "passes", "images"} <= set(record)
    assert (record["backend"], record["passes"], record["images"], record["selected"]) == (backend, 5, 200, 30)
    assert record["images_per_second"] > 0 and record["peak_rss_mb"] > 0


def test_onnxruntime_scoring_never_imports_torch(bundle_dir: Path, pool_file: Path) -> None:
    code = (
        "import sys\n"
        "from edge_agent.cli import main\n"
        f"assert main(['score', '--bundle', {str(bundle_dir)!r}, '--pool', {str(pool_file)!r}, '--passes', '3',"
        " '--top', '10', '--json', '--backend', 'onnxruntime']) == 0\n"
        "print('TORCH_LOADED' if 'torch' in sys.modules else 'NO_TORCH')\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "NO_TORCH"
    assert json.loads(result.stdout.splitlines()[0])["backend"] == "onnxruntime"


def test_missing_execution_provider_falls_back_to_cpu_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    from edge_agent.learning.ort_scorer import select_providers

    with caplog.at_level("WARNING"):
        assert select_providers(["NoSuchExecutionProvider"]) == ["CPUExecutionProvider"]
    assert "NoSuchExecutionProvider is not available" in caplog.text


def test_batch_masks_are_the_per_image_draws_stacked_pass_major_and_reuse_buffers() -> None:
    spec = DropoutSpec((0.25, 0.5), ((4, 3), (7,)))
    per_image = [dropout_masks(np.random.default_rng([9, 10 + offset]), 6, spec) for offset in range(5)]
    expected = [
        np.stack([masks[layer] for masks in per_image], axis=1).reshape(30, *shape)
        for layer, shape in enumerate(spec.mask_shapes)
    ]
    fresh = batch_masks(9, 10, 5, 6, spec)
    buffers = batch_masks(0, 0, 8, 6, spec)
    reused = batch_masks(9, 10, 5, 6, spec, out=buffers)
    for want, got, again, buffer in zip(expected, fresh, reused, buffers):
        assert got.dtype == np.float32 and np.array_equal(want, got) and np.array_equal(want, again)
        assert np.shares_memory(again, buffer)


def test_raw_images_and_any_tail_rows_give_the_same_passes(bundle_dir: Path, images: np.ndarray) -> None:
    """uint8 images are normalised per batch; splitting a batch's passes over tail calls changes nothing."""
    bundle = load_bundle(bundle_dir)
    reference = OrtMCDropout(bundle, batch_size=16, tail_rows=None).probabilities(model_input(images[:50]), 7, seed=4)
    for tail_rows in (1, 40, 1000):
        probs = OrtMCDropout(bundle, batch_size=16, tail_rows=tail_rows).probabilities(images[:50], 7, seed=4)
        assert probs.shape == (7, 50, 10) and probs.dtype == np.float32
        assert np.abs(probs - reference).max() <= 1e-6


def test_raw_images_give_the_torch_back_end_the_same_passes(model, images: np.ndarray) -> None:
    scorer = TorchMCDropout(model, batch_size=32)
    assert (
        np.abs(
            scorer.probabilities(images[:40], 3, seed=2) - scorer.probabilities(model_input(images[:40]), 3, seed=2)
        ).max()
        <= 1e-6
    )


def test_scorer_rejects_images_that_are_neither_raw_nor_normalised(bundle_dir: Path) -> None:
    with pytest.raises(ValueError, match="raw uint8"):
        OrtMCDropout(load_bundle(bundle_dir)).probabilities(np.zeros((2, 28, 28), np.float32), 2, seed=0)


def test_onnxruntime_sessions_share_one_arena_without_memory_patterns() -> None:
    options = session_options(2)
    assert options.get_session_config_entry("session.use_env_allocators") == "1"
    assert not options.enable_mem_pattern and options.enable_cpu_mem_arena and options.intra_op_num_threads == 2


def test_pools_load_as_uint8_and_npy_is_memory_mapped(pool_file: Path, images: np.ndarray, tmp_path: Path) -> None:
    assert np.array_equal(load_pool_images(pool_file), images)
    np.save(tmp_path / "pool.npy", images)
    mapped = load_pool_images(tmp_path / "pool.npy")
    assert isinstance(mapped, np.memmap) and not mapped.flags.writeable and np.array_equal(mapped, images)
    np.save(tmp_path / "floats.npy", images.astype(np.float32))
    with pytest.raises(ValueError, match="expected uint8"):
        load_pool_images(tmp_path / "floats.npy")
    (tmp_path / "broken.npz").write_bytes(b"not a zip")
    with pytest.raises(ValueError, match="broken.npz"):
        load_pool_images(tmp_path / "broken.npz")


def test_score_command_scores_an_npy_pool(bundle_dir: Path, images: np.ndarray, tmp_path: Path) -> None:
    np.save(tmp_path / "pool.npy", images[:100])
    result = _score(bundle_dir, tmp_path / "pool.npy", "--backend", "onnxruntime")
    assert result.returncode == 0, result.stderr
    record = json.loads(result.stdout)
    assert (record["images"], record["selected"]) == (100, 30)


def test_importing_the_score_command_loads_no_runtime() -> None:
    """Each back end's runtime is imported when it is chosen, so `edge-agent run` never pays for onnxruntime."""
    code = (
        "import sys, edge_agent.score_command\n"
        "print(sorted(name for name in ('torch', 'onnxruntime') if name in sys.modules))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
