# What every round of a run follows: when a round may close (the policy), the recipe, suspects, signatures, spec.
from __future__ import annotations

from dataclasses import dataclass, field

from coordinator.intake.authentication import UpdateAuthenticator
from coordinator.intake.round_aggregator import SuspectPolicy
from coordinator.strategies.contract import Strategy
from edge_agent.loop.schedule import labels_by_round
from protocol import messages, wire
from protocol.errors import UsageError
from protocol.model_spec import DEFAULT_SPEC, ModelSpec

DEFAULT_BATCH = 32  # messages handled per group commit at most (also the broker's in-flight window for us)


@dataclass(frozen=True)
class RoundPolicy:
    """When a round may close: the quorum, the minimum and the deadline; and how many messages one group commit of
    the spool takes at most (`batch`)."""

    rounds: int
    min_devices: int = 1
    quorum: int | None = None
    round_timeout: float = 600.0
    max_update_bytes: int = wire.DEFAULT_MAX_MESSAGE_BYTES
    participation: float = 1.0
    batch: int = DEFAULT_BATCH

    def __post_init__(self) -> None:
        if self.batch < 1:
            raise UsageError(f"--spool-batch must be at least 1, got {self.batch}")
        if not 0.0 < self.participation <= 1.0:
            raise UsageError(f"--participation must lie in (0, 1], got {self.participation}")
        if self.rounds < 1:
            raise UsageError(f"--rounds must be at least 1, got {self.rounds}")
        if self.min_devices < 1:
            raise UsageError(f"--min-devices must be at least 1, got {self.min_devices}")
        if self.quorum is not None and self.quorum < self.min_devices:
            raise UsageError(f"--quorum {self.quorum} is below --min-devices {self.min_devices}")
        if self.round_timeout <= 0:
            raise UsageError(f"--round-timeout must be positive, got {self.round_timeout}")


@dataclass(frozen=True)
class RoundRules:
    """What every round follows: the recipe devices get, when rounds close, how suspects are treated, and who may
    send (None: any device; else signed updates of provisioned devices only), and the model spec (class count).

    For a strategy that weighs by samples: `seed_labels`, the labels a device holds before round 1 (None: unknown,
    so no per-device bound), and `max_sample_share`, the most of a round's weight one device's claim may carry where
    no such bound is known (1: no cap; the command lines default to DEFAULT_MAX_SAMPLE_SHARE). `relays`: the devices
    whose updates may name contributors (--relay); any other device's that does is refused."""

    recipe: messages.Recipe
    policy: RoundPolicy
    suspects: SuspectPolicy = field(default_factory=SuspectPolicy)
    authenticator: UpdateAuthenticator | None = None
    spec: ModelSpec = DEFAULT_SPEC
    seed_labels: int | None = None
    max_sample_share: float = 1.0
    relays: tuple[str, ...] = ()


def sample_bounds(rules: RoundRules, strategy: Strategy, round_id: int) -> tuple[int, int | None]:
    """(fewest, most) samples one device may claim in this round: at least 1 and at most its seeds plus what the
    schedule let it acquire so far when the strategy weighs by samples (no bound where either is unknown)."""
    if not strategy.weighs_by_samples:
        return 0, None
    acquired = labels_by_round(rules.recipe, round_id)
    seeds = rules.seed_labels
    return 1, (None if acquired is None or seeds is None else seeds + acquired)
