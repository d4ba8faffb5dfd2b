# The serving version on the wire: which model devices predict with, apart from the latest round's model they train.
from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from protocol.bounds import INT_RANGE, TIME_RANGE, within


@dataclass(frozen=True)
class ServingMessage:
    """Published retained on the serving topic at each promotion or rollback: the version devices predict with
    ("serving"), as opposed to the latest round's model they train from ("latest"). `version` is the round whose
    model serves (0: the initial model W0); its weights and bundle are the retained model and bundle messages of
    `model_hash`. `publish_predictions` asks devices to publish their predictions on their predictions topic."""

    KIND: ClassVar[str] = "serving"
    run_id: str
    version: int = field(metadata=within(0, INT_RANGE[1]))
    model_hash: str
    promoted_at: float = field(metadata=within(*TIME_RANGE))
    publish_predictions: bool = False
