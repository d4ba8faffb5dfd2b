# The secure round mode: each round's SecAgg+ stages over the devices it selected, on top of another mode's plan.
from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

from coordinator.intake.update_intake import UpdateIntake
from coordinator.rounds.mode import Opening, RoundMode, RoundPlan, StagedRound
from coordinator.rounds.rules import RoundRules
from coordinator.secure.rounds import HeldMessages, LiveParts, LiveSecureRound, start_secure
from coordinator.secure.secagg_bounds import sum_limits
from coordinator.strategies.contract import Strategy
from protocol.mqtt import MqttSession
from protocol.tensors import Weights


class SecureMode(RoundMode):
    """Secure rounds: every round runs SecAgg+'s stages over the devices it selected (fixed when it opens, so it
    waits for --min-devices and at least two), resumed if a previous process saved it; its sample, aggregator and
    budget are those of the mode it wraps (plain, or private: DP noise on the secure sum). Stage messages that come
    while no round is open are held for the next one. `identities` (a provisioned fleet's identity public keys)
    check each key advert's signature; empty, adverts go unchecked (an open fleet, run only when its operator said
    so: see coordinator.setup.settings.check_fleet_logins)."""

    def __init__(
        self,
        planned: RoundMode,
        session: MqttSession,
        fleet: str,
        intake: UpdateIntake,
        identities: Mapping[str, bytes] | None = None,
    ) -> None:
        self.planned = planned
        self.session, self.fleet, self.intake = session, fleet, intake
        self.identities = dict(identities or {})
        self.held = HeldMessages()

    def exhausted(self, round_id: int) -> bool:
        """As the wrapped mode says."""
        return self.planned.exhausted(round_id)

    def fewest_online(self, rules: RoundRules) -> int:
        """--min-devices, and at least two: a round's devices are those online when it opens."""
        return max(rules.policy.min_devices, 2)

    def plan(self, rules: RoundRules, strategy: Strategy, opening: Opening) -> RoundPlan:
        """The wrapped mode's plan."""
        return self.planned.plan(rules, strategy, opening)

    def staged(
        self, rules: RoundRules, run_id: str, round_id: int, model: Weights, selected: list[str]
    ) -> StagedRound | None:
        """The round's secure part over the `selected` devices (resumed if saved), with what was held for it."""
        start = functools.partial(
            start_secure, run_id, round_id, selected, model, rules.spec, rules.recipe, self.identities
        )
        limits = sum_limits(rules.recipe, len(selected))
        parts = LiveParts(self.session, self.fleet, self.intake, limits, rules.recipe.secagg_sample_cap)
        live = LiveSecureRound.opened(parts, start, round_id)
        self.held.release(live)
        return live

    def hold(self, device_id: str, payload: bytes) -> None:
        """Holds a stage message for the next round (within HeldMessages' bound)."""
        self.held.hold(device_id, payload)

    def committed(self, report: dict[str, Any]) -> None:
        """As the wrapped mode takes it."""
        self.planned.committed(report)
