# The device's serving version: the bundle it predicts with ("serving"), kept apart from the model it trains ("latest").
from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass

from edge_agent.learning.bundle import Bundle, load_bundle
from edge_agent.loop.artefacts import RoundArtefacts
from protocol import topics, wire
from protocol.backbone import SHA256_HEX
from protocol.files import atomic_write_bytes
from protocol.mqtt import IncomingMessage
from protocol.serving_messages import ServingMessage

log = logging.getLogger(__name__)

STATE_FILE = "serving.json"  # in the serving folder: which version its bundle is, so a restart serves at once


@dataclass(frozen=True)
class ServingVersion:
    """The version a device predicts with: the round whose model serves (`version`, 0 for W0), that model's hash,
    its verified bundle (a torch device reads the weights from it: `bundle_weights`), and whether the fleet asks
    devices to publish their predictions."""

    version: int
    model_hash: str
    bundle: Bundle
    publish_predictions: bool = False


Listener = Callable[[ServingVersion], None]


def stored_version(artefacts: RoundArtefacts) -> ServingVersion | None:
    """The serving version a previous process kept in the serving folder, its bundle verified again (None: none
    kept, or what was kept no longer verifies: a warning, and the retained serving message brings it again)."""
    path = artefacts.serving_dir / STATE_FILE
    if not path.is_file():
        return None
    try:
        kept = json.loads(path.read_bytes())
        version, model_hash = int(kept["version"]), str(kept["model_hash"])
        if not SHA256_HEX.fullmatch(model_hash):
            raise ValueError(f"model_hash {wire.shown(model_hash)} is not a sha256")
        bundle = load_bundle(artefacts.serving_dir / model_hash)
    except (OSError, ValueError, KeyError, TypeError) as error:
        log.warning("kept serving version unusable path=%s error=%s", path, wire.shown(str(error)))
        return None
    artefacts.serving_bundles = {model_hash: bundle}
    return ServingVersion(version, model_hash, bundle, bool(kept.get("publish_predictions", False)))


class ServingSlot:
    """Follows the fleet's retained serving message and holds the version it names once its bundle is stored and
    verified in the state folder's serving folder (linked from the latest bundle when that is the same model, else
    fetched from the bundle's retained topic, backbone included); kept across restarts. The device's parts read
    `current()` and hear each change through `on_change`. It needs no round: a device that only predicts follows
    serving alone."""

    def __init__(self, fleet: str, artefacts: RoundArtefacts) -> None:
        self.fleet = fleet
        self.artefacts = artefacts
        self.listeners: list[Listener] = []
        self.wanted: ServingMessage | None = None
        self._current = stored_version(artefacts)

    def current(self) -> ServingVersion | None:
        """The version the device predicts with now (None before the first arrived)."""
        return self._current

    def on_change(self, listener: Listener) -> None:
        """Calls `listener` with each new serving version from now on."""
        self.listeners.append(listener)

    def handle(self, message: IncomingMessage) -> bool:
        """The serving topic's route: decodes the message (WireError if malformed) and takes it in; never ends the
        run."""
        self.on_message(wire.decode(message.payload, ServingMessage))
        return False

    def on_message(self, message: ServingMessage) -> None:
        """Wants the version a serving message names: at once if its bundle is held, else once it is fetched (a
        message whose hash is no sha256 is logged and ignored)."""
        if not SHA256_HEX.fullmatch(message.model_hash):
            log.warning("ignored serving message model=%s: not a sha256", wire.shown(message.model_hash))
            return
        current = self._current
        if current is not None and (current.version, current.model_hash, current.publish_predictions) == (
            message.version,
            message.model_hash,
            message.publish_predictions,
        ):
            return
        self.wanted = message
        if self.artefacts.bundle_of("serving", message.model_hash) is None:
            self.artefacts.follow("serving", topics.BUNDLE.build(fleet=self.fleet, hash=message.model_hash))
        self.settle()

    def settle(self) -> None:
        """Serves the wanted version once its bundle is held (fetched, or the latest model's of the same hash): kept
        on disk, then every listener told."""
        wanted = self.wanted
        bundle = None if wanted is None else self.artefacts.bundle_of("serving", wanted.model_hash)
        if wanted is None or bundle is None:
            return
        version = ServingVersion(wanted.version, wanted.model_hash, bundle, wanted.publish_predictions)
        kept = {
            "version": version.version,
            "model_hash": version.model_hash,
            "publish_predictions": version.publish_predictions,
        }
        try:
            atomic_write_bytes(self.artefacts.serving_dir / STATE_FILE, json.dumps(kept).encode())
        except OSError as error:  # a full or read-only card costs serving at once after a restart, not the device
            log.warning("serving version not kept on disk error=%s", wire.shown(str(error), 200))
        self._current, self.wanted = version, None
        log.info("serving version=%d model=%s", version.version, version.model_hash[:12])
        for listener in self.listeners:
            listener(version)
