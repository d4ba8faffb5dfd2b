# Model bundles on the device: read a bundle's manifest.json and verify every file it lists before use (no torch).
from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from edge_agent.learning.onnx_initializers import OnnxGraphError, graph_weights
from protocol.errors import FalError
from protocol.files import atomic_link, atomic_write_bytes, load_arrays
from protocol.manifest import BundleManifest, ManifestError
from protocol.tensors import Weights, weights_hash

MANIFEST_NAME = "manifest.json"
PRECISIONS = ("fp32", "int8")


class BundleError(FalError, ValueError):
    """A bundle is missing, incomplete, corrupted or inconsistent; the message names the file."""


def file_sha256(path: Path) -> str:
    """Hex SHA-256 of a file's bytes, read in chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


@dataclass(frozen=True)
class Bundle:
    """A verified model bundle: its folder and manifest; every file the manifest lists matched its sha256."""

    path: Path
    manifest: BundleManifest

    def graph_path(self, precision: str, part: str) -> Path:
        """The ONNX file of a graph part ('prefix' or 'tail') at a precision ('fp32' or 'int8')."""
        graphs = self.manifest.graphs
        if precision not in graphs:
            raise BundleError(f"{self.path / MANIFEST_NAME}: no {precision} graphs (has {', '.join(sorted(graphs))})")
        return self.path / graphs[precision][part]

    @property
    def weights_path(self) -> Path:
        """The float32 weights (.npz) the graphs were exported from."""
        return self.path / self.manifest.weights_file

    @property
    def dropout_rates(self) -> tuple[float, ...]:
        """Rates of the tail's dropout layers, in order."""
        return tuple(float(rate) for rate in self.manifest.dropout.rates)

    @property
    def mask_shapes(self) -> tuple[tuple[int, ...], ...]:
        """Per-sample shape of each dropout mask input, in order."""
        return tuple(tuple(int(d) for d in shape) for shape in self.manifest.dropout.mask_shapes)

    def initializers(self, part: str) -> dict[str, str]:
        """The fp32 graph part's initializer names mapped to the model weights they hold."""
        mapping = self.manifest.initializers.get(part)
        if not mapping:
            raise BundleError(
                f"{self.path / MANIFEST_NAME}: no initializer map for the {part} graph "
                "(re-export the bundle with this version of fl-export)"
            )
        return dict(mapping)

    @property
    def mask_inputs(self) -> tuple[str, ...]:
        """Names of the tail graph's mask inputs, in dropout order."""
        return tuple(self.manifest.dropout.mask_inputs)


def _read_manifest(manifest_path: Path) -> BundleManifest:
    """The typed manifest, after checking it exists, parses and carries every key of the right kind."""
    if not manifest_path.is_file():
        raise BundleError(f"{manifest_path} is missing: not a model bundle (export one with fl-export)")
    return parsed_manifest(manifest_path.read_bytes(), str(manifest_path))


def parsed_manifest(data: bytes, where: str) -> BundleManifest:
    """The typed manifest of manifest.json's bytes; BundleError naming `where` if it does not parse or check."""
    try:
        return BundleManifest.from_json(json.loads(data), where)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise BundleError(f"{where}: corrupt manifest ({str(exc)[:200]})") from exc
    except ManifestError as exc:
        raise BundleError(str(exc)) from None


def _check_listed_files(bundle_dir: Path, manifest: BundleManifest) -> None:
    """Every file the manifest uses is listed with a sha256, and every listed file exists and matches it."""
    files = manifest.files
    used = [manifest.weights_file] + [name for parts in manifest.graphs.values() for name in parts.values()]
    unlisted = [name for name in used if name not in files]
    if unlisted:
        raise BundleError(f"{bundle_dir / MANIFEST_NAME}: {', '.join(unlisted)} not listed with a sha256")
    for name, expected in files.items():
        path = bundle_dir / name
        if Path(name).name != name:
            raise BundleError(f"{bundle_dir / MANIFEST_NAME}: file name {name!r} must not contain a folder")
        if not path.is_file():
            raise BundleError(f"{path} is missing from the bundle")
        actual = file_sha256(path)
        if actual != expected:
            raise BundleError(
                f"{path}: sha256 {actual[:16]}... does not match the manifest's {expected[:16]}... "
                "(corrupted or tampered)"
            )


def load_bundle(path: Path | str) -> Bundle:
    """Opens a bundle folder and verifies the sha256 of every file before anything is loaded from it."""
    bundle_dir = Path(path)
    if not bundle_dir.is_dir():
        raise BundleError(f"{bundle_dir} is not a bundle folder")
    manifest = _read_manifest(bundle_dir / MANIFEST_NAME)
    _check_listed_files(bundle_dir, manifest)
    return Bundle(bundle_dir, manifest)


def bundle_weights(bundle: Bundle) -> Weights:
    """The whole model a verified bundle was exported from: its weights file and, for a frozen backbone (whose
    weights the file leaves out), the fp32 prefix graph's initializers; checked against the manifest's hash."""
    weights = load_arrays(bundle.weights_path)
    if set(bundle.manifest.initializers.get("prefix", {}).values()) - set(weights):
        prefix = bundle.graph_path("fp32", "prefix")
        try:
            weights = {**graph_weights(prefix.read_bytes()), **weights}
        except OnnxGraphError as error:
            raise BundleError(f"{prefix}: {error}") from None
    if weights_hash(weights) != bundle.manifest.weights_hash:
        raise BundleError(f"{bundle.weights_path}: weights hash differs from the manifest's weights_hash")
    return weights


def bundle_files(bundle: Bundle) -> dict[str, bytes]:
    """Every file of a verified bundle by name, the manifest included: what goes on the wire."""
    names = [MANIFEST_NAME, *bundle.manifest.files]
    return {name: (bundle.path / name).read_bytes() for name in names}


def store_bundle(folder: Path | str, files: dict[str, bytes], stored: Mapping[str, Path] | None = None) -> Bundle:
    """Writes received bundle files into folder (each atomically; the manifest last), links in `stored` (files
    already on disk by name: the device's backbone graphs) and verifies them all.

    A name with a folder in it, or a set of files that does not verify, raises BundleError naming the file.
    """
    folder = Path(folder)
    stored = stored or {}
    if MANIFEST_NAME not in files:
        raise BundleError(f"{folder}: received bundle has no {MANIFEST_NAME}")
    for name in [*files, *stored]:
        if Path(name).name != name or name in ("", ".", ".."):
            raise BundleError(f"{folder}: received bundle file name {name!r} must be a plain file name")
    for name, source in stored.items():
        atomic_link(source, folder / name)
    for name, data in sorted(files.items(), key=lambda item: item[0] == MANIFEST_NAME):
        atomic_write_bytes(folder / name, data)
    return load_bundle(folder)


def remove_other_bundles(keep: Path) -> None:
    """Deletes the bundle folders beside `keep` (earlier global models'), so a device stores only the current one."""
    for folder in Path(keep).parent.iterdir():
        if folder.is_dir() and folder != Path(keep) and (folder / MANIFEST_NAME).exists():
            shutil.rmtree(folder, ignore_errors=True)
