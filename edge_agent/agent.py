# The device loop: model in -> acquire labels -> train -> update out, all on the main thread.
from __future__ import annotations

import copy
import functools
import hashlib
import logging
import os
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from edge_agent import wire
from edge_agent.bundle import Bundle, BundleError, remove_other_bundles, store_bundle
from edge_agent.device_data import DeviceData
from edge_agent.encoder import OnnxEncoder, encoder_hash
from edge_agent.fashion_mnist import normalise
from edge_agent.files import load_arrays, save_arrays
from edge_agent.mc_dropout import TorchMCDropout, predict_logits
from edge_agent.mc_scorer import MCScorer
from edge_agent.models import build_model, get_weights, set_weights
from edge_agent.mqtt import IncomingMessage, LastWill, MqttSession, PayloadTooLargeError
from edge_agent.oracle import Oracle
from edge_agent.ort_scorer import OrtMCDropout
from edge_agent.sampling import AcquisitionContext, Embeddings, Sampler, make_sampler, top_k
from edge_agent.schedule import acquires_in_round, initial_label_count, labels_per_acquisition, round_in_active_round
from edge_agent.tensors import Weights, weights_hash
from edge_agent.training import LocalData, make_local_rule

log = logging.getLogger(__name__)

LAST_ROUND_KEY = "last_finished_round"
ROUND_BATCHES_KEY = "round_batches"
INITIAL_LABELS_KEY = "initial_labels_taken"
OWN_MODEL_FILE = "own_model.npz"
PUBLISH_WAIT_SECONDS = 30.0
BUNDLES_FOLDER = "bundles"


@dataclass(frozen=True)
class AgentSettings:
    """Who the device is, where its broker is and how hard it may work."""

    fleet: str
    device_id: str
    model_name: str = "paper-cnn"
    profile: str = "simulated"
    inference_batch: int = 256
    torch_threads: int = 1
    exit_on_final: bool = False
    max_update_bytes: int = wire.DEFAULT_MAX_MESSAGE_BYTES
    backend: str = "torch"
    inference_threads: int = 0
    execution_providers: tuple[str, ...] = ("CPUExecutionProvider",)
    mc_passes_cap: int | None = None
    stream: bool = False
    signing_key: bytes = b""

    @property
    def scores_with_onnxruntime(self) -> bool:
        """True when the device scores its pool with the coordinator's ONNX bundle rather than with torch."""
        return self.backend == "onnxruntime"


class BackgroundWork(Protocol):
    """Work the main loop does between messages (a field device's folder scans and stream scoring)."""

    def tick(self, weights: Weights | None, round_id: int) -> None:
        """Called every loop turn with the newest global weights (None before the first) and the round worked toward."""


def content_matches(kind: str, announced: str, actual: str) -> bool:
    """True when retained content hashes to the name it was published under; a warning otherwise."""
    if actual != announced:
        log.warning("%s hash mismatch announced=%s actual=%s", kind, announced, actual)
        return False
    return True


def device_seed(device_id: str) -> int:
    """A stable per-device number, so that devices with the same recipe seed still draw differently."""
    return int.from_bytes(hashlib.sha256(device_id.encode()).digest()[:4], "little")


class Agent:
    """One device: follows the retained round announcements of its fleet and answers each with one update."""

    def __init__(
        self,
        settings: AgentSettings,
        session: MqttSession,
        data: DeviceData,
        oracle: Oracle,
        background: BackgroundWork | None = None,
    ) -> None:
        self.settings = settings
        self.session = session
        self.data = data
        self.oracle = oracle
        self.background = background
        self.stop_event = threading.Event()
        self._pending: wire.RoundAnnouncement | None = None
        self._models: dict[str, Weights] = {}
        self._bundles: dict[str, Bundle] = {}
        self._encoders: dict[str, bytes] = {}
        self._subscribed: dict[str, str] = {}

    @staticmethod
    def last_will(settings: AgentSettings) -> LastWill:
        """The retained 'offline' status the broker publishes if the device disappears."""
        offline = wire.Status(settings.device_id, "offline", 0.0, profile=settings.profile)
        return LastWill(wire.device_topic(settings.fleet, settings.device_id, "status"), wire.encode(offline))

    @property
    def last_finished_round(self) -> int:
        """The last round this device published an update for (persisted, so a restart does not redo it)."""
        return int(self.data.get_state(LAST_ROUND_KEY, 0))

    def run(self) -> None:
        """Serves rounds until stopped, or until the final announcement when exit_on_final is set."""
        torch.set_num_threads(self.settings.torch_threads)
        fleet, device = self.settings.fleet, self.settings.device_id
        self.session.subscribe(wire.round_topic(fleet))
        self.session.subscribe(wire.device_topic(fleet, device, "ack"))
        self.publish_status("online")
        log.info(
            "agent ready device=%s pool=%d labelled=%d last_round=%d",
            device,
            len(self.data.pool_indices()),
            self.data.num_labelled,
            self.last_finished_round,
        )
        try:
            while not self.stop_event.is_set():
                message = self.session.next_message(timeout=0.5)
                if message is not None and self.handle(message):
                    return
                if self.background is not None:
                    self.background.tick(next(iter(self._models.values()), None), self.last_finished_round + 1)
                self.maybe_run_round()
        finally:
            self.publish_status("offline")

    def handle(self, message: IncomingMessage) -> bool:
        """Routes one message; True when the run is over for this agent."""
        fleet = self.settings.fleet
        try:
            if message.topic == wire.round_topic(fleet):
                return self.on_announcement(wire.decode(message.payload, wire.RoundAnnouncement))
            if message.topic == self._subscribed.get("model"):
                self.on_model(wire.decode(message.payload, wire.ModelMessage))
            elif message.topic == self._subscribed.get("bundle"):
                self.on_bundle(wire.decode(message.payload, wire.BundleMessage))
            elif message.topic == self._subscribed.get("encoder"):
                self.on_encoder(wire.decode(message.payload, wire.EncoderMessage))
            elif message.topic.endswith("/ack"):
                self.on_ack(wire.decode(message.payload, wire.Ack))
        except wire.WireError as error:
            if message.payload:
                log.warning("ignored bad message topic=%s error=%s", message.topic, error)
        return False

    def on_announcement(self, announcement: wire.RoundAnnouncement) -> bool:
        """Remembers the newest unfinished round and asks for its model; True on the final announcement."""
        if announcement.final:
            log.info("run finished run=%s round=%d", announcement.run_id, announcement.round_id)
            return self.settings.exit_on_final
        if announcement.round_id <= self.last_finished_round:
            log.debug("ignoring finished round %d", announcement.round_id)
            return False
        self._pending = announcement
        self.follow("model", wire.model_topic(self.settings.fleet, announcement.model_hash))
        if self.settings.scores_with_onnxruntime:
            self.follow("bundle", wire.bundle_topic(self.settings.fleet, announcement.model_hash))
        if announcement.recipe.encoder:
            self.follow("encoder", wire.encoder_topic(self.settings.fleet, announcement.recipe.encoder))
        return False

    def follow(self, kind: str, topic: str) -> None:
        """Subscribes to the current topic of a kind (model, bundle, encoder), leaving the kind's previous one."""
        previous = self._subscribed.get(kind)
        if topic == previous:
            return
        if previous is not None:
            self.session.unsubscribe(previous)
        self._subscribed[kind] = topic
        self.session.subscribe(topic)

    def on_model(self, message: wire.ModelMessage) -> None:
        """Keeps the announced model once its content matches its hash."""
        if content_matches("model", message.model_hash, weights_hash(message.tensors)):
            self._models = {message.model_hash: message.tensors}

    def on_encoder(self, message: wire.EncoderMessage) -> None:
        """Keeps the announced frozen encoder once its bytes match their sha256."""
        if content_matches("encoder", message.encoder_hash, encoder_hash(message.onnx)):
            self._encoders = {message.encoder_hash: message.onnx}

    def on_bundle(self, message: wire.BundleMessage) -> None:
        """Stores the announced model's ONNX bundle under the state folder once every file verifies."""
        folder = self.data.state_dir / BUNDLES_FOLDER / message.model_hash
        try:
            bundle = store_bundle(folder, message.files)
        except (BundleError, OSError) as error:
            log.warning("bundle rejected model=%s error=%s", message.model_hash[:12], error)
            return
        if not content_matches("bundle", message.model_hash, bundle.manifest.weights_hash):
            return
        remove_other_bundles(folder)
        self._bundles = {message.model_hash: bundle}
        log.info("bundle stored model=%s files=%d", message.model_hash[:12], len(message.files))

    def on_ack(self, ack: wire.Ack) -> None:
        """Logs the coordinator's verdict on an update."""
        if ack.accepted:
            log.info("update accepted round=%d update=%s", ack.round_id, ack.update_id)
        else:
            log.warning(
                "update rejected round=%d update=%s kind=%s reason=%s",
                *(ack.round_id, ack.update_id, ack.rejection, ack.reason),
            )

    def maybe_run_round(self) -> None:
        """Runs the pending round once its model has arrived."""
        announcement = self._pending
        if announcement is None or announcement.model_hash not in self._models:
            return
        if self.settings.scores_with_onnxruntime and announcement.model_hash not in self._bundles:
            return
        if announcement.recipe.encoder and announcement.recipe.encoder not in self._encoders:
            return
        self._pending = None
        update = self.run_round(announcement, self._models[announcement.model_hash])
        try:
            if update is not None:
                self.publish_update(update)
        except (wire.WireError, PayloadTooLargeError) as error:
            log.error("update not sent device=%s round=%d error=%s", update.device_id, update.round_id, error)
            self.publish_status("error", announcement.round_id)
            return
        self.data.set_state(LAST_ROUND_KEY, announcement.round_id)
        self.publish_status("idle", announcement.round_id)

    def run_round(self, announcement: wire.RoundAnnouncement, global_weights: Weights) -> wire.Update | None:
        """Acquires (when the schedule says so), labels and trains; returns the update, or None when the device
        is not among the round's participants (it then only acquires, as every device does, and never trains)."""
        recipe, round_id = announcement.recipe, announcement.round_id
        participating = not announcement.participants or self.settings.device_id in announcement.participants
        self.publish_status("training" if participating else "acquiring", round_id)
        model = build_model(self.settings.model_name)
        set_weights(model, global_weights)
        global_model = copy.deepcopy(model).eval()
        sampler = make_sampler(recipe.sampler)
        rule = make_local_rule(recipe.local_rule)
        self.oracle.start_round(announcement.round_id)
        self.take_initial_labels(recipe)
        acquisitions = recipe.acquisitions_per_round if acquires_in_round(round_id, recipe) else 0
        metrics: dict[str, float] = {}
        for step in range(max(acquisitions, 1 if participating else 0)):
            seed = int(
                np.random.SeedSequence(
                    [recipe.seed, device_seed(self.settings.device_id), round_id, step]
                ).generate_state(1)[0]
            )
            started = time.monotonic()
            new_indices = new_labels = np.zeros(0, dtype=np.int64)
            if step < acquisitions:
                new_indices, new_labels = self.acquire(
                    model, global_model, announcement.model_hash, sampler, recipe, seed, round_id, step
                )
                if len(new_indices) == 0:
                    log.warning("no new labels device=%s round=%d", self.settings.device_id, round_id)
                    break
            if participating:
                data = self.local_data(new_indices, new_labels, round_in_active_round(round_id, recipe))
                metrics = rule.train(model, data, global_model, recipe, seed)
                save_arrays(self.data.state_dir / OWN_MODEL_FILE, get_weights(model))
            log.info(
                "step done device=%s round=%d step=%d new=%d labelled=%d trained=%s seconds=%.1f",
                self.settings.device_id,
                round_id,
                step + 1,
                len(new_indices),
                self.data.num_labelled,
                participating,
                time.monotonic() - started,
            )
        if not participating:
            return None
        return wire.Update(
            device_id=self.settings.device_id,
            round_id=round_id,
            update_id=uuid.uuid4().hex,
            base_hash=announcement.model_hash,
            num_samples=self.data.num_labelled,
            class_counts=[int(c) for c in self.data.class_counts()],
            acquired_labels=self.data.count_labels("oracle"),
            metrics=metrics,
            tensors=get_weights(model),
            nonce=os.urandom(16),
        )

    @property
    def own_samples(self) -> int:
        """The device's own data |D_i|: every sample but the seeds the server handed it."""
        return self.data.num_samples - self.data.count_labels("seed")

    def take_initial_labels(self, recipe: wire.Recipe) -> None:
        """Once per device: labels a random initial_label_fraction of its own data (KAFAL's 10% start)."""
        count = initial_label_count(recipe, self.own_samples)
        if count == 0 or self.data.get_state(INITIAL_LABELS_KEY, False):
            return
        pool = self.data.pool_indices()
        rng = np.random.default_rng([recipe.seed, device_seed(self.settings.device_id)])
        answered, labels = self.oracle.label(np.sort(rng.choice(pool, size=min(count, len(pool)), replace=False)))
        self.data.add_labels(answered, labels)
        self.data.set_state(INITIAL_LABELS_KEY, True)
        log.info("initial labels device=%s labels=%d", self.settings.device_id, len(answered))

    def own_model(self, current: torch.nn.Module) -> torch.nn.Module:
        """The device's own last trained model omega_i (kept across rounds), or `current` before it has one."""
        path = self.data.state_dir / OWN_MODEL_FILE
        if not path.is_file():
            return current
        model = build_model(self.settings.model_name)
        set_weights(model, load_arrays(path))
        return model

    def acquisition_context(
        self,
        model: torch.nn.Module,
        global_model: torch.nn.Module,
        base_hash: str,
        pool: np.ndarray,
        recipe: wire.Recipe,
        seed: int,
    ) -> AcquisitionContext:
        """What the round's sampler may look at; each expensive view is computed once, on first use."""
        images = self.data.images(pool)
        normalised = functools.cache(lambda: normalise(images))  # KSAS needs it twice; other samplers never
        batch = self.settings.inference_batch
        return AcquisitionContext(
            num_samples=len(pool),
            rng=np.random.default_rng(seed),
            class_counts=self.data.class_counts(),
            options=recipe.options,
            probabilities=functools.cache(lambda: self.mc_probabilities(model, base_hash, images, recipe, seed)),
            own_logits=functools.cache(lambda: predict_logits(self.own_model(model), normalised(), batch)),
            global_logits=functools.cache(lambda: predict_logits(global_model, normalised(), batch)),
            embeddings=functools.cache(lambda: self.embeddings(recipe, images)),
        )

    def embeddings(self, recipe: wire.Recipe, pool_images: np.ndarray) -> Embeddings:
        """The round's frozen encoder applied to the pool and to the human-labelled samples (FAST's seeds)."""
        if recipe.encoder not in self._encoders:
            raise ValueError(f"sampler {recipe.sampler!r} needs the round's encoder, which has not arrived")
        encoder = OnnxEncoder(self._encoders[recipe.encoder], self.settings.torch_threads)
        indices, labels = self.data.labelled()
        return Embeddings(encoder.embed(pool_images), encoder.embed(self.data.images(indices)), labels)

    def acquire(
        self,
        model: torch.nn.Module,
        global_model: torch.nn.Module,
        base_hash: str,
        sampler: Sampler,
        recipe: wire.Recipe,
        seed: int,
        round_id: int,
        acquisition: int,
    ) -> tuple[np.ndarray, np.ndarray]:
        """Scores the pool, asks the oracle for the top b, stores the answers (and the sampler's weak labels for
        the rest); returns the new human labels (indices, labels).

        The queried batch is persisted before the oracle is asked: a device killed during the round reuses it on
        restart instead of querying a fresh batch, so no label is asked twice. Pending queries (a person has not
        answered yet) are not asked again; the oracle may return their answers with any later acquisition. When
        streaming, the stream has asked already: only answers are collected.
        """
        queried = self.queried_batch(round_id, acquisition)
        weak: tuple[np.ndarray, np.ndarray] | None = None
        if queried is None:
            pool = np.setdiff1d(self.data.pool_indices(), self.oracle.pending())
            queried = pool[:0]
            if len(pool) and not self.settings.stream:
                context = self.acquisition_context(model, global_model, base_hash, pool, recipe, seed)
                queried = pool[top_k(sampler.score_pool(context), labels_per_acquisition(recipe, self.own_samples))]
                proposed = sampler.weak_labels(context)
                weak = None if proposed is None else (pool, proposed)
            self.remember_batch(round_id, acquisition, queried)
        labelled_before = self.data.labels_at(queried) >= 0
        answered, labels = self.oracle.label(queried[~labelled_before])
        self.data.add_labels(answered, labels)
        if weak is not None:
            unanswered = ~np.isin(weak[0], answered)
            self.data.set_weak_labels(weak[0][unanswered], weak[1][unanswered])
        new = np.union1d(queried[labelled_before], answered)
        return new, self.data.labels_at(new)

    def queried_batch(self, round_id: int, acquisition: int) -> np.ndarray | None:
        """The batch this acquisition of this round already queried before the agent was stopped, if any."""
        record = self.data.get_state(ROUND_BATCHES_KEY)
        if not record or record.get("round") != round_id or acquisition >= len(record.get("batches", [])):
            return None
        return np.asarray(record["batches"][acquisition], dtype=np.int64)

    def remember_batch(self, round_id: int, acquisition: int, queried: np.ndarray) -> None:
        """Persists the batch an acquisition is about to query (earlier rounds' batches are dropped)."""
        record = self.data.get_state(ROUND_BATCHES_KEY) or {}
        batches = record.get("batches", [])[:acquisition] if record.get("round") == round_id else []
        self.data.set_state(ROUND_BATCHES_KEY, {"round": round_id, "batches": batches + [queried.tolist()]})

    def mc_scorer(self, model: torch.nn.Module, base_hash: str) -> MCScorer:
        """The profile's MC-dropout back end over the model as it is now (after any local training this round)."""
        if self.settings.scores_with_onnxruntime:
            return OrtMCDropout(
                self._bundles[base_hash],
                self.settings.inference_batch,
                threads=self.settings.inference_threads,
                providers=self.settings.execution_providers,
                weights=get_weights(model),
            )
        return TorchMCDropout(model, self.settings.inference_batch)

    def mc_probabilities(
        self, model: torch.nn.Module, base_hash: str, images: np.ndarray, recipe: wire.Recipe, seed: int
    ) -> np.ndarray:
        """MC-dropout probabilities of raw pool images with the recipe's passes, capped by the profile."""
        passes = min(recipe.mc_passes, self.settings.mc_passes_cap or recipe.mc_passes)
        log.info("scoring backend=%s passes=%d images=%d", self.settings.backend, passes, len(images))
        return self.mc_scorer(model, base_hash).probabilities(images, passes, seed)

    def local_data(self, new_indices: np.ndarray, new_labels: np.ndarray, round_in_active: int = 1) -> LocalData:
        """The training view of the device's data after an acquisition (replay excludes the new batch)."""
        labelled_indices, labelled_labels = self.data.labelled()
        replay_indices, replay_labels = self.data.replay()
        weak_indices, weak_labels = self.data.weak_labels()
        keep = ~np.isin(replay_indices, new_indices)
        return LocalData(
            new_images=self.data.images(new_indices),
            new_labels=new_labels,
            replay_images=self.data.images(replay_indices[keep]),
            replay_labels=replay_labels[keep],
            labelled_images=self.data.images(labelled_indices),
            labelled_labels=labelled_labels,
            unlabelled_images=self.data.images(self.data.pool_indices()),
            state_dir=self.data.state_dir,
            weak_images=self.data.images(weak_indices),
            weak_labels=weak_labels,
            round_in_active_round=round_in_active,
        )

    def publish_update(self, update: wire.Update) -> None:
        """Signs (with a provisioned key), encodes and publishes the update at QoS 1; the session refuses it
        before paho sees it if it is too large."""
        if self.settings.signing_key:
            update = wire.sign_update(update, self.settings.signing_key)
        payload = wire.encode(update)
        topic = wire.device_topic(self.settings.fleet, self.settings.device_id, "update")
        if self.session.publish(topic, payload, wait=PUBLISH_WAIT_SECONDS):
            log.info("update published device=%s round=%d bytes=%d", update.device_id, update.round_id, len(payload))
        else:
            log.warning("update queued until the broker is back device=%s round=%d", update.device_id, update.round_id)

    def publish_status(self, state: str, round_id: int | None = None) -> None:
        """Retained presence and progress for the coordinator and its dashboard."""
        status = wire.Status(
            device_id=self.settings.device_id,
            state=state,
            timestamp=time.time(),
            round_id=self.last_finished_round if round_id is None else round_id,
            labelled=self.data.num_labelled,
            profile=self.settings.profile,
        )
        self.session.publish(
            wire.device_topic(self.settings.fleet, self.settings.device_id, "status"), wire.encode(status), retain=True
        )
