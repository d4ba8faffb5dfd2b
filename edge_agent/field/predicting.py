# A field device's predictions: each image that joins its pool, once per serving version, into the log (no torch).
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np

from edge_agent.data.device_data import DeviceData, Samples
from edge_agent.data.predictions_log import PredictionLog
from edge_agent.field.folder_pool import FolderPool
from edge_agent.learning.bundle import Bundle, bundle_weights
from edge_agent.learning.cached_prefix import CachedPrefix, prefix_frozen
from edge_agent.learning.head_learner import device_prefix
from edge_agent.learning.learner import bundle_scorer
from edge_agent.learning.ort_scorer import OrtMCDropout
from edge_agent.learning.predict import ServingModel, verdicts
from edge_agent.learning.prior_shift import LABEL_SHARES_KEY, prior_weights, reweighted
from edge_agent.loop.agent_settings import AgentSettings
from protocol.prediction_messages import PredictionBatch
from protocol.tensors import Weights

log = logging.getLogger(__name__)

LEDGER_KEY = "predictions"
PER_TICK = 256  # images predicted per folder scan: the agent answers its messages between scans


@dataclass(frozen=True)
class Known:
    """A model the device already holds in memory, with its bundle (the latest)."""

    weights: Weights
    bundle: Bundle


def prefix_weights(bundle: Bundle, known: Known | None) -> Weights:
    """Weights holding the bundle's prefix, which its feature cache's key hashes: those of a model held already when
    its bundle's fp32 prefix graph is this one's (same sha256: a frozen backbone's always is), else the bundle's own,
    read from its files (13.5 MB for EfficientNet-Lite0, once per serving model)."""
    if known is not None and graph_sha256(known.bundle) == graph_sha256(bundle):
        return known.weights
    return bundle_weights(bundle)


def graph_sha256(bundle: Bundle) -> str:
    """The sha256 of the bundle's fp32 prefix graph, as its manifest lists it."""
    return bundle.manifest.files[bundle.manifest.graphs["fp32"]["prefix"]]


@dataclass(frozen=True)
class Ledger:
    """How far the pool is predicted: every image below index `upto` has its prediction under serving `version`
    (or under an earlier one, when a new version did not ask to re-predict). Kept in the agent's journal."""

    version: int
    model_hash: str
    upto: int

    def to_json(self) -> dict[str, object]:
        """The ledger as the journal keeps it."""
        return {"version": self.version, "model_hash": self.model_hash, "upto": self.upto}


@dataclass
class ServingScorer:
    """One serving model's scorer (the tail's session) and, for a frozen prefix, the feature cache it reads."""

    model_hash: str
    scorer: OrtMCDropout
    prefix: CachedPrefix | None


class PoolPredictions:
    """Predicts each image of a field device's pool once per serving version: class, probability and MC-dropout
    uncertainty, with the version, hash, file and content hash, appended to the predictions log. A frozen prefix's
    rows come from the feature cache (the scan fills it first), so a prediction costs the tail's passes alone.

    The journal's ledger moves after the log is written; on opening, the log's newest line moves it on past
    what a killed process had logged but not noted, so a restart neither predicts an image twice nor misses one. A
    new serving version predicts only images not predicted yet, or every image the device holds with `repredict`.
    """

    def __init__(
        self,
        data: DeviceData,
        pool: FolderPool,
        settings: AgentSettings,
        log_file: PredictionLog,
        class_names: tuple[str, ...],
        repredict: bool = False,
    ) -> None:
        self.data, self.pool, self.settings = data, pool, settings
        self.log, self.class_names, self.repredict = log_file, class_names, repredict
        self._scorer: ServingScorer | None = None
        self._recovered = False
        self._noted: Ledger | None = None  # the ledger as this process last noted it (the journal may not have it)
        self._unnoted = False  # the journal could not be written at the last note

    def ledger(self) -> Ledger | None:
        """The ledger as last noted, else the journal's (None before the first serving version)."""
        if self._noted is not None:
            return self._noted
        saved = self.data.get_state(LEDGER_KEY)
        return None if saved is None else Ledger(int(saved["version"]), str(saved["model_hash"]), int(saved["upto"]))

    def note(self, ledger: Ledger) -> None:
        """Adopts the ledger and writes it to the journal; a journal that cannot be written (a full disk) is one
        warning: the process goes on from the ledger it holds, and a restart may predict those images again."""
        self._noted = ledger
        try:
            self.data.set_state(LEDGER_KEY, ledger.to_json())
        except OSError as error:
            if not self._unnoted:
                log.warning("predictions ledger not kept error=%s: a restart may predict some images again", error)
            self._unnoted = True
            return
        self._unnoted = False

    def tick(self, serving: ServingModel | None, passes: int, known: Known | None = None) -> PredictionBatch | None:
        """Predicts up to PER_TICK images not yet predicted under `serving` (None: nothing serves yet) with `passes`
        MC-dropout passes (within the profile's cap); returns them as one batch (None when nothing was predicted).
        `known`: a model the device holds with its bundle (the latest), whose weights stand in for the serving
        bundle's when both bundles have one prefix graph."""
        if serving is None:
            return None
        passes = min(passes, self.settings.mc_passes_cap or passes)
        ledger = self.current_ledger(serving)
        end = min(self.data.num_samples, ledger.upto + PER_TICK)
        if ledger.upto >= end:
            return None
        indices = np.arange(ledger.upto, end)
        batch = self.predict(serving, self.data.samples(indices), passes, known)
        self.log.append([{**row, "index": int(index)} for row, index in zip(batch.rows(), indices.tolist())])
        self.note(Ledger(serving.version, serving.model_hash, end))
        return batch

    def current_ledger(self, serving: ServingModel) -> Ledger:
        """The ledger for this serving model: the journal's, moved past what the log already holds (once per
        process), or a new version's, from 0 with `repredict`, else where the last version stopped."""
        ledger = self.ledger()
        if ledger is not None and not self._recovered:
            ledger = self.recover(ledger)
        self._recovered = True
        if ledger is not None and (ledger.version, ledger.model_hash) == (serving.version, serving.model_hash):
            return ledger
        start = 0 if self.repredict or ledger is None else ledger.upto
        fresh = Ledger(serving.version, serving.model_hash, start)
        self.note(fresh)
        log.info(
            "serving version predicts version=%d model=%s from_index=%d", fresh.version, fresh.model_hash[:12], start
        )
        return fresh

    def recover(self, ledger: Ledger) -> Ledger:
        """The ledger moved past the log's newest line when that line is of the ledger's model and beyond it (the
        process died between writing the log and noting it)."""
        last = self.log.last()
        if last is None or last.get("model_hash") != ledger.model_hash or not isinstance(last.get("index"), int):
            return ledger
        upto = max(ledger.upto, int(last["index"]) + 1)
        if upto != ledger.upto:
            ledger = Ledger(ledger.version, ledger.model_hash, upto)
            self.note(ledger)
        return ledger

    def predict(
        self, serving: ServingModel, samples: Samples, passes: int, known: Known | None = None
    ) -> PredictionBatch:
        """The serving model's predictions of these samples (MC dropout, `passes` passes over the tail), each pass's
        posteriors adapted to the device's class mix (class_weights)."""
        scoring = self.scorer(serving, known)
        seed = serving.version
        if scoring.prefix is None:
            probabilities = scoring.scorer.probabilities(samples.images(), passes, seed)
        else:
            probabilities = scoring.scorer.feature_probabilities(scoring.prefix.rows(samples), passes, seed)
            scoring.prefix.close()  # rows the scan had not cached opened it: a round's own prefix must not meet it
        found = verdicts(reweighted(probabilities, self.class_weights()))
        classes = found.classes.tolist()
        now = time.time()
        return PredictionBatch(
            device_id=self.settings.device_id,
            serving_version=serving.version,
            model_hash=serving.model_hash,
            files=[self.pool.item(index).path for index in samples.indices.tolist()],
            content_hashes=[digest.tobytes().hex() for digest in samples.digests()],
            class_indices=classes,
            class_names=[self.class_name(index) for index in classes],
            probabilities=[round(value, 6) for value in found.probabilities.tolist()],
            uncertainties=[round(value, 6) for value in found.uncertainties.tolist()],
            times=[round(now, 3)] * len(classes),
        )

    def class_weights(self) -> np.ndarray:
        """The weights the serving head's posteriors are multiplied by for this device's class mix: its human labels
        against the fleet's label shares of the last announcement (all ones where they do not differ, or no shares
        came yet)."""
        return prior_weights(self.data.class_counts(), np.asarray(self.data.get_state(LABEL_SHARES_KEY, [])))

    def class_name(self, index: int) -> str:
        """The spec's name of a class index (its number where the spec names fewer classes)."""
        return self.class_names[index] if index < len(self.class_names) else str(index)

    def scorer(self, serving: ServingModel, known: Known | None = None) -> ServingScorer:
        """The serving model's scorer, opened once per model (with the feature cache when its prefix is frozen)."""
        if self._scorer is None or self._scorer.model_hash != serving.model_hash:
            bundle = serving.bundle
            compute, state_dir = self.settings.compute, self.data.state_dir
            scorer = bundle_scorer(compute, bundle, None)
            frozen = prefix_frozen(bundle)
            prefix = device_prefix(compute, state_dir, prefix_weights(bundle, known), bundle) if frozen else None
            self._scorer = ServingScorer(serving.model_hash, scorer, prefix)
        return self._scorer
