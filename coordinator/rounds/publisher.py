# Retained messages a late device needs: the announcement, the latest and the serving model (bundle, backbone), encoder.
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

from edge_agent.learning.bundle import MANIFEST_NAME, parsed_manifest
from protocol import messages, topics, wire
from protocol.backbone import BackboneSplit, backbone_split
from protocol.model_spec import DEFAULT_SPEC, ModelSpec, spec_hash
from protocol.mqtt import MqttSession
from protocol.serving_messages import ServingMessage
from protocol.tensors import Weights

log = logging.getLogger(__name__)

RETAIN_WAIT_SECONDS = 30.0


@dataclass(frozen=True)
class Artefacts:
    """What travels beside each global model: the model spec, its ONNX bundle (None: none shipped) and the
    recipe's frozen encoder bytes (b"": none)."""

    spec: ModelSpec = DEFAULT_SPEC
    bundle_files: Callable[[Weights, str], dict[str, bytes]] | None = None
    encoder: bytes = b""


def split_of(files: dict[str, bytes] | None) -> BackboneSplit | None:
    """The backbone split of a bundle's files (None: no bundle, or its spec's prefix is not frozen)."""
    if files is None:
        return None
    return backbone_split(parsed_manifest(files[MANIFEST_NAME], MANIFEST_NAME))


class RetainedPublisher:
    """Keeps exactly the current model, bundle, backbone, encoder and announcement retained on the fleet's topics,
    and the serving version's model, bundle and backbone beside them."""

    def __init__(self, session: MqttSession, fleet: str, run_id: str, artefacts: Artefacts) -> None:
        self.session = session
        self.fleet = fleet
        self.run_id = run_id
        self.artefacts = artefacts
        self._retained: dict[str, str] = {}

    def publish_model(self, weights: Weights, model_hash: str) -> None:
        """Retains the weights (and their ONNX bundle) on hash topics, clearing the previous model's copies (unless
        the serving version holds them). A frozen backbone's graphs are retained on their own hash topics, where
        they stay while they do not change, and the model and bundle leave out what those graphs hold."""
        self.retain_model("", weights, model_hash)

    def publish_serving(self, message: ServingMessage, weights: Weights) -> None:
        """Retains the serving version's model and bundle (kinds of their own, so they stay retained while it
        serves, whatever the latest round's model is), then the serving message that names them."""
        self.retain_model("serving ", weights, message.model_hash)
        topic = topics.SERVING.build(fleet=self.fleet)
        self.session.publish(topic, wire.encode(message), retain=True, wait=RETAIN_WAIT_SECONDS)

    def retain_model(self, role: str, weights: Weights, model_hash: str) -> None:
        """Retains a model, its bundle and backbone graphs as the kinds of a role ("": the latest round's model,
        "serving ": the serving version's)."""
        bundle_files = self.artefacts.bundle_files
        files = None if bundle_files is None else bundle_files(weights, model_hash)
        split = split_of(files)
        if split is not None and files is not None:
            self.publish_backbone(split, files, role)
        self.retain_current(
            f"{role}model",
            topics.MODEL.build(fleet=self.fleet, hash=model_hash),
            lambda: model_message(self.artefacts.spec, weights, model_hash, split),
        )
        if files is not None:
            self.retain_current(
                f"{role}bundle",
                topics.BUNDLE.build(fleet=self.fleet, hash=model_hash),
                lambda: bundle_message(files, model_hash, split),
            )

    def publish_backbone(self, split: BackboneSplit, files: dict[str, bytes], role: str = "") -> None:
        """Retains each graph of a frozen backbone (fp32, int8) as its own message on the topic of its sha256."""
        for name, digest in split.files.items():
            self.retain_current(
                f"{role}backbone {name}",
                topics.BACKBONE.build(fleet=self.fleet, hash=digest),
                partial(messages.BackboneMessage, digest, files[name]),
            )

    def publish_encoder(self, encoder_hash: str) -> None:
        """Retains the recipe's frozen encoder (FAST) on its hash topic, so late devices get it too."""
        if encoder_hash:
            self.retain_current(
                "encoder",
                topics.ENCODER.build(fleet=self.fleet, hash=encoder_hash),
                lambda: messages.EncoderMessage(encoder_hash, self.artefacts.encoder),
            )

    def retain_current(self, kind: str, topic: str, message: Callable[[], messages.Message]) -> None:
        """Retains one message of a kind on its topic unless it is already there (as this kind's or another's: the
        topics are content-addressed), then clears the kind's previous topic unless another kind still holds it,
        so a new subscriber finds only the current and the serving models (retained messages replay to everyone)."""
        previous = self._retained.get(kind)
        if topic == previous:
            return
        others = {held for other, held in self._retained.items() if other != kind}
        if topic not in others:
            self.session.publish(topic, wire.encode(message()), retain=True, wait=RETAIN_WAIT_SECONDS)
        if previous is not None and previous not in others:  # waited for: a device subscribing next finds none of it
            self.session.publish(previous, b"", retain=True, wait=RETAIN_WAIT_SECONDS)
        self._retained[kind] = topic

    def announce(
        self,
        round_id: int,
        model_hash: str,
        recipe: messages.Recipe,
        deadline: float,
        participants: list[str],
        label_shares: list[float] | None = None,
    ) -> None:
        """Retains the round announcement: round id, base model hash, recipe, deadline, participants, spec hash and the
        fleet's label shares (None: unknown)."""
        spec = spec_hash(self.artefacts.spec)
        shares = list(label_shares or [])
        self._announce(
            messages.RoundAnnouncement(
                self.run_id, round_id, model_hash, recipe, deadline, False, participants, spec, shares
            )
        )

    def announce_final(
        self, round_id: int, model_hash: str, recipe: messages.Recipe, label_shares: list[float] | None = None
    ) -> None:
        """Retains the final announcement: the run is over, devices may stop (those that go on serving keep the
        fleet's last label shares)."""
        spec = spec_hash(self.artefacts.spec)
        shares = list(label_shares or [])
        self._announce(
            messages.RoundAnnouncement(self.run_id, round_id, model_hash, recipe, time.time(), True, [], spec, shares)
        )

    def _announce(self, announcement: messages.RoundAnnouncement) -> None:
        """Publishes an announcement retained and waits for the broker to take it."""
        topic = topics.ROUND.build(fleet=self.fleet)
        self.session.publish(topic, wire.encode(announcement), retain=True, wait=RETAIN_WAIT_SECONDS)
        log.info(
            "round announced round=%d model=%s final=%s",
            announcement.round_id,
            announcement.model_hash[:12],
            announcement.final,
        )


def model_message(spec: ModelSpec, weights: Weights, model_hash: str, split: BackboneSplit | None) -> messages.Message:
    """The model message: every tensor, or (a frozen backbone) those its fp32 prefix graph does not hold."""
    if split is None:
        return messages.ModelMessage(model_hash, spec, weights)
    rest = {name: array for name, array in weights.items() if name not in split.held}
    return messages.ModelMessage(model_hash, spec, rest, backbone=split.graph)


def bundle_message(files: dict[str, bytes], model_hash: str, split: BackboneSplit | None) -> messages.Message:
    """The bundle message: every file, or (a frozen backbone) all but its graphs, which it names."""
    if split is None:
        return messages.BundleMessage(model_hash, files)
    rest = {name: data for name, data in files.items() if name not in split.files}
    return messages.BundleMessage(model_hash, rest, backbone=sorted(split.files))
