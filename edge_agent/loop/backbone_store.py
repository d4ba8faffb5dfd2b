# The frozen backbone graphs a device keeps in its state folder, by sha256: checked on every read, never trusted.
from __future__ import annotations

import hashlib
import logging
from pathlib import Path

from edge_agent.learning.bundle import file_sha256
from edge_agent.learning.onnx_initializers import OnnxGraphError, graph_weights
from protocol.backbone import checked_digest
from protocol.files import atomic_write_bytes
from protocol.tensors import Weights

log = logging.getLogger(__name__)

BACKBONE_FOLDER = "backbone"
SUFFIX = ".onnx"


class BackboneStore:
    """Backbone graphs as files named by their sha256. A copy that no longer hashes to its name (a torn write, a
    bad card) is deleted when read, so the device fetches it again; the weights of the last graph read are kept."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self._weights: dict[str, Weights] = {}

    def path(self, digest: str) -> Path:
        """Where the graph of this sha256 is kept (WireError for a name that is not a sha256)."""
        return self.folder / f"{checked_digest('backbone', digest)}{SUFFIX}"

    def keep(self, digest: str, data: bytes) -> bool:
        """Stores a received graph if it hashes to its name; False (and a warning) if it does not."""
        actual = hashlib.sha256(data).hexdigest()
        if actual != digest:
            log.warning("backbone hash mismatch announced=%s actual=%s", digest[:12], actual[:12])
            return False
        self.folder.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(self.path(digest), data)
        log.info("backbone stored hash=%s bytes=%d", digest[:12], len(data))
        return True

    def verified_path(self, digest: str) -> Path | None:
        """The stored graph's file once its bytes (hashed in chunks, never held whole) match its name; None if
        missing or corrupt (then deleted)."""
        path = self.path(digest)
        try:
            actual = file_sha256(path)
        except FileNotFoundError:
            return None
        if actual != digest:
            log.warning("stored backbone corrupt hash=%s; fetching it again", digest[:12])
            path.unlink(missing_ok=True)
            return None
        return path

    def weights(self, digest: str) -> Weights | None:
        """The model weights the stored fp32 graph holds (None: not held, or unreadable and deleted)."""
        if digest not in self._weights:
            path = self.verified_path(digest)
            if path is None:
                return None
            try:
                self._weights = {digest: graph_weights(path.read_bytes())}
            except OnnxGraphError as error:
                log.warning("backbone unreadable hash=%s error=%s", digest[:12], error)
                self.path(digest).unlink(missing_ok=True)
                return None
        return self._weights[digest]

    def keep_only(self, digests: set[str]) -> None:
        """Deletes the stored graphs not named (an earlier run's backbone), so the folder holds what is in use."""
        for path in self.folder.glob(f"*{SUFFIX}"):
            if path.name.removesuffix(SUFFIX) not in digests:
                path.unlink(missing_ok=True)
