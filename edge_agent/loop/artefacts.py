# What a round needs from the broker besides its announcement: the model, its ONNX bundle, the frozen encoder, and
# the frozen backbone graphs those two reference (kept in the state folder across rounds and restarts); and the
# serving version's bundle, kept apart from the latest.
from __future__ import annotations

import logging
from pathlib import Path

from edge_agent.learning.bundle import MANIFEST_NAME, Bundle, BundleError, remove_other_bundles, store_bundle
from edge_agent.learning.encoder import encoder_hash
from edge_agent.loop.backbone_fetch import BackboneFetch
from edge_agent.loop.backbone_store import BackboneStore
from protocol import messages, topics, wire
from protocol.model_spec import ModelSpec
from protocol.mqtt import MqttSession
from protocol.tensors import Weights, weights_hash

log = logging.getLogger(__name__)

BUNDLES_FOLDER = "bundles"  # the latest model's bundle (the one a round trains from)
SERVING_FOLDER = "serving"  # the serving version's bundle (the one the device predicts with)
SERVING_MODEL = "serving model"  # the serving version's weights: what a relay passes on to its site (devices do not)


def content_matches(kind: str, announced: str, actual: str) -> bool:
    """True when retained content hashes to the name it was published under; a warning otherwise."""
    if actual != announced:
        log.warning("%s hash mismatch announced=%s actual=%s", kind, announced, actual)
        return False
    return True


class RoundArtefacts:
    """The current model, bundle and encoder, and the serving version's bundle (a relay's: its model), each kept only
    once its content matches its hash, and the retained topics followed for them (one per kind: following a new one
    leaves the previous, unless another kind follows it too). A model or bundle that references backbone graphs the store
    lacks waits while their topics are followed."""

    def __init__(
        self, session: MqttSession, fleet: str, bundles_dir: Path, backbone_dir: Path, serving_dir: Path | None = None
    ) -> None:
        self.session = session
        self.fleet = fleet
        self.bundles_dir = bundles_dir
        self.serving_dir = bundles_dir.parent / SERVING_FOLDER if serving_dir is None else serving_dir
        self.fetch = BackboneFetch(session, fleet, BackboneStore(backbone_dir))
        self.models: dict[str, Weights] = {}
        self.specs: dict[str, ModelSpec] = {}
        self.serving_models: dict[str, tuple[ModelSpec, Weights]] = {}
        self.bundles: dict[str, Bundle] = {}
        self.serving_bundles: dict[str, Bundle] = {}
        self.encoders: dict[str, bytes] = {}
        self.followed: dict[str, str] = {}

    def follow(self, kind: str, topic: str) -> None:
        """Subscribes to the current topic of a kind (model, bundle, serving, serving model, encoder), leaving the kind's previous
        one unless another kind follows it (and whatever of the kind waited for a backbone). A topic another kind
        follows is subscribed again, so its retained message comes again for this kind."""
        previous = self.followed.get(kind)
        if topic == previous:
            return
        self.fetch.drop(kind)
        self.followed[kind] = topic
        if previous is not None and previous not in self.followed.values():
            self.session.unsubscribe(previous)
        self.session.subscribe(topic)

    def follow_round(self, announcement: messages.RoundAnnouncement, with_bundle: bool) -> None:
        """Follows what a round needs: its model, its ONNX bundle (`with_bundle`), its recipe's encoder if any."""
        self.follow("model", topics.MODEL.build(fleet=self.fleet, hash=announcement.model_hash))
        if with_bundle:
            self.follow("bundle", topics.BUNDLE.build(fleet=self.fleet, hash=announcement.model_hash))
        if announcement.recipe.encoder:
            self.follow("encoder", topics.ENCODER.build(fleet=self.fleet, hash=announcement.recipe.encoder))

    def follows(self, kind: str, topic: str) -> bool:
        """Whether `topic` is the one followed for this kind (a message of a topic left behind is ignored)."""
        if kind == "backbone":
            return topic in self.fetch.topics
        return self.followed.get(kind) == topic

    def receive(self, kind: str, payload: bytes) -> None:
        """Decodes and keeps a model, bundle, backbone or encoder of a followed topic (WireError if malformed)."""
        if kind in ("model", SERVING_MODEL):
            self.on_model(wire.decode(payload, messages.ModelMessage), kind)
        elif kind in ("bundle", "serving"):
            self.on_bundle(wire.decode(payload, messages.BundleMessage), kind)
        elif kind == "backbone":
            self.on_backbone(wire.decode(payload, messages.BackboneMessage))
        else:
            self.on_encoder(wire.decode(payload, messages.EncoderMessage))

    def on_model(self, message: messages.ModelMessage, kind: str = "model") -> None:
        """Keeps the announced model (kind "model") or the serving version's (SERVING_MODEL), with the spec it is
        built from, once its content, completed from the stored backbone it references, matches its hash."""
        tensors = self.fetch.model(message, kind)
        if tensors is None or not content_matches(kind, message.model_hash, weights_hash(tensors)):
            return
        if kind == SERVING_MODEL:
            self.serving_models = {message.model_hash: (message.spec, tensors)}
        else:
            self.models = {message.model_hash: tensors}
            self.specs = {message.model_hash: message.spec}

    def on_backbone(self, message: messages.BackboneMessage) -> None:
        """Stores a backbone graph something waits for, then takes in again the model or bundle that waited."""
        waited = self.fetch.arrived(message)
        for kind, referencing in waited:
            if isinstance(referencing, messages.ModelMessage):
                self.on_model(referencing, kind)
            else:
                self.on_bundle(referencing, kind)
        if waited:
            self.fetch.settle()

    def on_encoder(self, message: messages.EncoderMessage) -> None:
        """Keeps the announced frozen encoder once its bytes match their sha256."""
        if content_matches("encoder", message.encoder_hash, encoder_hash(message.onnx)):
            self.encoders = {message.encoder_hash: message.onnx}

    def on_bundle(self, message: messages.BundleMessage, kind: str = "bundle") -> None:
        """Stores the ONNX bundle of the announced model (kind "bundle") or of the serving version ("serving") in
        the kind's own folder of the state folder once every file verifies; the kind's earlier bundle goes."""
        folder = (self.bundles_dir if kind == "bundle" else self.serving_dir) / message.model_hash
        try:
            received = self.fetch.bundle(message, kind)
            if received is None:
                return
            bundle = store_bundle(folder, *received)
        except (BundleError, OSError) as error:
            log.warning("bundle rejected kind=%s model=%s error=%s", kind, message.model_hash[:12], error)
            return
        if not content_matches(kind, message.model_hash, bundle.manifest.weights_hash):
            return
        self.keep_bundle(kind, bundle, message.model_hash)
        log.info("bundle stored model=%s files=%d kind=%s", message.model_hash[:12], len(message.files), kind)

    def held_bundles(self, kind: str) -> dict[str, Bundle]:
        """The bundle a kind holds ("bundle": the latest model's, "serving": the serving version's), by hash."""
        return self.bundles if kind == "bundle" else self.serving_bundles

    def keep_bundle(self, kind: str, bundle: Bundle, model_hash: str) -> None:
        """Keeps a verified bundle as the kind's only one (its other bundle folders deleted)."""
        remove_other_bundles(bundle.path)
        if kind == "bundle":
            self.bundles = {model_hash: bundle}
        else:
            self.serving_bundles = {model_hash: bundle}

    def bundle_of(self, kind: str, model_hash: str) -> Bundle | None:
        """The kind's bundle of `model_hash`: held, or the other kind's of the same model linked into the kind's
        folder (the serving version promoted from the model the device holds, or a round announced with the model
        that serves: the broker does not send a retained message the session completed once again); None if
        neither holds it."""
        held = self.held_bundles(kind).get(model_hash)
        other = self.held_bundles("serving" if kind == "bundle" else "bundle").get(model_hash)
        if held is not None or other is None:
            return held
        folder = (self.bundles_dir if kind == "bundle" else self.serving_dir) / model_hash
        try:
            manifest = (other.path / MANIFEST_NAME).read_bytes()
            bundle = store_bundle(
                folder, {MANIFEST_NAME: manifest}, {name: other.path / name for name in other.manifest.files}
            )
        except (BundleError, OSError) as error:
            log.warning("bundle not linked kind=%s model=%s error=%s", kind, model_hash[:12], error)
            return None
        self.keep_bundle(kind, bundle, model_hash)
        log.info("bundle stored model=%s files=%d kind=%s linked", model_hash[:12], len(other.manifest.files), kind)
        return bundle

    def ready(self, announcement: messages.RoundAnnouncement, needs_bundle: bool) -> bool:
        """Whether everything the announced round needs has arrived."""
        if announcement.model_hash not in self.models:
            return False
        if needs_bundle and self.bundle_of("bundle", announcement.model_hash) is None:
            return False
        return not announcement.recipe.encoder or announcement.recipe.encoder in self.encoders

    def newest_model(self) -> tuple[str, ModelSpec, Weights] | None:
        """The global model held now: its hash, its spec and its weights (None before the first)."""
        return next(((key, self.specs[key], weights) for key, weights in self.models.items()), None)
