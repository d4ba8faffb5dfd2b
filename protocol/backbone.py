# The frozen backbone: the prefix graphs a frozen spec never changes, which travel once per run instead of per round.
from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

from protocol.manifest import BundleManifest
from protocol.model_spec import ModelSpec, trainable_names
from protocol.wire import WireError, shown

SHA256_HEX = re.compile(r"^[0-9a-f]{64}$")


@dataclass(frozen=True)
class BackboneSplit:
    """What of a bundle (and its model) travels as the backbone: the prefix graphs by file name and sha256, the
    sha256 of the fp32 one (the model message names it), and the weights that graph holds as initializers (left
    out of every model message and of the bundle's weights file)."""

    files: dict[str, str]
    graph: str
    held: frozenset[str]


def frozen_prefix(spec: ModelSpec, prefix_weights: Iterable[str]) -> frozenset[str]:
    """The weights an fp32 prefix graph holds when the spec trains none of them (its backbone is frozen); empty
    when the spec trains every tensor or any tensor of the prefix (`last:N`: the prefix changes every round)."""
    held = frozenset(prefix_weights)
    if spec.trainable == "all" or trainable_names(spec, sorted(held)):
        return frozenset()
    return held


def backbone_split(manifest: BundleManifest) -> BackboneSplit | None:
    """How a bundle splits into per-round files and its backbone; None when its spec's prefix is not frozen or the
    bundle was written without the split (its weights file then holds every weight)."""
    held = frozen_prefix(manifest.spec, manifest.initializers.get("prefix", {}).values())
    if not held:
        return None
    names = {parts["prefix"] for parts in manifest.graphs.values()}
    return BackboneSplit(
        {name: manifest.files[name] for name in sorted(names)}, manifest.files[manifest.graphs["fp32"]["prefix"]], held
    )


def checked_digest(kind: str, digest: str) -> str:
    """A sha256 named by a message (it becomes a topic level and a file name); WireError for anything else."""
    if not SHA256_HEX.fullmatch(digest):
        raise WireError(f"{kind} {shown(digest)} is not a hex sha256")
    return digest
