# What a coordinator checks of a secure round, against malicious devices on a real mosquitto: one that encodes 4x the
# weight cap, one beyond the clip, one inside the bounds (the damage ALGORITHMS.md section 14 states), one that
# forges a share and claims a 17 MiB stage message, one that skips the DP clip; and DP under secure aggregation
# (device placement runs, central is refused). The cheating device is tests/secagg_cheat.py, a plain client.
from __future__ import annotations

import dataclasses
import functools
import logging
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from coordinators import blank_evaluator, local_coordinator
from secagg_cheat import SecAggAttacker

from bench.secagg_fleet import provisioned
from coordinator.cli import main
from coordinator.dashboard.live import LiveState
from coordinator.dashboard.metrics import render_metrics
from coordinator.privacy.mode import PrivateMode
from coordinator.privacy.rounds import DpSettings, PrivateRounds
from coordinator.rounds.rules import RoundPolicy
from coordinator.secure.mode import SecureMode
from coordinator.secure.rounds import SECURE_SUM
from coordinator.secure.secagg_bounds import SumLimits, sum_refusal
from coordinator.storage.store import RunStore
from coordinator.strategies.registry import make_strategy
from edge_agent.data.journal import Journal
from edge_agent.learning.models import build_model, get_weights
from edge_agent.loop.secagg_participant import SecAggParticipant
from protocol import messages, topics, wire
from protocol.credentials import DeviceIdentity
from protocol.dp import DpRound, privatised
from protocol.dp_accountant import SampledGaussian, epsilon_of
from protocol.model_spec import DEFAULT_SPEC
from protocol.mqtt import MqttSession
from protocol.secagg.fixed_point import FixedPoint
from protocol.secagg.weighting import LABELS, WEIGHT
from protocol.tensors import Weights, weights_hash

FLEET = "attacked"
HONEST = {"dev0": 1000, "dev1": 1000, "dev2": 350}  # samples: weights 1, 1 and 0.35 under the cap
ATTACKER = "dev9"
CAP = 1000
RECIPE = messages.Recipe(secure_aggregation="secagg", secagg_sample_cap=CAP)
CLIP = RECIPE.secagg_clip
HONEST_WEIGHT = sum(min(samples, CAP) / CAP for samples in HONEST.values())  # 2.35
SURVIVORS = len(HONEST) + 1
TOLERANCE = 1e-5


@dataclass
class Outcome:
    """What a round with the attacker left: the round's model, the honest devices' trained weights (noised under DP),
    the committed model, the store (open), the dashboard's live state, the attacker's masked values and the setup."""

    base: Weights
    trained: dict[str, Weights]
    committed: Weights
    store: RunStore
    live: LiveState
    values: Weights
    setup: Setup


Attack = Callable[[Weights], Weights]  # the round's model -> what the attacker masks (already weighted)


def attack_values(base: Weights, weight: float, delta: Callable[[np.ndarray], np.ndarray]) -> Weights:
    """What the attacker masks: `weight` times `delta` of each trained tensor (never clipped), its weight times the
    clip, no labels."""
    values = {name: weight * delta(array) for name, array in base.items()}
    return {**values, WEIGHT: np.array([weight * CLIP]), LABELS: np.zeros(1)}


@dataclass(frozen=True)
class Setup:
    """A secure round to attack: its recipe and strategy, the honest devices and their samples, the attacker's input
    (None: no attacker), whether it forges a share at unmasking, the size of the stage message it claims once the
    round is open (0: none), whether its view confirmations are random bytes, and whether the fleet is provisioned
    (every device, the attacker too, with an identity key: adverts and confirmations signed and checked). Under --dp device the honest devices clip and noise their delta first, as an agent does."""

    recipe: messages.Recipe = RECIPE
    strategy: str = "fedavg"
    honest: tuple[tuple[str, int], ...] = tuple(HONEST.items())
    attack: Attack | None = None
    forge: bool = False
    claim: int = 0
    bad_tags: bool = False
    provisioned: bool = False

    @functools.cached_property
    def identities(self) -> dict[str, DeviceIdentity]:
        """Each device's identity on a provisioned fleet (none on an open one)."""
        return provisioned(self.devices) if self.provisioned else {}

    @property
    def devices(self) -> list[str]:
        """Every device of the round, the attacker's last."""
        return [device for device, _ in self.honest] + ([ATTACKER] if self.attack else [])

    def weight(self, samples: int) -> float:
        """An honest device's weight in the round: min(samples, cap) / cap, or 1 with no cap."""
        cap = self.recipe.secagg_sample_cap
        return 1.0 if cap == 0 else min(samples, cap) / cap


def honest_devices(broker, tmp_path: Path, setup: Setup) -> tuple[dict[str, MqttSession], dict]:
    """The honest devices' sessions and participants (the project's device code)."""
    sessions, participants = {}, {}
    for device, _ in setup.honest:
        session = MqttSession(broker.address, client_id=device)
        session.connect(timeout=10)
        session.subscribe(topics.SECAGG_DOWN.build(fleet=FLEET, device=device))
        (tmp_path / device).mkdir()
        journal = Journal(tmp_path / device / "state.json")
        sessions[device] = session
        identity = setup.identities.get(device)
        participants[device] = SecAggParticipant(FLEET, device, session, tmp_path / device, journal, identity)
    return sessions, participants


def trained_weights(setup: Setup, base: Weights, announcement: messages.RoundAnnouncement) -> dict[str, Weights]:
    """What each honest device trained, clipped and noised as its agent does under --dp device."""
    generator = np.random.default_rng(5)
    trained = {
        device: {
            name: (array + generator.normal(0, 0.01, array.shape)).astype(np.float32) for name, array in base.items()
        }
        for device, _ in setup.honest
    }
    if setup.recipe.dp != "device":
        return trained
    round_dp = DpRound.announced(announcement)
    return {device: privatised(weights, base, round_dp, generator)[0] for device, weights in trained.items()}


def attacked_round(broker, tmp_path: Path, setup: Setup) -> Outcome:
    """Round 1 of the setup's secure run (a private one under --dp), every device online and taking part."""
    base = get_weights(build_model(seed=0))
    store, live = RunStore(tmp_path / "run"), LiveState(1)
    session = MqttSession(broker.address, client_id="coordinator")
    sessions, participants = honest_devices(broker, tmp_path, setup)
    values = setup.attack(base) if setup.attack else {}
    secret = setup.identities[ATTACKER].secret if setup.provisioned else b""
    attacker = (
        SecAggAttacker(broker.address, FLEET, ATTACKER, values, setup.forge, setup.bad_tags, secret)
        if setup.attack
        else None
    )
    recipe = setup.recipe
    try:
        policy = RoundPolicy(rounds=1, round_timeout=10.0)
        strategy = make_strategy(setup.strategy)
        roster = {device: identity.roster[device] for device, identity in setup.identities.items()}
        coordinator = local_coordinator(
            FLEET, session, store, strategy, blank_evaluator(), policy, recipe, live, roster
        )
        if recipe.dp != "off":
            private = PrivateMode(PrivateRounds(recipe, 1.0, DpSettings(), []))
            mode = SecureMode(private, session, FLEET, coordinator.parts.intake)
            coordinator.parts = dataclasses.replace(coordinator.parts, mode=mode)
        session.connect(timeout=10)
        coordinator.start()
        for device in setup.devices:
            coordinator.parts.presence.statuses[device] = messages.Status(device, "online", time.time())
        outcome: list = []
        thread = threading.Thread(target=lambda: outcome.append(coordinator.run_round(1, base)))
        thread.start()
        chosen = sorted(setup.devices) if recipe.dp != "off" else []  # a private round names its Poisson sample
        announcement = messages.RoundAnnouncement(
            "run", 1, weights_hash(base), recipe, time.time() + 60, participants=chosen
        )
        trained = trained_weights(setup, base, announcement)
        for device, samples in setup.honest:
            participants[device].begin(announcement)
            update = messages.Update(device, 1, "u", "", samples, [], 0, {}, trained[device])
            participants[device].send_update(update, base, DEFAULT_SPEC, recipe)
        if attacker is not None:
            attack_round(attacker, setup.claim, tmp_path / "run" / "spool" / "secagg-1.rec")
        deadline = time.monotonic() + 60
        while thread.is_alive() and time.monotonic() < deadline:
            for device, device_session in sessions.items():
                message = device_session.next_message(timeout=0.01)
                if message is not None:
                    participants[device].on_message(message)
                    device_session.acknowledge(message)
        thread.join(timeout=30)
        return Outcome(base, trained, outcome[0][0], store, live, values, setup)
    finally:
        if attacker is not None:
            attacker.close()
        for device_session in sessions.values():
            device_session.close()
        session.close()


def attack_round(attacker: SecAggAttacker, claim: int, opened: Path) -> None:
    """The attacker advertises its keys and, with a claim, sends the first chunk of a `claim`-byte stage message once
    the round is open (its state file written); the rest it does as messages come."""
    attacker.advertise(1)
    if claim:
        deadline = time.monotonic() + 30
        while not opened.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        attacker.claim_too_large(claim)


def honest_sum(outcome: Outcome) -> Weights:
    """sum_i w_i clip(x_i - W): what the honest devices mask (each delta coordinate clipped before weighting)."""
    setup = outcome.setup
    return {
        name: sum(
            setup.weight(samples) * np.clip(outcome.trained[device][name] - base, -CLIP, CLIP)
            for device, samples in setup.honest
        )
        for name, base in outcome.base.items()
    }


def honest_looking(base: Weights) -> Weights:
    """An input an honest device could mask: weight 0.5, every delta coordinate 0.01."""
    return attack_values(base, 0.5, lambda array: np.full(array.shape, 0.01))


def rejected(outcome: Outcome, kind: str) -> str:
    """The one /metrics line that counts rejections of `kind`."""
    text = render_metrics(outcome.live.counters(), 0, 1)
    return next(line for line in text.splitlines() if line.startswith(f'fl_updates_rejected_total{{reason="{kind}"}}'))


@pytest.mark.parametrize(
    ("weight", "scale", "reason"),
    [
        (4.0, 4.0, "refused: the summed weight 6.35 lies outside (0, 4], the survivors' count"),
        (1.0, None, "refused: a coordinate of "),
        (1.66, 1.0, "refused: the summed weight 4.01 lies outside (0, 4], the survivors' count"),
    ],
    ids=["weight-4x-cap", "beyond-the-clip", "just-past-the-1.65-the-survivors-leave"],
)
def test_a_device_beyond_the_weight_cap_or_the_clip_gets_the_round_refused(
    broker, tmp_path: Path, weight: float, scale: float | None, reason: str
) -> None:
    """The issue's attack (weight 4 x the cap, deltas 4x: it took 63% of the committed mean) and a device at weight
    1 whose every coordinate is 5 x the clip: the unmasked sum cannot be honest, so the round is refused (its own
    model committed, the reason in its metrics, one out_of_range rejection of the secure sum in the store and
    /metrics; no one device can be named, the coordinator sees only the sum)."""
    generator = np.random.default_rng(9)

    def delta(array: np.ndarray) -> np.ndarray:
        if scale is None:
            return np.full(array.shape, 5 * CLIP)
        return scale * generator.normal(0, 0.01, array.shape)

    outcome = attacked_round(broker, tmp_path, Setup(attack=lambda base: attack_values(base, weight, delta)))
    with outcome.store as store:
        record = store.rounds()[0]
        assert all(np.array_equal(outcome.committed[name], outcome.base[name]) for name in outcome.base)
        assert record.metrics["secure_aggregation"] == "abandoned"
        assert record.metrics["secagg_reason"].startswith(reason)
        assert store.rejection_kinds() == {"out_of_range": 1}
        [(round_id, device, stored, _, _)] = store.rejections()
    assert (round_id, device, stored) == (1, SECURE_SUM, record.metrics["secagg_reason"])
    assert len(stored) <= 300
    assert rejected(outcome, "out_of_range").endswith(" 1")


def test_a_device_inside_the_bounds_moves_the_round_no_further_than_the_docs_say(broker, tmp_path: Path) -> None:
    """What the checks leave a malicious device (ALGORITHMS.md section 14): with the honest weights summing to 2.35 of
    4 survivors it may claim weight 1.65, all the survivors' count leaves (41.25% of the round, where an honest device
    at the cap weighs 25%), and a delta of +clip on every coordinate; the round commits, and the committed step is
    the bounded one: (honest sum + 1.65 clip) / 4 per coordinate, never beyond the clip."""
    weight = SURVIVORS - HONEST_WEIGHT
    outcome = attacked_round(
        broker, tmp_path, Setup(attack=lambda base: attack_values(base, weight, lambda a: np.full(a.shape, CLIP)))
    )
    total = HONEST_WEIGHT + weight
    honest = honest_sum(outcome)
    with outcome.store as store:
        metrics = store.rounds()[0].metrics
        assert metrics["secure_aggregation"] == "committed" and store.rejection_kinds() == {}
    assert metrics["secagg_weight"] == pytest.approx(total, abs=TOLERANCE)
    assert (weight, weight / total) == (pytest.approx(1.65), pytest.approx(0.4125))
    for name, base in outcome.base.items():
        step = outcome.committed[name] - base
        np.testing.assert_allclose(step, (honest[name] + weight * CLIP) / total, rtol=0, atol=TOLERANCE)
        assert float(np.abs(step).max()) <= CLIP


def test_a_forged_share_and_an_oversized_message_are_counted_against_their_sender(
    broker, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The attacker masks an honest-looking input, claims a 17 MiB stage message once the round is open and forges
    one seed share at unmasking: the share is outvoted (the round commits FedAvg with its input), and each is a
    bounded rejection naming dev9 (forged_share, too_large) in the store, on the dashboard and in /metrics; the log
    says the message was dropped, not that it came outside a secure round."""
    caplog.set_level(logging.WARNING, logger="coordinator")
    claim = 17 * 2**20
    outcome = attacked_round(broker, tmp_path, Setup(attack=honest_looking, forge=True, claim=claim))
    with outcome.store as store:
        assert store.rounds()[0].metrics["secure_aggregation"] == "committed"
        assert store.rejection_kinds() == {"forged_share": 1, "too_large": 1}
        rows = [row[:4] for row in store.rejections()]
    limit = wire.DEFAULT_MAX_MESSAGE_BYTES
    assert rows == [
        (1, ATTACKER, f"too large: transfer {'a' * 32} claims {claim} bytes, above the limit of {limit}", claim),
        (1, ATTACKER, "'dev9' returned a share off its secret's polynomial at unmasking (outvoted)", 0),
    ]
    assert rejected(outcome, "forged_share").endswith(" 1") and rejected(outcome, "too_large").endswith(" 1")
    assert outcome.live.devices()[ATTACKER]["last_update"]["reason"].startswith("'dev9' returned a share")
    assert "secure-round message dropped device=dev9 kind=too_large" in caplog.text
    assert "outside a secure round" not in caplog.text
    honest, total = honest_sum(outcome), HONEST_WEIGHT + 0.5
    for name, base in outcome.base.items():
        expected = (honest[name] + outcome.values[name]) / total
        np.testing.assert_allclose(outcome.committed[name] - base, expected, rtol=0, atol=TOLERANCE)


DP_RECIPE = messages.Recipe(
    secure_aggregation="secagg", secagg_sample_cap=0, dp="device", dp_clip=0.5, dp_noise_multiplier=0.5
)
DP_HONEST = (("dev0", 50), ("dev1", 60), ("dev2", 70))


def test_device_placed_dp_runs_under_secure_aggregation_and_counts_the_noise_shares(broker, tmp_path: Path) -> None:
    """The issue's combination (avefl, cap 0, --dp device, z 0.5, clip 0.5), which crashed the coordinator: each of
    3 devices clips its delta to 0.5 and adds a noise share of std z C / sqrt(3); the round commits the round's model
    plus their secure sum over the 3 expected devices (full noise: std z C / 3 on the step), and the accountant
    counts one Gaussian release of multiplier 0.5 at q = 1 (all three shares are in the sum)."""
    outcome = attacked_round(broker, tmp_path, Setup(DP_RECIPE, "avefl", DP_HONEST))
    with outcome.store as store:
        record = store.rounds()[0]
    dp = record.report["dp"]
    assert record.metrics["secure_aggregation"] == "committed" and record.metrics["secagg_survivors"] == 3
    assert (dp["placement"], dp["reported"], dp["within_clip_fraction"]) == ("device", 3, None)
    assert dp["effective_noise_multiplier"] == 0.5 and dp["next_clip"] == 0.5
    assert dp["epsilon"] == pytest.approx(epsilon_of([SampledGaussian(1.0, 0.5)], 1e-5), rel=1e-9)
    honest = honest_sum(outcome)
    steps = []
    for name, base in outcome.base.items():
        steps.append((outcome.committed[name] - base).ravel())
        np.testing.assert_allclose(outcome.committed[name] - base, honest[name] / 3, rtol=0, atol=TOLERANCE)
    assert float(np.std(np.concatenate(steps))) == pytest.approx(0.5 * 0.5 / 3, rel=0.05)


def test_a_device_that_skips_the_dp_clip_gets_the_round_refused(broker, tmp_path: Path) -> None:
    """Under --dp device each delta is at most the clip plus its noise share: a plain client that masks a delta of
    L2 norm 100 (every coordinate 0.43, inside the fixed point's clip of 1) leaves a sum no 4 clipped, noised deltas
    reach. The round is refused with the norm in its reason and commits its own model; it released nothing, and the
    accountant counts it at full noise."""

    def unclipped(base: Weights) -> Weights:
        size = sum(array.size for array in base.values())
        return attack_values(base, 1.0, lambda array: np.full(array.shape, 100 / np.sqrt(size)))

    outcome = attacked_round(broker, tmp_path, Setup(DP_RECIPE, "avefl", DP_HONEST, attack=unclipped))
    with outcome.store as store:
        record = store.rounds()[0]
        assert store.rejection_kinds() == {"out_of_range": 1}
    assert record.metrics["secagg_reason"].startswith("refused: the sum's L2 norm 1")
    assert all(np.array_equal(outcome.committed[name], outcome.base[name]) for name in outcome.base)
    assert record.report["dp"]["effective_noise_multiplier"] == 0.5 and record.report["dp"]["reported"] == 0


@pytest.mark.parametrize(
    ("placement", "named"),
    [
        (("--dp", "central"), "--dp central clips each device's delta on the coordinator"),
        (("--dp", "device", "--dp-clip-quantile", "0.5"), "--dp-clip-quantile adapts the clip"),
    ],
)
def test_dp_that_reads_single_updates_is_refused_under_secure_aggregation_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], placement: tuple[str, ...], named: str
) -> None:
    """Central DP (the coordinator would clip each delta, but sees only the sum: it would clip the mean as one) and
    an adaptive clip (each device's within-clip bit is hidden) stop `fl-coordinator run` before it starts."""
    secure = ("--strategy", "avefl", "--secure-aggregation", "secagg", "--secagg-sample-cap", "0")
    assert main(["run", "--rounds", "1", "--run-dir", str(tmp_path / "run"), *secure, *placement]) == 2
    error = capsys.readouterr().err.strip()
    assert error.startswith(f"fl-coordinator: {named}") and "\n" not in error
    assert not (tmp_path / "run" / "run.sqlite").exists()


def honest_total(weights: list[float], labels: list[int], fixed: FixedPoint) -> Weights:
    """The decoded sum of devices with these weights and labels, each delta coordinate at +-clip (the extreme an
    honest device can mask), as the fixed point encodes and adds them."""
    rows = [
        np.concatenate([weight * CLIP * np.array([1.0, -1.0, 0.5]), [weight * CLIP], [count * fixed.step]])
        for weight, count in zip(weights, labels)
    ]
    total = fixed.decode_sum(np.sum([fixed.encode(row) for row in rows], axis=0, dtype=np.uint32))
    return {"t": total[:3], WEIGHT: total[3:4], LABELS: total[4:5]}


@pytest.mark.parametrize(
    ("weights", "labels", "equal", "refusal"),
    [
        ([1.0, 1.0, 1.0], [3, 0, 7], True, None),
        ([1.0, 0.35, 0.0], [3, 0, 7], False, None),
        ([1.0, 1.0, 0.5], [0, 0, 0], True, "refused: the summed weight is 2.5, not the 3 survivors'"),
        ([0.0, 0.0, 0.0], [0, 0, 0], False, "refused: the summed weight 0 lies outside (0, 3]"),
        ([1.0, 1.0, 1.0], [0, -5, 0], True, "refused: the summed label coordinate"),
    ],
)
def test_the_sum_checks_pass_every_honest_extreme_and_name_what_failed(
    weights: list[float], labels: list[int], equal: bool, refusal: str | None
) -> None:
    """Honest sums at the clip's edge pass (with the fixed point's rounding); a cap-0 round whose weights are not
    all 1, a zero summed weight and negative labels are refused, each with its reason."""
    fixed = FixedPoint(CLIP, 3)
    found = sum_refusal(honest_total(weights, labels, fixed), 3, fixed, SumLimits(equal))
    assert (found, refusal) == (None, None) or (found and refusal and found.startswith(refusal))


@pytest.mark.parametrize("provisioned", [True, False], ids=["provisioned", "open-fleet"])
def test_a_device_whose_view_confirmations_do_not_check_is_the_one_left_out(
    broker, tmp_path: Path, provisioned: bool
) -> None:
    """Issue 43: the attacker masks an honest-looking input and sends every partner a view confirmation of random
    bytes. Each honest holder still gives the honest devices' seed shares and withholds only the attacker's, naming
    it (before, every holder refused the whole request and the round's reason named the honest devices). On a
    provisioned fleet the attacker signed those confirmations, which proves it sent them: each holder also gives its
    pairwise seed with it, the coordinator subtracts its masked input, and the round commits FedAvg of the three
    honest devices. On an open fleet nothing proves it: its self mask cannot come out of the sum, and the round is
    abandoned with a reason naming dev9 and no honest device. Either way dev9 is excluded in one bad_signature
    rejection (the store, the round's metrics, /metrics)."""
    outcome = attacked_round(broker, tmp_path, Setup(attack=honest_looking, bad_tags=True, provisioned=provisioned))
    with outcome.store as store:
        metrics = store.rounds()[0].metrics
        kinds = store.rejection_kinds()
        [(_, device, stored, _, _)] = store.rejections()
    assert (device, kinds, list(metrics["secagg_excluded"])) == (ATTACKER, {"bad_signature": 1}, [ATTACKER])
    named = re.match(r"'dev9' sent view confirmations that did not check at \[([^\]]*)\]", stored)
    holders = set(re.findall(r"'(dev\d)'", named.group(1))) if named else set()
    # the holders whose answers came before the unmasking closed (all three on a quiet machine, two on a busy one)
    assert len(holders) >= 2 and holders <= {"dev0", "dev1", "dev2"}, stored
    assert rejected(outcome, "bad_signature").endswith(" 1") and len(stored) <= 300
    if provisioned:
        assert (metrics["secure_aggregation"], metrics["secagg_survivors"]) == ("committed", 3)
        assert metrics["secagg_weight"] == pytest.approx(HONEST_WEIGHT, abs=TOLERANCE)
        honest = honest_sum(outcome)
        for name, base in outcome.base.items():
            expected = honest[name] / HONEST_WEIGHT
            np.testing.assert_allclose(outcome.committed[name] - base, expected, rtol=0, atol=TOLERANCE)
        return
    reason = metrics["secagg_reason"]
    assert metrics["secure_aggregation"] == "abandoned"
    assert reason.startswith("['dev9'] sent view confirmations that did not check") and len(reason) <= 300
    assert not any(repr(honest) in reason for honest in HONEST)
    assert all(np.array_equal(outcome.committed[name], outcome.base[name]) for name in outcome.base)
