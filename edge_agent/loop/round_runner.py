# One round on a device: acquire labels as the schedule says, train with the round's local rule, build the update.
from __future__ import annotations

import logging
import math
import os
import time
import uuid
from collections.abc import Callable
from dataclasses import replace

import numpy as np

from edge_agent.data.device_data import DeviceData
from edge_agent.data.oracle import Oracle
from edge_agent.learning.learner_choice import make_learner, round_problem
from edge_agent.learning.local_data import training_view
from edge_agent.learning.lr_schedules import schedule_problem
from edge_agent.learning.sampling import make_sampler
from edge_agent.loop.acquisition import Acquirer
from edge_agent.loop.agent_settings import AgentSettings, device_seed
from edge_agent.loop.artefacts import RoundArtefacts
from edge_agent.loop.footprint import PhaseMeter
from edge_agent.loop.round_inputs import RoundModels
from edge_agent.loop.schedule import acquires_in_round, round_in_active_round
from protocol import messages
from protocol.dp import DP_DEVICE, WITHIN_CLIP_METRIC, DpRound, privatised
from protocol.errors import UsageError
from protocol.model_spec import ModelSpec, spec_hash
from protocol.tensors import Weights
from protocol.trained_set import POOL_STATISTICS, update_base
from protocol.update_codec import ResidualStore, UpdateCodec, encode_update
from protocol.wire import shown_names

log = logging.getLogger(__name__)


def step_seed(recipe: messages.Recipe, device_id: str, round_id: int, step: int) -> int:
    """The seed of one acquisition step: the recipe's seed, the device, the round and the step."""
    return int(np.random.SeedSequence([recipe.seed, device_seed(device_id), round_id, step]).generate_state(1)[0])


def announced_spec_problem(announcement: messages.RoundAnnouncement, spec: ModelSpec) -> str | None:
    """Why the model's spec is not the one the round announced (its hash differs), or None; checked once per round
    rather than on every loop turn while the round waits for its artefacts."""
    actual = spec_hash(spec)
    if announcement.spec_hash and announcement.spec_hash != actual:
        return f"the model's spec hashes to {actual[:12]}, the round announced {announcement.spec_hash[:12]}"
    return None


def spec_problem(spec: ModelSpec, data: DeviceData, oracle: Oracle) -> str | None:
    """Why this device's data cannot feed the spec's model (its image shape, class count, or the class names its
    person answers with differ), or None; the round is then refused and nothing the device holds is touched."""
    if data.image_shape != spec.image_shape:
        return (
            f"the model takes {shape_text(spec.image_shape)} images, this device holds {shape_text(data.image_shape)}"
        )
    if data.num_classes != spec.num_classes:
        return f"the model has {spec.num_classes} classes, this device's labels have {data.num_classes}"
    names = oracle.class_names()
    if names is not None and list(names) != spec.class_names:
        return f"the model's classes are {shown_names(spec.class_names)}, this device's are {shown_names(list(names))}"
    return None


def shape_text(shape: tuple[int, ...]) -> str:
    """An image shape as HxW or HxWxC."""
    return "x".join(str(side) for side in shape)


class RoundRunner:
    """Runs the active-learning work of one announced round and returns the device's update."""

    def __init__(
        self,
        settings: AgentSettings,
        data: DeviceData,
        oracle: Oracle,
        artefacts: RoundArtefacts,
        report: Callable[[str, int], None],
        meter: PhaseMeter,
    ) -> None:
        self.settings = settings
        self.data = data
        self.oracle = oracle
        self.artefacts = artefacts
        self.report = report
        self.meter = meter
        self.acquirer = Acquirer(settings, data, oracle, meter)

    def round_models(
        self, announcement: messages.RoundAnnouncement, spec: ModelSpec, global_weights: Weights
    ) -> RoundModels:
        """The profile's learner over the global weights, and the round's artefacts."""
        bundle = self.artefacts.bundles.get(announcement.model_hash)
        encoder = self.artefacts.encoders.get(announcement.recipe.encoder)
        learner = make_learner(self.settings.compute, self.data.state_dir, spec, global_weights, bundle)
        return RoundModels(learner, announcement.model_hash, announcement.recipe, bundle, encoder)

    def run(
        self, announcement: messages.RoundAnnouncement, spec: ModelSpec, global_weights: Weights
    ) -> messages.Update | None:
        """Acquires (when the schedule says so), labels and trains; returns the update, or None when the device
        is not among the round's participants (it then only acquires, as every device does, and never trains)."""
        announcement = self.within_consent(announcement)
        recipe, round_id = announcement.recipe, announcement.round_id
        participating = not announcement.participants or self.settings.device_id in announcement.participants
        bundle = self.artefacts.bundles.get(announcement.model_hash)
        problem = (
            round_problem(self.settings.compute, recipe, bundle)
            or announced_spec_problem(announcement, spec)
            or spec_problem(spec, self.data, self.oracle)
            or codec_problem(recipe)
            or schedule_problem(recipe.lr_schedule)
        )
        if problem is not None:
            log.error("round refused device=%s round=%d reason=%s", self.settings.device_id, round_id, problem)
            self.report("error", round_id)
            return None
        state = "training" if participating else "acquiring"
        self.report(state, round_id)
        models = self.round_models(announcement, spec, global_weights)
        self.oracle.start_round(round_id)
        self.oracle.notify_wait(lambda waits: self.report(messages.WAITING_FOR_ANSWERS if waits else state, round_id))
        self.acquirer.take_initial_labels(recipe)
        acquisitions = recipe.acquisitions_per_round if acquires_in_round(round_id, recipe) else 0
        metrics: dict[str, float] = {}
        for step in range(max(acquisitions, 1 if participating else 0)):
            done = self.run_step(models, round_id, step, step < acquisitions, participating)
            if done is None:
                break
            metrics = done
        return self.update_of(announcement, spec, models, metrics, global_weights) if participating else None

    def within_consent(self, announcement: messages.RoundAnnouncement) -> messages.RoundAnnouncement:
        """The round as this device does it: a coordinator's ask for the pool's posterior sums (POOL_STATISTICS) is
        dropped, logged, unless this device's operator consented (--share-pool-statistics): its update then carries
        them as zeros, as when nobody asked (they reveal the unlabelled images' features: docs/privacy.md)."""
        recipe = announcement.recipe
        if self.settings.share_pool_statistics or not recipe.options.get(POOL_STATISTICS):
            return announcement
        log.warning(
            "pool statistics withheld device=%s round=%d: this device was not started with --share-pool-statistics",
            self.settings.device_id,
            announcement.round_id,
        )
        return replace(announcement, recipe=replace(recipe, options={**recipe.options, POOL_STATISTICS: 0.0}))

    def run_step(
        self, models: RoundModels, round_id: int, step: int, acquires: bool, trains: bool
    ) -> dict[str, float] | None:
        """One acquisition (if the schedule has one) and one local training (if the device participates); the
        training metrics. An acquisition that finds nothing new (the pool is used up) still trains on the labels
        the device holds in the round's first step, as a round without acquisition does (an untrained update
        would drag the average back and lacks the metrics a strategy may weigh by); later steps give None."""
        started, recipe = time.monotonic(), models.recipe
        seed = step_seed(recipe, self.settings.device_id, round_id, step)
        new_indices = new_labels = np.zeros(0, dtype=np.int64)
        if acquires:
            sampler = make_sampler(recipe.sampler)
            new_indices, new_labels = self.acquirer.acquire(models, sampler, seed, round_id, step)
            if len(new_indices) == 0:
                log.warning("no new labels device=%s round=%d", self.settings.device_id, round_id)
                if step > 0:
                    return None
        metrics: dict[str, float] = {}
        training = time.monotonic()
        if trains:
            with self.meter.phase("train"):
                active = round_in_active_round(round_id, recipe)
                data = training_view(self.data, new_indices, new_labels, active, models.learner.rows)
                metrics = models.learner.train(data, recipe, seed)
        log.info(
            "step done device=%s round=%d step=%d new=%d labelled=%d trained=%s seconds=%.1f train_seconds=%.2f",
            *(self.settings.device_id, round_id, step + 1, len(new_indices), self.data.num_labelled, trains),
            *(time.monotonic() - started, time.monotonic() - training),
        )
        return metrics

    def update_of(
        self,
        announcement: messages.RoundAnnouncement,
        spec: ModelSpec,
        models: RoundModels,
        metrics: dict[str, float],
        base: Weights,
    ) -> messages.Update:
        """The round's update: the tensors the spec trains (`trained_set`; a frozen backbone never travels) or the
        class-statistics rule's statistics (`update_base` is their zero), as
        weights or their delta from the base as the recipe encodes them, with the counts and the metrics strategies
        need (a metric that is no number, as a loss over no batch, is left out: the wire carries finite numbers
        only); under --dp device, clipped and noised here (fresh entropy) first."""
        codec = UpdateCodec.of(announcement.recipe)
        trained = models.learner.update(spec)
        trained_base = update_base(spec, base, announcement.recipe.local_rule)
        if announcement.recipe.dp == DP_DEVICE:
            round_dp = DpRound.announced(announcement)
            trained, within = privatised(trained, trained_base, round_dp, np.random.default_rng())
            metrics = {**metrics, WITHIN_CLIP_METRIC: within}
        encoded = encode_update(trained, trained_base, codec, ResidualStore(self.data.state_dir))
        return messages.Update(
            device_id=self.settings.device_id,
            round_id=announcement.round_id,
            update_id=uuid.uuid4().hex,
            base_hash=announcement.model_hash,
            num_samples=self.data.num_labelled,
            class_counts=[int(c) for c in self.data.class_counts()],
            acquired_labels=self.data.count_labels("oracle") + self.data.count_labels("correction"),
            metrics={name: value for name, value in metrics.items() if math.isfinite(value)},
            tensors=encoded.tensors,
            nonce=os.urandom(16),
            encoding=encoded.encoding,
            scales=encoded.scales,
            indices=encoded.indices,
        )


def codec_problem(recipe: messages.Recipe) -> str | None:
    """Why this device cannot encode its update as the recipe asks (e.g. an encoding it does not know), or None."""
    try:
        UpdateCodec.of(recipe)
    except UsageError as error:
        return str(error)
    return None
