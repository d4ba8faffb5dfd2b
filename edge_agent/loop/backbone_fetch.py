# A model or bundle that references frozen backbone graphs: completed from the store, or held while they are fetched.
from __future__ import annotations

import logging
from pathlib import Path

from edge_agent.learning.bundle import MANIFEST_NAME, parsed_manifest
from edge_agent.loop.backbone_store import BackboneStore
from protocol import messages, topics
from protocol.mqtt import MqttSession
from protocol.tensors import Weights

log = logging.getLogger(__name__)

Referencing = messages.ModelMessage | messages.BundleMessage


class BackboneFetch:
    """Completes models and bundles from the backbone store. What references a graph the store lacks (a first
    round, a late join, a corrupt copy) waits, one message per kind, while the graph's retained topic is followed;
    `arrived` stores a graph and hands back what waited, to be taken in again."""

    def __init__(self, session: MqttSession, fleet: str, store: BackboneStore) -> None:
        self.session = session
        self.fleet = fleet
        self.store = store
        self.waiting: dict[str, tuple[Referencing, set[str]]] = {}
        self.in_use: dict[str, set[str]] = {}
        self.topics: set[str] = set()

    def model(self, message: messages.ModelMessage, kind: str = "model") -> Weights | None:
        """The whole model: the message's tensors and those its backbone holds (None: waiting, as `kind`, for the
        backbone)."""
        if not message.backbone:
            return message.tensors
        frozen = self.store.weights(message.backbone)
        if frozen is None:
            self.wait(kind, message, {message.backbone})
            return None
        self.in_use[kind] = {message.backbone}
        return {**frozen, **message.tensors}

    def bundle(
        self, message: messages.BundleMessage, kind: str = "bundle"
    ) -> tuple[dict[str, bytes], dict[str, Path]] | None:
        """The bundle's files as received and, by file name, the stored backbone graphs it names (verified against
        the sha256 its manifest lists; None: waiting, as `kind`, for those the store lacks; BundleError for a
        manifest that does not parse). The graphs stay on disk: a bundle links them rather than reading megabytes
        into memory."""
        if not message.backbone:
            return message.files, {}
        manifest = parsed_manifest(message.files.get(MANIFEST_NAME, b""), f"bundle {message.model_hash[:12]}")
        digests = {name: manifest.files.get(name, "") for name in message.backbone}
        graphs = {name: self.store.verified_path(digest) for name, digest in digests.items()}
        missing = {digests[name] for name, path in graphs.items() if path is None}
        if missing:
            self.wait(kind, message, missing)
            return None
        self.in_use[kind] = set(digests.values())
        return message.files, {name: path for name, path in graphs.items() if path is not None}

    def wait(self, kind: str, message: Referencing, digests: set[str]) -> None:
        """Keeps a model or bundle until the backbone graphs it lacks arrive, following their topics."""
        self.waiting[kind] = (message, digests)
        self.follow_wanted()

    def drop(self, kind: str) -> None:
        """Forgets what of a kind waited (its topic is no longer followed)."""
        if self.waiting.pop(kind, None) is not None:
            self.follow_wanted()

    def wanted(self) -> set[str]:
        """The sha256 of every graph something waits for."""
        return {digest for _, digests in self.waiting.values() for digest in digests}

    def follow_wanted(self) -> None:
        """Follows exactly the backbone topics of what waits, leaving those no longer needed."""
        wanted = {topics.BACKBONE.build(fleet=self.fleet, hash=digest) for digest in self.wanted()}
        for topic in sorted(self.topics - wanted):
            self.session.unsubscribe(topic)
        for topic in sorted(wanted - self.topics):
            log.info("fetching backbone topic=%s", topic)
            self.session.subscribe(topic)
        self.topics = wanted

    def arrived(self, message: messages.BackboneMessage) -> list[tuple[str, Referencing]]:
        """Stores a wanted graph that hashes to its name and returns what waited (with the kind it waited as), no
        longer waiting: taken in again, what still lacks a graph waits anew, and `settle` then follows and keeps
        only what is wanted."""
        if message.backbone_hash not in self.wanted() or not self.store.keep(message.backbone_hash, message.data):
            return []
        waited = [(kind, referencing) for kind, (referencing, _) in self.waiting.items()]
        self.waiting = {}
        return waited

    def settle(self) -> None:
        """Follows the topics of what still waits and deletes stored graphs neither in use nor wanted (an earlier
        run's backbone)."""
        self.follow_wanted()
        in_use = {digest for digests in self.in_use.values() for digest in digests}
        self.store.keep_only(in_use | self.wanted())
