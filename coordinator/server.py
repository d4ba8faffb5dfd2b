# Assembles a coordinator from settings: server data, the initial model W0, resume from the store, the session.
from __future__ import annotations

import dataclasses
import logging
import os
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

from coordinator.asynchronous.intake import AsyncPolicy
from coordinator.asynchronous.rounds import AsyncCoordinator, check_async_settings
from coordinator.fleet.provision import load_secure_fleet
from coordinator.intake.authentication import UpdateAuthenticator
from coordinator.intake.observer import RoundObserver, RoundResult
from coordinator.intake.round_aggregator import SuspectPolicy
from coordinator.intake.update_intake import UpdateIntake
from coordinator.privacy.mode import PrivateMode
from coordinator.privacy.rounds import DpSettings, check_dp_settings
from coordinator.rounds.closing import RoundCloser, RoundEvaluator
from coordinator.rounds.evaluation import Evaluator, LabelledSplit
from coordinator.rounds.holdout import server_holdout, split_sizes
from coordinator.rounds.loop import Coordinator, RoundParts
from coordinator.rounds.mode import RoundMode
from coordinator.rounds.presence import Presence
from coordinator.rounds.promotion import PromotionGate
from coordinator.rounds.publisher import Artefacts, RetainedPublisher
from coordinator.rounds.rules import RoundPolicy, RoundRules
from coordinator.rounds.serving import W0_ACCURACY, W0_CLASS_ACCURACY, ServingKeeper
from coordinator.storage.pretrained import merge_initial_weights, read_weight_file
from coordinator.storage.store import RunStore, stored_spec
from coordinator.strategies.aggregate import DEFAULT_MAX_SAMPLE_SHARE
from coordinator.strategies.registry import make_strategy
from edge_agent.data.fashion_mnist import load_fashion_mnist
from edge_agent.data.image_arrays import ImageDataset, load_npz_dataset
from edge_agent.learning.encoder import OnnxEncoder, encoder_hash
from edge_agent.learning.models import build_model, get_weights, set_weights
from edge_agent.learning.pretrained_backbone import initial_model
from edge_agent.learning.sampling import make_sampler
from edge_agent.learning.training import TrainSettings, train_supervised
from export.bundle_writer import ensure_bundle_files
from export.onnx_graphs import export_encoder
from protocol import messages
from protocol.dp import DP_OFF
from protocol.errors import UsageError
from protocol.model_spec import CLASS_NAMES, DEFAULT_SPEC, ModelSpec, spec_hash
from protocol.mqtt import MANUAL_ACK_WINDOW, BrokerAddress, MqttSession
from protocol.reassembly import MIB, ChunkLimits
from protocol.tensors import Weights

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class InitSettings:
    """How the server trains W0 from its labelled samples (Alg. 4/5, t = 0); `samples` None lets the split follow
    the data (coordinator.holdout.split_sizes: the paper's 100 balanced on Fashion-MNIST, all of a fleet's own)."""

    samples: int | None = None
    epochs: int = 50
    learning_rate: float = 1e-3
    batch_size: int = 32
    weight_decay: float = 5e-4
    optimizer: str = "adam"
    seed: int = 0


@dataclass(frozen=True)
class ServerSettings:
    """Everything the coordinator needs to run a fleet's rounds."""

    run_dir: Path
    fleet: str = "fleet"
    strategy: str = "avefl"
    recipe: messages.Recipe = field(default_factory=messages.Recipe)
    policy: RoundPolicy = field(default_factory=lambda: RoundPolicy(rounds=10))
    init: InitSettings = field(default_factory=InitSettings)
    spec: ModelSpec = DEFAULT_SPEC
    initial_weights: Path | None = None
    validation_samples: int | None = None  # None: as coordinator.holdout.split_sizes chooses
    selection_passes: int = 10
    test_samples: int | None = None
    evaluate_devices: bool = True
    strategy_options: dict[str, float] = field(default_factory=dict)
    suspects: SuspectPolicy = field(default_factory=SuspectPolicy)
    data_dir: Path | None = None
    dataset: Path | None = None
    torch_threads: int | None = None
    ship_bundles: bool = True
    secure_dir: Path | None = None
    encoder_path: Path | None = None
    keep_updates: bool = False
    broker_max_packet_bytes: int | None = None
    transfer_memory_mb: int = 128
    transfer_timeout: float = 120.0
    asynchronous: AsyncPolicy | None = None
    seed_labels: int | None = None
    max_sample_share: float = DEFAULT_MAX_SAMPLE_SHARE
    relays: tuple[str, ...] = ()
    dp: DpSettings = field(default_factory=DpSettings)
    promotion: PromotionGate = field(default_factory=PromotionGate)
    publish_predictions: bool = False

    def __post_init__(self) -> None:
        check_dp_settings(self.recipe, self.strategy, self.suspects, self.asynchronous is not None, self.dp)
        if self.asynchronous is not None:
            check_async_settings(self.strategy, self.suspects, self.policy.participation)
        check_sample_settings(self.seed_labels, self.max_sample_share)
        if self.recipe.secure_aggregation != "off":
            from coordinator.secure.rounds import check_secure_settings  # cryptography: loaded by secure runs only

            check_secure_settings(self.strategy, self.recipe, self.suspects, self.asynchronous is not None)


def check_sample_settings(seed_labels: int | None, max_sample_share: float) -> None:
    """ValueError naming the flag when the seed count is negative or the share cap lies outside (0, 1]."""
    if seed_labels is not None and seed_labels < 0:
        raise ValueError(f"--seed-labels must be at least 0, got {seed_labels}")
    if not 0.0 < max_sample_share <= 1.0:
        raise ValueError(f"--max-sample-share must lie in (0, 1], got {max_sample_share}")


@dataclass(frozen=True)
class ServerData:
    """The dataset and the server's share of it: W0 samples, the selection split, and what is left for devices."""

    dataset: ImageDataset
    init_indices: np.ndarray
    validation_indices: np.ndarray
    device_indices: np.ndarray


def load_server_data(settings: ServerSettings) -> ServerData:
    """Loads the data set (a fleet's own .npz, else Fashion-MNIST) and reserves the server's init and validation
    samples from its training split."""
    spec = settings.spec
    if settings.dataset is not None:
        dataset = load_npz_dataset(settings.dataset, spec.image_shape, spec.num_classes)
    elif spec.image_shape != (28, 28) or spec.num_classes != len(CLASS_NAMES):
        raise UsageError("a model spec other than 28x28 grey with 10 classes needs --dataset FILE.npz")
    else:
        dataset = load_fashion_mnist(settings.data_dir)
    selects = make_strategy(settings.strategy, **settings.strategy_options).needs_evaluation
    sizes = split_sizes(
        len(dataset.train_labels),
        settings.init.samples,
        settings.validation_samples,
        selects,
        settings.dataset is not None,
    )
    rng = np.random.default_rng(settings.init.seed)
    init, validation, rest = server_holdout(dataset.train_labels, sizes.init, sizes.validation, rng, spec.num_classes)
    return ServerData(dataset, init, validation, rest)


def split_line(settings: ServerSettings, data: ServerData) -> str:
    """The start-up line saying how the server's labelled images were split, and why."""
    source = settings.dataset.name if settings.dataset is not None else "Fashion-MNIST"
    train, selection = len(data.init_indices), len(data.validation_indices)
    selects = make_strategy(settings.strategy, **settings.strategy_options).needs_evaluation
    kept = selection_words(settings.strategy, selects, selection)
    rest = f"; {len(data.device_indices)} left for simulated devices" if len(data.device_indices) else ""
    return (
        f"server data: W0 trains on {train} of {source}'s {len(data.dataset.train_labels)} labelled images, {kept}"
        f"{rest}; accuracy is measured on {evaluated_count(settings, data)} test images "
        "(--init-samples, --validation-samples override)"
    )


def evaluation_line(settings: ServerSettings, data: ServerData) -> str:
    """The start-up line saying what the coordinator measures after each round, and what --no-device-eval changes."""
    tested = f"after each round the global model is measured on {evaluated_count(settings, data)} test images"
    if settings.evaluate_devices:
        return f"{tested}, and so is each device's model (one more pass a device; --no-device-eval skips them)"
    return f"{tested}; devices' own models are not (--no-device-eval)"


def selection_words(strategy: str, selects: bool, count: int) -> str:
    """What the split line says of the selection split: kept for a strategy that picks its model on it, else
    set aside unused (a flag asked for it) or none."""
    if selects:
        return f"{count} kept as the selection split {strategy} picks its model on"
    if count:
        return f"{count} set aside as a selection split {strategy} does not use"
    return f"none kept for selection ({strategy} picks no model on one)"


def evaluated_count(settings: ServerSettings, data: ServerData) -> int:
    """How many test images every accuracy is measured on (the first --test-samples, else all)."""
    return min(settings.test_samples or len(data.dataset.test_labels), len(data.dataset.test_labels))


def initial_weights(settings: ServerSettings, data: ServerData) -> Weights:
    """W0: a seeded model (its pretrained backbone and the spec's initial weights file, if any) trained on the balanced init samples
    (no training when there are none)."""
    model = initial_model(settings.spec, seed=settings.init.seed)
    if settings.initial_weights is not None:
        found = read_weight_file(settings.initial_weights)
        set_weights(
            model,
            merge_initial_weights(get_weights(model), found, model.classifier_layer, str(settings.initial_weights)),
        )
    if len(data.init_indices):
        init = settings.init
        train_supervised(
            model,
            data.dataset.train_images[data.init_indices],
            data.dataset.train_labels[data.init_indices],
            TrainSettings(
                init.epochs, init.batch_size, init.learning_rate, 0.0, init.weight_decay, init.seed, init.optimizer
            ),
        )
    return get_weights(model)


def build_evaluator(settings: ServerSettings, data: ServerData) -> Evaluator:
    """Test split (all of it unless test_samples says otherwise) and the BNN selection split."""
    test_count = evaluated_count(settings, data)
    test = LabelledSplit.from_uint8(data.dataset.test_images[:test_count], data.dataset.test_labels[:test_count])
    selection = LabelledSplit.from_uint8(
        data.dataset.train_images[data.validation_indices], data.dataset.train_labels[data.validation_indices]
    )
    return Evaluator(settings.spec, test, selection, settings.selection_passes, settings.init.seed)


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


ENCODER_FILE = "encoder.onnx"


def load_encoder(path: Path, spec: ModelSpec) -> bytes:
    """An encoder file's ONNX bytes, checked (one-line errors naming `--encoder PATH`)."""
    if not Path(path).is_file():
        raise UsageError(f"--encoder {path}: no such file")
    return checked_encoder(Path(path).read_bytes(), spec, f"--encoder {path}")


def checked_encoder(onnx: bytes, spec: ModelSpec, where: str) -> bytes:
    """The encoder's bytes once onnxruntime has embedded an image of the spec's shape with them; ValueError in one
    line, prefixed by `where`, otherwise."""
    try:
        OnnxEncoder(onnx).embed(np.zeros((1, *spec.image_shape), dtype=np.uint8))
    except Exception as error:  # onnxruntime's errors are untyped; any failure means an unusable encoder
        shape = "x".join(str(side) for side in spec.image_shape)
        raise UsageError(f"{where}: cannot embed a {shape} image ({str(error).splitlines()[0]})") from None
    return onnx


def round_encoder(settings: ServerSettings, store: RunStore) -> bytes:
    """The frozen encoder the round's sampler needs: --encoder, else W0's penultimate layers (exported once to
    the run directory); b"" when the sampler needs none."""
    if settings.encoder_path is not None:
        return load_encoder(settings.encoder_path, settings.spec)
    if not make_sampler(settings.recipe.sampler).needs_encoder:
        return b""
    path = settings.run_dir / ENCODER_FILE
    if not path.is_file():
        model = build_model(settings.spec)
        set_weights(model, store.checkpoints.load(0))
        temporary = path.with_suffix(".tmp")
        export_encoder(model, temporary)
        os.replace(temporary, path)
    return load_encoder(path, settings.spec)


def settings_as_dict(settings: ServerSettings) -> dict:
    """JSON-able settings for the store (paths as strings)."""
    return {key: str(value) if isinstance(value, Path) else value for key, value in asdict(settings).items()}


def run_server(
    settings: ServerSettings,
    address: BrokerAddress,
    on_round: Callable[[RoundResult], None],
    data: ServerData | None = None,
    wait_for_devices: int = 0,
    device_wait_timeout: float = 60.0,
    observer: RoundObserver | None = None,
    dead_devices: Callable[[], set[str]] = set,
    say: Callable[[str], None] | None = None,
) -> Weights:
    """Runs (or resumes) the whole run against the broker at `address`; returns the final global model.

    `observer` (e.g. the dashboard's live state) hears presence, acks and round boundaries as they happen.
    `dead_devices` names devices known to be gone for good (the bench's crashed agents): no round waits for them.
    `say` hears the start-up lines a person reads (W0's test accuracy, measured once and kept in the store).
    """
    if settings.torch_threads:
        torch.set_num_threads(settings.torch_threads)
    data = data or load_server_data(settings)
    store = RunStore(settings.run_dir, keep_updates=settings.keep_updates)
    address, authenticator = secured(settings, address, store)
    session = coordinator_session(settings, address)
    try:
        weights, first_round, run_id = starting_point(store, settings, data)
        encoder = round_encoder(settings, store)
        rules = round_rules(settings, authenticator, encoder)
        parts = round_parts(settings, data, store, session, run_id, encoder, observer or RoundObserver(), dead_devices)
        coordinator = make_coordinator(settings, session, rules, parts)
        measured = w0_accuracy(store, parts.closer.evaluator, weights, first_round)
        if say is not None:
            say(w0_line(measured, len(data.init_indices)))
        session.connect()
        coordinator.start()
        if wait_for_devices:
            online = coordinator.wait_for_devices(wait_for_devices, device_wait_timeout)
            log.info("devices online=%d wanted=%d", online, wait_for_devices)
        return coordinator.run(weights, first_round, on_round)
    finally:
        session.close()
        store.close()


def w0_accuracy(store: RunStore, evaluator: RoundEvaluator, weights: Weights, first_round: int) -> float | None:
    """W0's test accuracy: measured (with each class's, which the promotion gate compares round 1 with) and kept in
    the run's config before round 1, read back when a run resumes (None for a run stored before it was kept)."""
    config = store.config() or {}
    if W0_ACCURACY not in config and first_round == 1:
        scores = evaluator.test_scores(weights)
        config[W0_ACCURACY], config[W0_CLASS_ACCURACY] = scores.accuracy, scores.per_class
        store.set_config(config)
    return config.get(W0_ACCURACY)


def w0_line(accuracy: float | None, labels: int) -> str:
    """The start-up line of W0's test accuracy and the labels it was trained on."""
    measured = "not measured in this run's store" if accuracy is None else f"{accuracy:.4f}"
    return f"W0 test accuracy {measured} (trained on the server's {labels} labelled images)"


def round_rules(settings: ServerSettings, authenticator: UpdateAuthenticator | None, encoder: bytes) -> RoundRules:
    """What every round of the run follows: the recipe (naming FAST's encoder by its hash), policy, suspects,
    signatures, spec and the bounds on claimed samples."""
    recipe = dataclasses.replace(settings.recipe, encoder=encoder_hash(encoder)) if encoder else settings.recipe
    return RoundRules(
        recipe,
        settings.policy,
        settings.suspects,
        authenticator,
        settings.spec,
        settings.seed_labels,
        settings.max_sample_share,
        settings.relays,
    )


def make_coordinator(
    settings: ServerSettings, session: MqttSession, rules: RoundRules, parts: RoundParts
) -> Coordinator:
    """Synchronous rounds, or asynchronous ones (FedBuff) when the settings have an AsyncPolicy."""
    if settings.asynchronous is None:
        return Coordinator(settings.fleet, session, rules, parts)
    return AsyncCoordinator(settings.fleet, session, rules, parts, settings.asynchronous)


def coordinator_session(settings: ServerSettings, address: BrokerAddress) -> MqttSession:
    """The coordinator's session: manual acks (as many in flight as one group commit takes), the broker's packet
    limit if the run names one, its transfer limits."""
    if settings.broker_max_packet_bytes:
        address = dataclasses.replace(address, max_packet_bytes=settings.broker_max_packet_bytes)
    limits = transfer_limits(settings)
    return MqttSession(
        address,
        client_id=f"coordinator-{settings.fleet}",
        manual_ack=True,
        chunk_limits=limits,
        ack_window=max(MANUAL_ACK_WINDOW, settings.policy.batch),
    )


def transfer_limits(settings: ServerSettings) -> ChunkLimits:
    """What the coordinator holds of chunked updates in progress: an update of at most max_update_bytes, two
    transfers and twice that per device, transfer_memory_mb in all, each dropped after transfer_timeout idle seconds."""
    largest = settings.policy.max_update_bytes
    total = settings.transfer_memory_mb * MIB
    if total < 1:
        raise UsageError(f"--transfer-memory-mb must be positive, got {settings.transfer_memory_mb}")
    if settings.transfer_timeout <= 0:
        raise UsageError(f"--transfer-timeout must be positive, got {settings.transfer_timeout}")
    return ChunkLimits(
        max_message_bytes=largest, sender_bytes=2 * largest, total_bytes=total, timeout=settings.transfer_timeout
    )


def secured(
    settings: ServerSettings, address: BrokerAddress, store: RunStore
) -> tuple[BrokerAddress, UpdateAuthenticator | None]:
    """The broker address with the coordinator's login and the update authenticator of a secured fleet (else as is);
    the authenticator keeps its nonces in the run's store."""
    if settings.secure_dir is None:
        return address, None
    secure = load_secure_fleet(settings.secure_dir)
    if secure.fleet != settings.fleet:
        raise UsageError(f"{settings.secure_dir} was provisioned for fleet {secure.fleet!r}, not {settings.fleet!r}")
    return secure.coordinator.apply_to(address), UpdateAuthenticator(secure.device_keys, store)


def round_parts(
    settings: ServerSettings,
    data: ServerData,
    store: RunStore,
    session: MqttSession,
    run_id: str,
    encoder: bytes,
    observer: RoundObserver,
    dead_devices: Callable[[], set[str]],
) -> RoundParts:
    """The coordinator's collaborators, built from the settings."""
    strategy = make_strategy(settings.strategy, **settings.strategy_options)
    evaluator = build_evaluator(settings, data)
    bundles = bundle_exporter(settings) if settings.ship_bundles else None
    intake = UpdateIntake(settings.fleet, session, store, observer)
    publisher = RetainedPublisher(session, settings.fleet, run_id, Artefacts(settings.spec, bundles, encoder))
    names = settings.spec.class_names
    return RoundParts(
        presence=Presence(observer, dead_devices),
        intake=intake,
        publisher=publisher,
        closer=RoundCloser(store, strategy, evaluator, settings.evaluate_devices, len(data.init_indices)),
        observer=observer,
        mode=round_mode(settings, intake, session),
        serving=ServingKeeper(store, publisher, settings.promotion, names, settings.publish_predictions),
    )


def round_mode(settings: ServerSettings, intake: UpdateIntake, session: MqttSession) -> RoundMode:
    """The run's round mode as the recipe asks: plain, private (as its committed rounds left it), secure over either.
    SecAgg+'s module (and with it `cryptography`) is imported only by a run that asks for secure aggregation."""
    mode = RoundMode()
    if settings.recipe.dp != DP_OFF:
        mode = PrivateMode.of_store(intake.store, settings.recipe, settings.policy.participation, settings.dp)
    if settings.recipe.secure_aggregation == "off":
        return mode
    from coordinator.secure.mode import SecureMode

    return SecureMode(mode, session, settings.fleet, intake)


def bundle_exporter(settings: ServerSettings) -> Callable[[Weights, str], dict[str, bytes]]:
    """Exports each global model's fp32 ONNX bundle once, under run_dir/bundles/<hash>, for shipping.

    The coordinator exports rather than the devices: torch.onnx and onnx stay off the devices, the export
    (about 0.1 s) happens once instead of once per device, and every device verifies the same hashed files.
    """

    def files(weights: Weights, model_hash: str) -> dict[str, bytes]:
        return ensure_bundle_files(weights, settings.run_dir / "bundles" / model_hash, settings.spec)

    return files
