# Acquisition on a device: score the pool with the round's sampler, ask the oracle, keep every answer durably.
from __future__ import annotations

import logging
from functools import cache

import numpy as np

from edge_agent.data.device_data import DeviceData
from edge_agent.data.oracle import Guess, Oracle
from edge_agent.learning.encoder import OnnxEncoder
from edge_agent.learning.heuristics import AcquisitionContext, Embeddings, Heuristic, Sampler
from edge_agent.learning.learner import Learner
from edge_agent.learning.predict import guesses_of, verdicts
from edge_agent.loop.agent_settings import AgentSettings, device_seed
from edge_agent.loop.drift_watch import DriftWatch, FocusRule
from edge_agent.loop.footprint import PhaseMeter
from edge_agent.loop.round_inputs import RoundModels, mc_probabilities
from edge_agent.loop.schedule import initial_label_count, labels_per_acquisition
from protocol import messages

log = logging.getLogger(__name__)

ROUND_BATCHES_KEY = "round_batches"
INITIAL_LABELS_KEY = "initial_labels_taken"


class Acquirer:
    """Picks what a person labels and stores the answers; the queried batch is journaled before the oracle is
    asked, so a device killed mid-round asks no label twice."""

    def __init__(self, settings: AgentSettings, data: DeviceData, oracle: Oracle, meter: PhaseMeter) -> None:
        self.settings = settings
        self.data = data
        self.oracle = oracle
        self.meter = meter
        self.drift = DriftWatch(data, settings.device_id)

    @property
    def own_samples(self) -> int:
        """The device's own data |D_i|: every sample but the seeds the server handed it."""
        return self.data.num_samples - self.data.count_labels("seed")

    def take_initial_labels(self, recipe: messages.Recipe) -> None:
        """Once per device: labels a random initial_label_fraction of its own data (KAFAL's 10% start)."""
        count = initial_label_count(recipe, self.own_samples)
        if count == 0 or self.data.get_state(INITIAL_LABELS_KEY, False):
            return
        pool = self.data.pool_indices()
        rng = np.random.default_rng([recipe.seed, device_seed(self.settings.device_id)])
        with self.meter.phase("label"):
            answered, labels = self.oracle.label(np.sort(rng.choice(pool, size=min(count, len(pool)), replace=False)))
            self.data.add_labels(answered, labels)
        self.data.set_state(INITIAL_LABELS_KEY, True)
        log.info("initial labels device=%s labels=%d", self.settings.device_id, len(answered))

    def acquire(
        self, models: RoundModels, sampler: Sampler, seed: int, round_id: int, acquisition: int
    ) -> tuple[np.ndarray, np.ndarray]:
        """Scores the pool, asks the oracle for the top b, stores the answers (and the sampler's weak labels for
        the rest); returns the new human labels (indices, labels).

        Pending queries (a person has not answered yet) are not asked again; the oracle may return their answers
        with any later acquisition. When streaming, the stream has asked already: only answers are collected.
        """
        queried = self.queried_batch(round_id, acquisition)
        weak: tuple[np.ndarray, np.ndarray] | None = None
        if queried is None:
            pool = np.setdiff1d(self.data.pool_indices(), self.oracle.pending())
            queried = pool[:0]
            if len(pool) and not self.settings.stream:
                context = self.context(models, pool, seed)
                budget = labels_per_acquisition(models.recipe, self.own_samples)
                rule = FocusRule(models.recipe.drift_acquisitions, budget)
                with self.meter.phase("score"):  # the watch's scoring of the pool is the phase's too
                    focus = self.drift.focus(pool, lambda: verdicts(context.probabilities()), rule)
                    if focus is not None:
                        pool = pool[focus]
                        context = self.context(models, pool, seed)
                    chosen = sampler.choose(context, budget)
                    queried = pool[chosen]
                    proposed = sampler.weak_labels(context)
                    if self.oracle.wants_guesses() and len(chosen):
                        self.oracle.note_guesses(queried, self.guesses(sampler, context, chosen))
                weak = None if proposed is None else (pool, proposed)
            self.remember_batch(round_id, acquisition, queried)
        with self.meter.phase("label"):
            return self.store_answers(queried, weak)

    def store_answers(
        self, queried: np.ndarray, weak: tuple[np.ndarray, np.ndarray] | None
    ) -> tuple[np.ndarray, np.ndarray]:
        """Asks the oracle for the queried samples not labelled yet, keeps its answers and the weak labels of the
        samples it did not answer; returns (indices, labels) of the batch's human labels."""
        labelled_before = self.data.labels_at(queried) >= 0
        answered, labels = self.oracle.label(queried[~labelled_before])
        self.data.add_labels(answered, labels)
        if weak is not None:
            unanswered = ~np.isin(weak[0], answered)
            self.data.set_weak_labels(weak[0][unanswered], weak[1][unanswered])
        new = np.union1d(queried[labelled_before], answered)
        return new, self.data.labels_at(new)

    def guesses(self, sampler: Sampler, context: AcquisitionContext, chosen: np.ndarray) -> list[Guess]:
        """The model's guesses of the chosen samples, from the round's MC-dropout probabilities (computed once per
        acquisition), with the sampler's scores when it scores each sample."""
        scores = sampler.score_pool(context)[chosen] if isinstance(sampler, Heuristic) else None
        return guesses_of(context.probabilities()[:, chosen], scores)

    def context(self, models: RoundModels, pool: np.ndarray, seed: int) -> AcquisitionContext:
        """What the round's sampler may look at; each expensive view is computed once, on first use (the pool's
        images are read only for a view that needs them)."""
        samples = self.data.samples(pool)
        images = cache(samples.images)
        recipe, learner = models.recipe, models.learner
        return AcquisitionContext(
            num_samples=len(pool),
            rng=np.random.default_rng(seed),
            class_counts=self.data.class_counts(),
            options=recipe.options,
            probabilities=cache(lambda: mc_probabilities(self.settings, models, samples, recipe.mc_passes, seed)),
            own_logits=cache(lambda: learner.logits("own", images())),
            global_logits=cache(lambda: learner.logits("global", images())),
            embeddings=cache(lambda: self.embeddings(models, images())),
            features=cache(lambda: learner.features(samples)),
            labelled_features=cache(lambda: self.labelled_features(learner)),
        )

    def labelled_features(self, learner: Learner) -> np.ndarray:
        """Penultimate features of the human-labelled samples ((0, 0) when there are none): the core-set's centres."""
        indices, _ = self.data.labelled()
        return learner.features(self.data.samples(indices)) if len(indices) else np.zeros((0, 0), dtype=np.float32)

    def embeddings(self, models: RoundModels, pool_images: np.ndarray) -> Embeddings:
        """The round's frozen encoder applied to the pool and to the human-labelled samples (FAST's seeds)."""
        if models.encoder is None:
            raise ValueError(f"sampler {models.recipe.sampler!r} needs the round's encoder, which has not arrived")
        encoder = OnnxEncoder(models.encoder, self.settings.torch_threads)
        indices, labels = self.data.labelled()
        return Embeddings(encoder.embed(pool_images), encoder.embed(self.data.images(indices)), labels)

    def queried_batch(self, round_id: int, acquisition: int) -> np.ndarray | None:
        """The batch this acquisition of this round already queried before the agent was stopped, if any."""
        record = self.data.get_state(ROUND_BATCHES_KEY)
        if not record or record.get("round") != round_id or acquisition >= len(record.get("batches", [])):
            return None
        return np.asarray(record["batches"][acquisition], dtype=np.int64)

    def remember_batch(self, round_id: int, acquisition: int, queried: np.ndarray) -> None:
        """Journals the batch an acquisition is about to query (earlier rounds' batches are dropped)."""
        record = self.data.get_state(ROUND_BATCHES_KEY) or {}
        batches = record.get("batches", [])[:acquisition] if record.get("round") == round_id else []
        self.data.set_state(ROUND_BATCHES_KEY, {"round": round_id, "batches": [*batches, queried.tolist()]})
