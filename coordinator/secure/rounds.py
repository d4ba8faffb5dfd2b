# A secure round over MQTT on the coordinator: stage messages routed to SecAggServer, each stage closed when every
# expected device answered or its deadline passed, the state saved beside the spool (a restart resumes the round),
# and the unmasked mean handed to the round's aggregator as one update (the survivors' FedAvg).
from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from coordinator.intake.divergence import relative_divergence
from coordinator.intake.round_aggregator import RoundAggregator, SuspectPolicy
from coordinator.intake.update_intake import RoundCollector, UpdateIntake
from coordinator.intake.validation import Rejection
from coordinator.secure.secagg_bounds import SumLimits, sum_refusal
from coordinator.secure.secagg_round import (
    ABANDONED,
    CHECK,
    DONE,
    KEYS,
    MASKED,
    RESOLVE,
    SHARES,
    UNMASK,
    VIEW,
    SecAggSettings,
)
from coordinator.secure.secagg_server import SecAggServer
from coordinator.secure.secagg_unmask import SecAggResult
from coordinator.storage.store import AGGREGATE_CHANGE, SECURE_LABELS, SECURE_WEIGHT
from coordinator.strategies.aggregate import ClientUpdate
from coordinator.strategies.registry import STRATEGIES
from protocol import messages, topics, wire
from protocol.dp import DP_CENTRAL, DP_DEVICE
from protocol.errors import UsageError
from protocol.files import atomic_write_bytes
from protocol.messages import (
    DeliveryAck,
    KeyAdvert,
    MaskedInput,
    RecordKeyReveal,
    RejectionKind,
    ShareBundle,
    UnmaskResponse,
    ViewConfirmation,
)
from protocol.model_spec import ModelSpec
from protocol.mqtt import MqttSession
from protocol.secagg import keys
from protocol.secagg.errors import SecAggAbandoned, SecAggRefusal
from protocol.secagg.weighting import label_count, mask_layout, secure_mean, weighted_samples
from protocol.tensors import Weights
from protocol.trained_set import update_base

log = logging.getLogger(__name__)

SECURE_SUM = "secure-sum"  # the one update a secure round gives its aggregator
INBOUND = (KeyAdvert, ShareBundle, DeliveryAck, RecordKeyReveal, MaskedInput, ViewConfirmation, UnmaskResponse)
Inbound = KeyAdvert | ShareBundle | DeliveryAck | RecordKeyReveal | MaskedInput | ViewConfirmation | UnmaskResponse
# Each stage: whom the round waits for, who answered so far.
WAITING = {KEYS: ("selected", "advertised"), SHARES: ("advertised", "sharers"), CHECK: ("sharers", "ackers")}
WAITING[RESOLVE], WAITING[MASKED] = ("accused", "revealers"), ("maskers", "masked_from")
WAITING[VIEW], WAITING[UNMASK] = ("masked_from", "viewers"), ("masked_from", "responders")


def check_secure_settings(strategy: str, recipe: messages.Recipe, suspects: SuspectPolicy, asynchronous: bool) -> None:
    """UsageError (one line naming the conflict) for what secure aggregation cannot honour: a strategy that needs
    each device's update, leaving suspects out, asynchronous rounds, an update encoding other than float32, and
    DP that reads single updates (central placement clips each one; an adaptive clip reads each one's bit)."""
    if recipe.secure_aggregation == "off":
        return
    streaming = STRATEGIES.select(lambda known: known.streaming)
    if strategy not in streaming:
        raise UsageError(f"--secure-aggregation hides each device's update, which --strategy {strategy[:64]} needs")
    if suspects.exclude or asynchronous:
        raise UsageError("--secure-aggregation hides each update: drop --exclude-suspects and --mode async")
    if recipe.update_encoding != "float32" or recipe.update_top_k > 0:
        raise UsageError("--secure-aggregation masks float32 deltas itself: drop --update-encoding and --update-top-k")
    weighs = STRATEGIES.get(strategy).weighs_by_samples
    if weighs != (recipe.secagg_sample_cap > 0):
        raise UsageError(f"--strategy {strategy} needs --secagg-sample-cap {'above 0' if weighs else '0'}")
    if recipe.dp == DP_CENTRAL:
        raise UsageError(
            "--dp central clips each device's delta on the coordinator, which --secure-aggregation hides from it: "
            "use --dp device (each device clips and adds its noise share; the secure sum carries the full noise)"
        )
    if recipe.dp == DP_DEVICE and recipe.dp_clip_quantile > 0.0:
        raise UsageError(
            "--dp-clip-quantile adapts the clip from each device's within-clip bit, which --secure-aggregation "
            "hides: keep a fixed clip (--dp-clip-quantile 0)"
        )


@dataclass(frozen=True)
class LiveParts:
    """What a live secure round works with: the session its stage messages go out on, the fleet, the intake that
    counts refused messages (store, dashboard, /metrics) and holds the spool folder the round is saved in, and the
    limits its unmasked sum is checked against."""

    session: MqttSession
    fleet: str
    intake: UpdateIntake
    limits: SumLimits
    sample_cap: int = 0  # the recipe's secagg_sample_cap: what a summed weight stands for in samples


class LiveSecureRound:
    """One secure round of a running coordinator: its SecAggServer, the file it is saved in, and what it sent last
    (the stage's messages, sent again after a restart)."""

    def __init__(self, server: SecAggServer, path: Path, parts: LiveParts) -> None:
        self.server, self.path, self.parts = server, path, parts
        self.outbound: list[bytes] = []
        self.reason = ""
        self.unsaved = False
        self.labels = 0
        self.weight = 0.0
        self.change: dict[str, float] = {}
        self.recorded: set[str] = set(server.state.excluded)

    @classmethod
    def opened(cls, parts: LiveParts, start: Callable[[], SecAggServer], round_id: int) -> LiveSecureRound:
        """The round saved by a process that died in it (its last stage's messages sent again), else a new one."""
        path = parts.intake.store.spool.folder / f"secagg-{round_id}.rec"
        if not path.exists():
            live = cls(start(), path, parts)
            live.save()
            return live
        live = cls(SecAggServer.restored(path.read_bytes()), path, parts)
        log.info("secure round resumed round=%d stage=%s", round_id, live.server.state.stage)
        sent = path.with_suffix(".out")
        live.send(wire.decode_record(sent.read_bytes(), SentMessages).payloads if sent.exists() else [])
        return live

    def on_message(self, device_id: str, payload: bytes) -> None:
        """A device's stage message: taken by the server (saved with the batch it came in, see `commit`), or refused
        (logged and counted)."""
        try:
            message = wire.decode_any(payload, INBOUND)
            if message.device_id != device_id:
                raise SecAggRefusal(RejectionKind.WRONG_RECIPIENT, f"sent on {wire.shown(device_id)}'s topic")
            self.take(message)
        except (SecAggRefusal, wire.WireError) as refusal:
            log.warning("secure-round message refused device=%s kind=%s reason=%s", device_id, refusal.kind, refusal)
            self.record(device_id, Rejection(refusal.kind, str(refusal)), len(payload))
            return
        self.unsaved = True

    def take(self, message: Inbound) -> None:
        """Hands a message to the server's method for its stage."""
        server = self.server
        if isinstance(message, KeyAdvert):
            server.on_keys(message)
        elif isinstance(message, ShareBundle):
            server.on_shares(message)
        elif isinstance(message, DeliveryAck):
            server.on_ack(message)
        elif isinstance(message, RecordKeyReveal):
            server.on_key_reveal(message)
        elif isinstance(message, MaskedInput):
            server.on_masked(message)
        elif isinstance(message, ViewConfirmation):
            server.on_confirm(message)
        else:
            server.on_reveal(message)

    def collect(self, handle_next: Callable[[], None], stage_timeout: float) -> SecAggResult | None:
        """Runs the stages from where the round is (a round a dead process finished is finished again from its saved
        shares): waits for each, closes it and sends its messages; the unmasked result, or None when the round was
        abandoned (nothing revealed; `reason` says why)."""
        closes: dict[str, Callable[[], list[Any]]] = {
            KEYS: self.server.rosters,
            SHARES: self.server.deliveries,
            CHECK: self.server.key_requests,
            RESOLVE: self.server.mask_requests,
            MASKED: self.server.view_requests,
            VIEW: self.server.unmask_requests,
        }
        try:
            while self.server.state.stage in closes:
                self.wait(handle_next, stage_timeout)
                messages_out = closes[self.server.state.stage]()
                self.record_exclusions()
                self.send([wire.encode(message) for message in messages_out], save=True)
            if self.server.state.stage == ABANDONED:
                raise SecAggAbandoned("abandoned before the coordinator restarted")
            unmasking = self.server.state.stage == UNMASK
            if unmasking:
                self.wait(handle_next, stage_timeout)
            result = self.server.finish()
            self.record_exclusions()
            if unmasking:
                self.record_forgers(result.forgers)
            self.check_sum(result)
        except SecAggAbandoned as abandoned:
            self.record_exclusions()
            self.reason = str(abandoned)[:300]
            log.warning("secure round abandoned round=%d reason=%s", self.server.state.round_id, self.reason)
            self.save()
            return None
        self.save()
        return result

    def record_forgers(self, forgers: list[str]) -> None:
        """Counts each survivor whose returned share was off its secret's polynomial (outvoted) as forged_share."""
        for device in forgers:
            reason = f"{wire.shown(device)} returned a share off its secret's polynomial at unmasking (outvoted)"
            log.warning("secure-round share forged device=%s round=%d", device, self.server.state.round_id)
            self.record(device, Rejection(RejectionKind.FORGED_SHARE, reason), 0)

    def check_sum(self, result: SecAggResult) -> None:
        """Refuses the round (abandoned: its sum dropped, the round's own model committed) when its unmasked sum
        cannot be honest; counted as an out_of_range rejection of the secure sum (no one device can be named)."""
        refusal = sum_refusal(result.total, len(result.survivors), self.server.fixed_point, self.parts.limits)
        if refusal is not None:
            self.record(SECURE_SUM, Rejection(RejectionKind.OUT_OF_RANGE, refusal), 0)
            self.server.refuse(refusal)

    def record(self, device_id: str, rejection: Rejection, size: int) -> None:
        """Counts a refusal of this round in the store, on the dashboard and in /metrics."""
        self.parts.intake.record(device_id, self.server.state.round_id, rejection, size)

    def wait(self, handle_next: Callable[[], None], timeout: float) -> None:
        """Handles messages until every device the stage waits for answered or its deadline passed (logged: how many
        answered, how long it took)."""
        expected, answered = WAITING[self.server.state.stage]
        started = time.monotonic()
        state = self.server.state
        while (
            not set(getattr(state, expected)) <= set(getattr(state, answered)) and time.monotonic() < started + timeout
        ):
            handle_next()
        counts = (len(getattr(state, answered)), len(getattr(state, expected)), time.monotonic() - started)
        log.info(
            "secure stage closed round=%d stage=%s answered=%d of %d seconds=%.1f", state.round_id, state.stage, *counts
        )

    def record_exclusions(self) -> None:
        """Each device the round excluded (a settled complaint: forged_share; confirmations that did not check:
        bad_signature), named in a rejection of its kind (once)."""
        for device, reason, kind in self.server.exclusions():
            if device not in self.recorded:
                log.warning("secure round excluded device=%s reason=%s", device, reason)
                self.record(device, Rejection(kind, reason), 0)
                self.recorded.add(device)

    def send(self, payloads: list[bytes], save: bool = False) -> None:
        """Publishes a stage's messages to their devices (saved first with the state, to be sent again on resume)."""
        if save:
            atomic_write_bytes(self.path.with_suffix(".out"), wire.encode_record(SentMessages(payloads)))
            self.save()
        self.outbound = payloads
        for payload in payloads:
            device = wire.decode_any(payload, OUTBOUND).device_id
            self.parts.session.publish(topics.SECAGG_DOWN.build(fleet=self.parts.fleet, device=device), payload)

    def save(self) -> None:
        """The server's state, written atomically beside the spool."""
        atomic_write_bytes(self.path, self.server.snapshot())
        self.unsaved = False

    def commit(self) -> None:
        """Saves what a batch of messages changed, once, before the broker is told they were handled (one write per
        batch: the state holds every sealed record in transit, megabytes at a few hundred devices)."""
        if self.unsaved:
            self.save()

    def conclude(
        self, result: SecAggResult | None, collector: RoundCollector, aggregator: RoundAggregator, spec: ModelSpec
    ) -> None:
        """Gives the aggregator the round's one update and the record its survivors (see `conclude`), keeps the
        survivors' summed weight and counts their new labels (a relay sends both upstream), and measures the
        aggregate's per-layer change (divergence's stand-in: no device's own update is seen)."""
        expectation, base = collector.expectation, collector.expectation.base
        mean, self.weight = conclude(result, base, self.server.state.clip, aggregator, self.parts.sample_cap)
        collector.accepted.update(survivor_records(result, expectation.round_id, expectation.base_hash))
        self.labels = label_count(result.total, self.server.fixed_point) if result is not None else 0
        self.change = {name: relative_divergence(base[name], mean[name]) for name in base}

    def metrics(self) -> dict[str, Any]:
        """What the round's record says of the secure round (the dashboard shows it)."""
        state = self.server.state
        outcome = "committed" if state.stage == DONE else "abandoned" if state.stage == ABANDONED else state.stage
        return {
            "secure_aggregation": outcome,
            "secagg_survivors": len(set(state.masked_from) - set(state.excluded)) if state.stage == DONE else 0,
            "secagg_reason": self.reason,
            "secagg_excluded": dict(zip(state.excluded, state.exclusion_reasons)),
            SECURE_LABELS: self.labels,
            SECURE_WEIGHT: self.weight,
            "divergence_source": "aggregate",
            AGGREGATE_CHANGE: self.change,
        }


OUTBOUND = (
    messages.KeyRoster,
    messages.ShareDelivery,
    messages.RecordKeyRequest,
    messages.MaskRequest,
    messages.SurvivorView,
    messages.UnmaskRequest,
)
HELD_BYTES = 256 * 2**20  # the most secure-round messages held while no round is open may weigh


class HeldMessages:
    """Secure-round messages that arrived while no round was open (a restarted coordinator reads what the broker
    queued for it before it reopens the round it resumes), kept up to HELD_BYTES and handed to the next round."""

    def __init__(self) -> None:
        self.held: list[tuple[str, bytes]] = []
        self.size = 0

    def hold(self, device_id: str, payload: bytes) -> None:
        """Keeps one message for the next secure round (dropped, logged, beyond the bound)."""
        if self.size + len(payload) > HELD_BYTES:
            log.warning("secure-round message dropped: too much held before the round opened device=%s", device_id)
            return
        self.held.append((device_id, payload))
        self.size += len(payload)

    def release(self, live: LiveSecureRound) -> None:
        """Hands every held message to the round now open (a stale one is refused there, with its kind)."""
        held, self.held, self.size = self.held, [], 0
        for device_id, payload in held:
            live.on_message(device_id, payload)
        live.commit()


@dataclass(frozen=True)
class SentMessages:
    """A stage's outgoing messages as saved (encoded), for a resumed round to send again."""

    KIND: ClassVar[str] = "secagg_sent"
    payloads: list[bytes]


def start_secure(
    run_id: str,
    round_id: int,
    selected: list[str],
    base: Weights,
    spec: ModelSpec,
    recipe: messages.Recipe,
    identities: Mapping[str, bytes] | None = None,
) -> SecAggServer:
    """A new secure round over the selected devices, masking the spec's trainable tensors and the weight, its graph
    drawn from a seed anyone can recompute (the run and round); on a provisioned fleet, `identities` check every
    key advert's signature."""
    seed = hashlib.sha256(keys.round_context(run_id, round_id)).digest()
    settings = SecAggSettings(recipe.secagg_clip, 2, seed, recipe.secagg_dropout, dict(identities or {}))
    carried = update_base(spec, base, recipe.local_rule)
    return SecAggServer.start(run_id, round_id, selected, mask_layout(carried, list(carried)), settings)


def conclude(
    result: SecAggResult | None, base: Weights, clip: float, aggregator: RoundAggregator, sample_cap: int = 0
) -> tuple[Weights, float]:
    """Gives the aggregator the round's one update, and returns it with the survivors' summed weight: their
    weighted mean (the samples the summed weight stands for as its samples: weighted_samples), or the round's own
    model and no weight when the round was abandoned (so the next round starts where this began, and a relay's site
    weighs nothing upstream)."""
    if result is None:
        aggregator.absorb(ClientUpdate(SECURE_SUM, base, 1.0))
        return base, 0.0
    mean, weight_sum = secure_mean(result.total, base, list(base), clip)
    samples = float(weighted_samples(weight_sum, sample_cap))
    aggregator.absorb(ClientUpdate(SECURE_SUM, mean, samples, {}, len(result.survivors)))
    return mean, weight_sum


def survivor_records(result: SecAggResult | None, round_id: int, base_hash: str) -> dict[str, messages.Update]:
    """What a round's record keeps of each survivor: that it took part, nothing of its update."""
    survivors = result.survivors if result is not None else []
    return {device: messages.Update(device, round_id, "secagg", base_hash, 0, [], 0, {}, {}) for device in survivors}
