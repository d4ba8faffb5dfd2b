# The model bundle's manifest as one typed value: written by export, read by devices, checked key by key.
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from protocol.errors import FalError
from protocol.model_spec import ModelSpec, SpecError, spec_from_dict

BUNDLE_FORMAT = "edge-fal-model-bundle"
BUNDLE_VERSION = 2
# The exporter names the initializer of model weight `w` `model.w` (graph constants have other names).
WEIGHT_INITIALIZER_PREFIX = "model."
MASK_ENCODING = (
    "float32, pre-scaled: 0 with probability p, else 1/(1-p); shape (rows, *mask_shape); all ones = dropout off"
)


class ManifestError(FalError, ValueError):
    """A manifest that lacks a key or holds a value of the wrong kind; the message names the key."""


@dataclass(frozen=True)
class Normalisation:
    """How raw pixels become graph inputs: (pixel * scale - mean) / std. The graphs standardise with the spec's
    per-channel statistics themselves, so a bundle's graphs take pixel / 255 (PIXEL_INPUT)."""

    scale: float
    mean: float
    std: float
    formula: str = "(pixel * scale - mean) / std"


PIXEL_INPUT = Normalisation(1.0 / 255.0, 0.0, 1.0)


@dataclass(frozen=True)
class DropoutSection:
    """The masked tail's dropout layers: rates, mask input names and per-sample mask shapes, in order."""

    rates: list[float]
    mask_inputs: list[str]
    mask_shapes: list[list[int]]
    mask_encoding: str = MASK_ENCODING


@dataclass(frozen=True)
class HeadSection:
    """What a device that trains only the classifier needs: the graph from prefix features to the classifier's
    input (dropout off), the classifier's weight names, and the dropout rate on its input."""

    graph: str
    input_name: str
    output_name: str
    weight: str
    bias: str
    dropout: float


@dataclass(frozen=True)
class BundleManifest:
    """manifest.json of a model bundle: what the graphs compute, from which weights, and every file's sha256."""

    model: str
    input_name: str
    input_shape: list[int]
    normalisation: Normalisation
    class_names: list[str]
    weights_hash: str
    weights_file: str
    graphs: dict[str, dict[str, str]]
    outputs: dict[str, str]
    initializers: dict[str, dict[str, str]]
    files: dict[str, str]
    opset: int
    exporter: dict[str, str]
    dropout: DropoutSection
    spec: ModelSpec
    quantization: dict[str, Any] | None = None
    head: HeadSection | None = None
    format: str = BUNDLE_FORMAT
    format_version: int = BUNDLE_VERSION

    def to_json(self) -> dict[str, Any]:
        """The manifest as JSON-able nested dicts (what manifest.json holds)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, raw: Any, where: str) -> BundleManifest:
        """The manifest read from parsed JSON; ManifestError names `where` and the first bad key."""
        if not isinstance(raw, dict) or raw.get("format") != BUNDLE_FORMAT:
            raise ManifestError(f"{where}: not a {BUNDLE_FORMAT} manifest")
        if raw.get("format_version") != BUNDLE_VERSION:
            raise ManifestError(
                f"{where}: bundle format version {str(raw.get('format_version'))[:20]}, "
                f"this agent reads version {BUNDLE_VERSION}"
            )
        values = {field.name: _field(raw, field.name, where) for field in dataclasses.fields(cls) if field.name in raw}
        missing = [field.name for field in dataclasses.fields(cls) if _required(field) and field.name not in raw]
        if missing:
            raise ManifestError(f"{where}: manifest lacks {', '.join(missing)}")
        values["normalisation"] = _section(Normalisation, raw["normalisation"], f"{where}: normalisation")
        values["dropout"] = _section(DropoutSection, raw["dropout"], f"{where}: dropout")
        try:
            values["spec"] = spec_from_dict(raw["spec"], f"{where}: spec")
        except SpecError as error:
            raise ManifestError(str(error)) from None
        if raw.get("head") is not None:
            values["head"] = _section(HeadSection, raw["head"], f"{where}: head")
        return cls(**values)


def weight_of_initializer(name: str) -> str | None:
    """The model weight an exported graph's initializer holds (by the exporter's naming), None for a constant."""
    return name.removeprefix(WEIGHT_INITIALIZER_PREFIX) if name.startswith(WEIGHT_INITIALIZER_PREFIX) else None


def _required(field: dataclasses.Field) -> bool:
    """True for a field without a default."""
    return field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING


KINDS: dict[str, type | tuple[type, ...]] = {
    "model": str,
    "input_name": str,
    "input_shape": list,
    "class_names": list,
    "weights_hash": str,
    "weights_file": str,
    "graphs": dict,
    "outputs": dict,
    "initializers": dict,
    "files": dict,
    "opset": int,
    "exporter": dict,
    "quantization": (dict, type(None)),
    "format": str,
    "format_version": int,
    "normalisation": dict,
    "dropout": dict,
    "spec": dict,
    "head": (dict, type(None)),
}


def _field(raw: dict[str, Any], key: str, where: str) -> Any:
    """raw[key] after checking its JSON kind."""
    value = raw[key]
    if not isinstance(value, KINDS[key]):
        raise ManifestError(f"{where}: manifest key {key!r} has the wrong kind ({type(value).__name__})")
    return value


def _section(cls: type, raw: dict[str, Any], where: str) -> Any:
    """A nested section (normalisation, dropout) built from its dict; a missing or unknown key is named."""
    names = {field.name for field in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - names)
    if unknown:
        raise ManifestError(f"{where} has unknown keys {unknown[:5]}")
    try:
        return cls(**raw)
    except TypeError as error:
        raise ManifestError(f"{where}: {str(error)[:200]}") from None
