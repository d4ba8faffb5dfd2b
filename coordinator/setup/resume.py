# Where a run starts: a fresh W0 and run id, or the round after the last one a previous process committed.
from __future__ import annotations

import logging
import time
import uuid

from coordinator.setup.server_data import ServerData, initial_weights
from coordinator.setup.settings import ServerSettings, settings_as_dict
from coordinator.storage.store import RunStore, stored_spec
from protocol.errors import UsageError
from protocol.model_spec import ModelSpec, spec_hash
from protocol.tensors import Weights

log = logging.getLogger(__name__)


def starting_point(store: RunStore, settings: ServerSettings, data: ServerData) -> tuple[Weights, int, str]:
    """(global weights, first round to run, run id): a fresh W0, or where a previous process left the run."""
    config = store.config()
    check_same_spec(config, settings.spec)
    last = store.last_committed_round()
    if config is not None and last is not None:
        log.info("resuming run=%s after round=%d", config["run_id"], last)
        return store.checkpoints.load(last), last + 1, config["run_id"]
    run_id = config["run_id"] if config else f"{settings.fleet}-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"
    if store.checkpoints.latest_round() == 0:
        weights = store.checkpoints.load(0)
    else:
        weights = initial_weights(settings, data)
        store.checkpoints.save(0, weights)
    store.set_config({"run_id": run_id, "settings": settings_as_dict(settings)})
    return weights, 1, run_id


def check_same_spec(config: dict | None, spec: ModelSpec) -> None:
    """A run resumes only with the model spec it started with (its checkpoints have that model's shapes)."""
    if config is None:
        return
    stored = stored_spec(config)
    if spec_hash(stored) != spec_hash(spec):
        raise UsageError(
            f"the run directory was started with model spec {spec_hash(stored)[:12]} ({stored.architecture}), "
            f"not {spec_hash(spec)[:12]} ({spec.architecture}); use a new --run-dir or the same --model-spec"
        )
