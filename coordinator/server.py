# Assembles a coordinator from settings: server data, the initial model W0, resume from the store, the session.
from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable

import torch

from coordinator.asynchronous.rounds import AsyncCoordinator
from coordinator.fleet.provision import load_secure_fleet
from coordinator.intake.authentication import UpdateAuthenticator
from coordinator.intake.observer import RoundObserver, RoundResult
from coordinator.intake.update_intake import UpdateIntake
from coordinator.privacy.mode import PrivateMode
from coordinator.rounds.closing import RoundCloser
from coordinator.rounds.loop import Coordinator, RoundParts
from coordinator.rounds.mode import RoundMode
from coordinator.rounds.presence import Presence
from coordinator.rounds.publisher import Artefacts, RetainedPublisher
from coordinator.rounds.rules import RoundRules
from coordinator.rounds.serving import ServingKeeper
from coordinator.setup.encoder import round_encoder
from coordinator.setup.resume import starting_point
from coordinator.setup.server_data import (
    ServerData,
    build_evaluator,
    load_server_data,
    server_label_statistics,
    w0_accuracy,
    w0_line,
)
from coordinator.setup.settings import ServerSettings, fleet_identities
from coordinator.storage.store import RunStore
from coordinator.strategies.contract import Strategy
from coordinator.strategies.pooled_head import PooledHead
from coordinator.strategies.registry import make_strategy
from edge_agent.learning.encoder import encoder_hash
from export.bundle_writer import ensure_bundle_files
from protocol.dp import DP_OFF
from protocol.errors import UsageError
from protocol.mqtt import MANUAL_ACK_WINDOW, BrokerAddress, MqttSession
from protocol.reassembly import MIB, ChunkLimits
from protocol.supervision import LEDGER, SET_ASIDE, MessageGuard
from protocol.tensors import Weights

log = logging.getLogger(__name__)


def run_server(
    settings: ServerSettings,
    address: BrokerAddress,
    on_round: Callable[[RoundResult], None],
    data: ServerData | None = None,
    wait_for_devices: int = 0,
    device_wait_timeout: float = 60.0,
    observer: RoundObserver | None = None,
    dead_devices: Callable[[], set[str]] = set,
    say: Callable[[str], None] = log.info,
) -> Weights:
    """Runs (or resumes) the whole run against the broker at `address`; returns the final global model.

    `observer` (e.g. the dashboard's live state) hears presence, acks and round boundaries as they happen, and keeps
    what it keeps (the predictions' counts) in the run's store.
    `dead_devices` names devices known to be gone for good (the bench's crashed agents): no round waits for them.
    `say` hears the start-up lines a person reads (W0's test accuracy, measured once and kept in the store; logged
    when no one reads them).
    """
    if settings.torch_threads:
        torch.set_num_threads(settings.torch_threads)
    data = data or load_server_data(settings)
    observer = observer or RoundObserver()
    store = RunStore(settings.run_dir, keep_updates=settings.keep_updates)
    address, authenticator = secured(settings, address, store)
    session = coordinator_session(settings, address)
    try:
        observer.keep_in(store)
        weights, first_round, run_id = starting_point(store, settings, data)
        encoder = round_encoder(settings, store)
        rules = round_rules(settings, authenticator, encoder)
        parts = round_parts(settings, data, store, session, run_id, encoder, observer, dead_devices, weights)
        coordinator = make_coordinator(settings, session, rules, parts)
        say(w0_line(w0_accuracy(store, parts.closer.evaluator, weights, first_round), len(data.init_indices)))
        session.connect()
        coordinator.start()
        if wait_for_devices:
            online = coordinator.wait_for_devices(wait_for_devices, device_wait_timeout)
            log.info("devices online=%d wanted=%d", online, wait_for_devices)
        return coordinator.run(weights, first_round, on_round)
    finally:
        session.close()
        observer.close()
        store.close()


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
    weights: Weights,
) -> RoundParts:
    """The coordinator's collaborators, built from the settings (the strategy: run_strategy, under `weights`)."""
    strategy = run_strategy(settings, data, weights)
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
        serving=ServingKeeper(
            store,
            publisher,
            settings.promotion,
            names,
            lambda candidate, serving: evaluator.evidence(candidate, serving, store.checkpoints.load),
            settings.publish_predictions,
        ),
        guard=MessageGuard(
            "coordinator", observer.health, settings.run_dir / SET_ASIDE, ledger=settings.run_dir / SET_ASIDE / LEDGER
        ),
    )


def run_strategy(settings: ServerSettings, data: ServerData, weights: Weights) -> Strategy:
    """The run's strategy with its options; a pooled head also learns the server's labelled images (W0's) under
    `weights`, the run's model, to fold into every fit."""
    strategy = make_strategy(settings.strategy, **settings.strategy_options)
    if isinstance(strategy, PooledHead):
        server = server_label_statistics(settings, data, weights)
        if server is not None:
            strategy.learn_server_labels(server, len(data.init_indices))
            log.info("pooled head fits from the server's labelled images too count=%d", len(data.init_indices))
    return strategy


def round_mode(settings: ServerSettings, intake: UpdateIntake, session: MqttSession) -> RoundMode:
    """The run's round mode as the recipe asks: plain, private (as its committed rounds left it), secure over either.
    SecAgg+'s module (and with it `cryptography`) is imported only by a run that asks for secure aggregation."""
    mode = RoundMode()
    if settings.recipe.dp != DP_OFF:
        mode = PrivateMode.of_store(intake.store, settings.recipe, settings.policy.participation, settings.dp)
    if settings.recipe.secure_aggregation == "off":
        return mode
    from coordinator.secure.mode import SecureMode

    return SecureMode(mode, session, settings.fleet, intake, fleet_identities(settings))


def bundle_exporter(settings: ServerSettings) -> Callable[[Weights, str], dict[str, bytes]]:
    """Exports each global model's fp32 ONNX bundle once, under run_dir/bundles/<hash>, for shipping.

    The coordinator exports rather than the devices: torch.onnx and onnx stay off the devices, the export
    (about 0.1 s) happens once instead of once per device, and every device verifies the same hashed files.
    """

    def files(weights: Weights, model_hash: str) -> dict[str, bytes]:
        return ensure_bundle_files(weights, settings.run_dir / "bundles" / model_hash, settings.spec)

    return files
