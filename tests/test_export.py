# fl-export: bundles with hashes that loading verifies, from a weights file or a run's checkpoint, int8 included.
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest

from coordinator.storage.store import RunStore
from edge_agent.learning.bundle import BundleError, bundle_files, load_bundle, store_bundle
from edge_agent.learning.mc_dropout import TorchMCDropout
from edge_agent.learning.models import build_model, get_weights
from edge_agent.learning.ort_scorer import OrtMCDropout
from export.bundle_writer import ensure_bundle_files, write_bundle
from protocol.files import save_arrays
from protocol.manifest import BundleManifest, ManifestError
from protocol.tensors import weights_hash


@pytest.fixture()
def bundle_dir(tmp_path: Path) -> Path:
    out = tmp_path / "bundle"
    write_bundle(get_weights(build_model(seed=4)), out)
    return out


def test_manifest_records_what_a_device_needs(bundle_dir: Path) -> None:
    bundle = load_bundle(bundle_dir)
    manifest = bundle.manifest.to_json()
    assert manifest["weights_hash"] == weights_hash(get_weights(build_model(seed=4)))
    assert manifest["input_shape"] == [1, 28, 28] and len(manifest["class_names"]) == 10
    assert bundle.mask_shapes == ((16, 10, 10), (16, 2, 2), (128,)) and bundle.dropout_rates == (0.25, 0.25, 0.5)
    tail = onnx.load(str(bundle.graph_path("fp32", "tail")))
    assert [graph_input.name for graph_input in tail.graph.input] == ["features", "mask1", "mask2", "mask3"]
    assert not any(node.op_type == "Dropout" for node in tail.graph.node)


def test_a_tampered_onnx_byte_is_named(bundle_dir: Path) -> None:
    target = bundle_dir / "tail.onnx"
    data = bytearray(target.read_bytes())
    data[len(data) // 2] ^= 0x01
    target.write_bytes(bytes(data))
    with pytest.raises(BundleError, match="tail.onnx.*does not match"):
        load_bundle(bundle_dir)


def test_missing_manifest_and_missing_file_are_clear(bundle_dir: Path) -> None:
    (bundle_dir / "prefix.onnx").unlink()
    with pytest.raises(BundleError, match="prefix.onnx is missing"):
        load_bundle(bundle_dir)
    (bundle_dir / "manifest.json").unlink()
    with pytest.raises(BundleError, match="manifest.json is missing"):
        load_bundle(bundle_dir)


def test_coordinator_export_of_a_run_checkpoint_with_int8(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    with RunStore(run_dir) as store:
        store.checkpoints.save(0, get_weights(build_model(seed=1)))
        expected = store.checkpoints.save(1, get_weights(build_model(seed=2)))
    result = subprocess.run(
        [sys.executable, "-m", "coordinator", "export", str(run_dir), "--out", str(tmp_path / "b"), "--int8"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert "round 1" in result.stdout and "int8 prefix: test accuracy" in result.stdout
    manifest = json.loads((tmp_path / "b" / "manifest.json").read_text())
    assert manifest["weights_hash"] == expected and "int8" in manifest["graphs"]
    assert -1.0 <= manifest["quantization"]["test_accuracy_change"] <= 1.0


def test_export_cli_bad_input_is_one_line(tmp_path: Path) -> None:
    save_arrays(tmp_path / "w.npz", {"conv1.weight": np.zeros((2, 2), np.float32)})
    result = subprocess.run(
        [sys.executable, "-m", "export", "--weights", str(tmp_path / "w.npz"), "--out", str(tmp_path / "b")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1
    assert "tensor names differ" in result.stderr


def test_manifest_maps_every_weight_to_one_fp32_initializer(bundle_dir: Path) -> None:
    bundle = load_bundle(bundle_dir)
    mapped = [*bundle.initializers("prefix").values(), *bundle.initializers("tail").values()]
    assert sorted(mapped) == sorted(get_weights(build_model(seed=4)))
    assert bundle.initializers("prefix")["model.conv1.weight"] == "conv1.weight"


def test_replacement_weights_make_onnxruntime_compute_that_model(bundle_dir: Path) -> None:
    bundle = load_bundle(bundle_dir)
    trained = build_model(seed=9)
    images = np.random.default_rng(1).integers(0, 256, (40, 28, 28), dtype=np.uint8)
    replaced = OrtMCDropout(bundle, weights=get_weights(trained)).probabilities(images, 4, seed=2)
    exported = OrtMCDropout(bundle).probabilities(images, 4, seed=2)
    assert np.abs(replaced - TorchMCDropout(trained).probabilities(images, 4, seed=2)).max() <= 1e-5
    assert np.abs(replaced - exported).max() > 1e-2


def test_replacement_weights_of_the_wrong_shape_or_precision_are_refused(bundle_dir: Path) -> None:
    bundle = load_bundle(bundle_dir)
    weights = get_weights(build_model(seed=9))
    with pytest.raises(
        ValueError, match=r"tail.onnx: model.fc2.weight has shape \(10, 128\), the replacement \(3, 3\)"
    ):
        OrtMCDropout(bundle, weights={**weights, "fc2.weight": np.zeros((3, 3), np.float32)})
    with pytest.raises(ValueError, match=r"weights lack \['conv1.bias'\]"):
        OrtMCDropout(bundle, weights={k: v for k, v in weights.items() if k != "conv1.bias"})
    with pytest.raises(ValueError, match="only fp32 graphs take replacement weights"):
        OrtMCDropout(bundle, precision="int8", weights=weights)


def test_shipped_files_stored_on_a_device_verify_and_bad_ones_are_named(bundle_dir: Path, tmp_path: Path) -> None:
    files = bundle_files(load_bundle(bundle_dir))
    assert set(files) == {"manifest.json", "prefix.onnx", "tail.onnx", "penultimate.onnx", "weights.npz"}
    stored = store_bundle(tmp_path / "device", files)
    assert stored.manifest == load_bundle(bundle_dir).manifest
    tampered = {**files, "prefix.onnx": files["prefix.onnx"][:-1] + b"\x00"}
    with pytest.raises(BundleError, match=r"prefix.onnx: sha256 .* does not match"):
        store_bundle(tmp_path / "device2", tampered)
    with pytest.raises(BundleError, match="has no manifest.json"):
        store_bundle(tmp_path / "device3", {"tail.onnx": files["tail.onnx"]})
    with pytest.raises(BundleError, match="must be a plain file name"):
        store_bundle(tmp_path / "device4", {**files, "../x": b""})
    assert not (tmp_path / "x").exists()


def test_ensure_bundle_files_exports_once_and_reuses(tmp_path: Path) -> None:
    weights = get_weights(build_model(seed=4))
    first = ensure_bundle_files(weights, tmp_path / "b")
    stamp = (tmp_path / "b" / "tail.onnx").stat().st_mtime_ns
    assert ensure_bundle_files(weights, tmp_path / "b") == first
    assert (tmp_path / "b" / "tail.onnx").stat().st_mtime_ns == stamp
    with pytest.raises(BundleError, match="expected"):
        ensure_bundle_files(get_weights(build_model(seed=5)), tmp_path / "b")


def test_the_typed_manifest_round_trips_and_names_a_missing_or_mistyped_key(bundle_dir: Path) -> None:
    manifest = load_bundle(bundle_dir).manifest
    raw = json.loads((bundle_dir / "manifest.json").read_text())
    assert BundleManifest.from_json(raw, "m") == manifest and manifest.to_json() == raw
    with pytest.raises(ManifestError, match="^m: manifest lacks opset$"):
        BundleManifest.from_json({key: value for key, value in raw.items() if key != "opset"}, "m")
    with pytest.raises(ManifestError, match="manifest key 'files' has the wrong kind \\(list\\)"):
        BundleManifest.from_json({**raw, "files": ["prefix.onnx"]}, "m")
    with pytest.raises(ManifestError, match="dropout has unknown keys \\['extra'\\]"):
        BundleManifest.from_json({**raw, "dropout": {**raw["dropout"], "extra": 1}}, "m")
