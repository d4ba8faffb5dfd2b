# Secure aggregation's refusals (a share, key or request an honest party will not take) and the abandoned round.
from __future__ import annotations

from protocol.errors import FalError, RefusalError
from protocol.messages import RejectionKind


class SecAggRefusal(RefusalError):
    """A secure-aggregation message refused by the side that received it: its kind and a reason built from bounded
    parts (identifiers and counts, never a sender's raw bytes)."""

    def __init__(self, kind: RejectionKind, reason: str) -> None:
        self.kind = kind
        self.reason = reason[:300]
        super().__init__(self.reason)


class SecAggAbandoned(FalError):
    """A round that cannot be unmasked without revealing more than the sum (too few survivors, too few shares): the
    coordinator drops it and reveals nothing."""
