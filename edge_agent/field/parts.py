# A field device's parts: the folder pool, the folder oracle, the label page, and the work between rounds.
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from edge_agent.data.device_data import DeviceData
from edge_agent.data.image_files import InputSpec
from edge_agent.data.predictions_log import PREDICTIONS_FOLDER, PredictionLog
from edge_agent.field.central import CentralLabelling
from edge_agent.field.field_options import FieldSettings
from edge_agent.field.folder_oracle import FolderOracle, QueryBook
from edge_agent.field.folder_pool import folder_pool_of, open_folder_data
from edge_agent.field.label_ui import LabelServer, parse_listen_address
from edge_agent.field.predicting import Known, PoolPredictions
from edge_agent.field.stream import BudgetSettings, BudgetState, decide, default_burst, start_state
from edge_agent.learning.head_learner import device_prefix
from edge_agent.learning.heuristics import Heuristic
from edge_agent.learning.learner import Learner
from edge_agent.learning.learner_choice import make_learner
from edge_agent.learning.predict import ServingModel, guesses_of
from edge_agent.learning.sampling import make_sampler
from edge_agent.loop.agent import LatestModel
from edge_agent.loop.agent_settings import AgentSettings
from edge_agent.loop.profile import DEFAULT_PREDICTIONS_LOG_MB, DeviceProfile
from edge_agent.loop.round_inputs import RoundModels, mc_probabilities
from protocol import messages
from protocol.label_signing import labelling_key
from protocol.prediction_messages import PredictionBatch
from protocol.supervision import Health
from protocol.tensors import Weights

log = logging.getLogger(__name__)

DEFAULT_POOL_CAP = 20000
STREAM_STATE_KEY = "stream"
STREAM_PASSES = 10


class StreamAcquirer:
    """Scores each new pool item once (the recipe's sampler over the newest global model, through the agent's
    configured back end) and asks for it within the budget.

    The bucket, recent scores and how far the pool has been scored persist in the agent's journal before the
    queries are written, so a crash can only under-spend the budget, never exceed it. A sampler that needs more
    than MC-dropout probabilities of the new items (KSAS, FAST) cannot score a stream: it is refused in one line.
    """

    def __init__(
        self, data: DeviceData, oracle: FolderOracle, budget: BudgetSettings, settings: AgentSettings, passes: int
    ) -> None:
        self.data = data
        self.oracle = oracle
        self.budget = budget
        self.settings = settings
        self.passes = passes
        self._learner: tuple[Weights, Learner] | None = None
        self._refused: set[str] = set()

    def score_new(self, latest: LatestModel, round_id: int) -> None:
        """Scores the items that arrived since the last call and asks for those the controller picks."""
        saved = self.data.get_state(STREAM_STATE_KEY) or {}
        first, end = int(saved.get("scored_upto", 0)), self.data.num_samples
        sampler = make_sampler(latest.recipe.sampler)
        if not isinstance(sampler, Heuristic):
            self.refuse(sampler.name)
            return
        if first >= end:
            return
        new = np.arange(first, end)
        scores, probabilities = self.scores(sampler, latest, new, seed=first)
        now = time.time()
        state = BudgetState.from_json(saved["budget"]) if "budget" in saved else start_state(self.budget, now)
        asked = []
        for index, score in zip(new.tolist(), scores.tolist()):
            query, state = decide(state, score, now, self.budget)
            if query:
                asked.append(index)
        self.data.set_state(STREAM_STATE_KEY, {"scored_upto": end, "budget": state.to_json()})
        self.oracle.start_round(round_id)
        chosen = np.isin(new, asked)
        if self.oracle.wants_guesses() and probabilities is not None and chosen.any():
            self.oracle.note_guesses(new[chosen], guesses_of(probabilities[:, chosen], scores[chosen]))
        self.oracle.ask(np.array(asked, dtype=np.int64))
        log.info(
            "stream scored sampler=%s new=%d asked=%d tokens=%.2f max_score=%.3f",
            *(sampler.name, len(new), len(asked), state.tokens, float(scores.max())),
        )

    def refuse(self, sampler: str) -> None:
        """Logs once per sampler that it cannot score a stream (it needs more than MC-dropout probabilities)."""
        if sampler not in self._refused:
            self._refused.add(sampler)
            log.error(
                "stream acquisition refused sampler=%s reason=it needs more than MC-dropout probabilities", sampler
            )

    def scores(
        self, sampler: Heuristic, latest: LatestModel, new: np.ndarray, seed: int
    ) -> tuple[np.ndarray, np.ndarray | None]:
        """The sampler's scores of the new items under the newest global model, on the agent's back end, and the
        MC-dropout probabilities they came from (None for a sampler that needs none)."""
        if self._learner is None or self._learner[0] is not latest.weights:
            learner = make_learner(
                self.settings.compute, self.data.state_dir, latest.spec, latest.weights, latest.bundle
            )
            self._learner = (latest.weights, learner)
        models = RoundModels(self._learner[1], "", latest.recipe, latest.bundle)
        samples = self.data.samples(new)
        probabilities = (
            mc_probabilities(self.settings, models, samples, self.passes, seed) if sampler.needs_probabilities else None
        )
        return sampler.scores(probabilities, len(new), np.random.default_rng(seed)), probabilities


class PoolFeatures:
    """A head-only device's feature cache kept level with its pool: the frozen backbone's features of the images
    that entered the pool since the last look are computed between rounds, once per image, so a round scores and
    trains from cached rows alone. The prefix session opens only while there is something to compute."""

    def __init__(self, settings: AgentSettings, data: DeviceData) -> None:
        self.settings = settings
        self.data = data
        self.seen = 0  # the store's sample count already taken in

    def take_in(self, latest: LatestModel) -> None:
        """Caches the features of the pool's images not looked at yet, under the newest model's bundle (only when
        the bundle is that model's: its prefix is what the cache's key names)."""
        bundle = latest.bundle
        if bundle is None or bundle.manifest.weights_hash != latest.model_hash or self.data.num_samples == self.seen:
            return
        prefix = device_prefix(self.settings.compute, self.data.state_dir, latest.weights, bundle)
        if prefix is not None:
            pool = self.data.pool_indices()
            prefix.fill(self.data.samples(pool[pool >= self.seen]))
        self.seen = self.data.num_samples


class FieldWork:
    """Rescans the pool folder every scan_interval seconds, computes the features of what arrived (a head-only
    device with a frozen backbone), with a stream scores it, with the central queue sends its queries and applies its
    answers (without it, applies the corrections given on the device's own page or in labels.csv to the labelled
    store, so a round's training uses them before its next acquisition), and predicts it with the serving model."""

    def __init__(
        self,
        data: DeviceData,
        scan_interval: float,
        stream: StreamAcquirer | None = None,
        features: PoolFeatures | None = None,
        central: CentralLabelling | None = None,
        predictions: PoolPredictions | None = None,
        health: Health | None = None,
        oracle: FolderOracle | None = None,
    ) -> None:
        self.data = data
        self.oracle = oracle
        self.health = health or Health()
        self.scan_interval = scan_interval
        self.stream = stream
        self.features = features
        self.central = central
        self.predictions = predictions
        self._next_scan = 0.0

    def tick(self, latest: LatestModel | None, round_id: int, serving: ServingModel | None) -> PredictionBatch | None:
        """Scans the folder when the interval has passed; once a global model has arrived, takes the new items'
        features into the cache and scores them; then predicts the next images not predicted under the serving
        model yet (the recipe's MC-dropout passes), from the rows just cached, and returns them (None: none was)."""
        if time.monotonic() < self._next_scan:
            return None
        self._next_scan = time.monotonic() + self.scan_interval
        known = Known(latest.weights, latest.bundle) if latest is not None and latest.bundle is not None else None
        if self.predictions is not None and serving is not None:
            self.predictions.scorer(serving, known)  # opened before the scan's backbone pass, not above its memory
        self.data.refresh()
        if latest is not None and self.features is not None:
            self.features.take_in(latest)
        if self.stream is not None and latest is not None:
            self.stream.score_new(latest, round_id)
        if self.central is not None:
            self.central.tick()
        elif self.oracle is not None:
            self.oracle.correct()
        if self.predictions is None:
            return None
        passes = latest.recipe.mc_passes if latest is not None else messages.Recipe().mc_passes
        return self.predictions.tick(serving, passes, known)


@dataclass
class FieldParts:
    """What a field agent runs with: its data, oracle, between-round work, (optional) label page and (optional)
    link to the fleet's labelling queue."""

    data: DeviceData
    oracle: FolderOracle
    work: FieldWork
    label_server: LabelServer | None
    central: CentralLabelling | None = None


def open_field(
    field: FieldSettings, state_dir: Path, settings: AgentSettings, profile: DeviceProfile | None
) -> FieldParts:
    """Opens the folder pool and the folder oracle of a field device; starts the label page if asked."""
    pool_cap = profile.pool_size_cap if profile else DEFAULT_POOL_CAP
    oracle_dir = field.oracle_dir or state_dir / "labelling"
    listen = parse_listen_address(field.label_ui) if field.label_ui else None
    spec = field.spec()
    images = InputSpec(spec.channels, spec.height, spec.width)
    data = open_folder_data(
        state_dir, field.pool_dir, pool_cap, images, field.settle_seconds, (oracle_dir,), spec.num_classes
    )
    book = QueryBook(oracle_dir, tuple(spec.class_names))
    oracle = FolderOracle(book, data, field.answer_wait)
    stream = None
    if field.stream:
        budget = BudgetSettings(field.labels_per_hour, field.label_burst or default_burst(field.labels_per_hour))
        stream = StreamAcquirer(data, oracle, budget, settings, STREAM_PASSES)
    health = Health()  # the device's supervised parts (its page, its labelling link), which its status reports
    server = LabelServer(book, *listen, health=health).start() if listen else None
    features = PoolFeatures(settings, data) if settings.trainer == "head" else None
    central = None
    if field.labelling == "central":
        key = labelling_key(settings.signing_key) if settings.signing_key else None
        central = CentralLabelling(
            settings.fleet, settings.device_id, oracle, field.query_image_side, health=health, key=key
        )
    log_mb = profile.predictions_log_mb if profile else DEFAULT_PREDICTIONS_LOG_MB
    predictions_log = PredictionLog(state_dir / PREDICTIONS_FOLDER, log_mb << 20)
    predictions = PoolPredictions(
        data, folder_pool_of(data), settings, predictions_log, tuple(spec.class_names), field.repredict
    )
    work = FieldWork(data, field.scan_interval, stream, features, central, predictions, health, oracle)
    return FieldParts(data, oracle, work, server, central)
