# A run's settings: what the coordinator needs to run a fleet's rounds, checked as one value.
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

from coordinator.asynchronous.intake import AsyncPolicy
from coordinator.asynchronous.rounds import check_async_settings
from coordinator.fleet.provision import load_secure_fleet
from coordinator.intake.round_aggregator import SuspectPolicy
from coordinator.privacy.rounds import DpSettings, check_dp_settings
from coordinator.rounds.promotion import PromotionGate
from coordinator.rounds.rules import RoundPolicy
from coordinator.strategies.aggregate import DEFAULT_MAX_SAMPLE_SHARE
from coordinator.strategies.registry import STRATEGIES
from protocol import messages
from protocol.errors import UsageError
from protocol.model_spec import DEFAULT_SPEC, ModelSpec
from protocol.trained_set import POOL_STATISTICS, STATISTICS_RULE


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
    secagg_open_fleet_unsafe: bool = False  # secure aggregation without per-device logins: see check_fleet_logins

    def __post_init__(self) -> None:
        check_dp_settings(self.recipe, self.strategy, self.suspects, self.asynchronous is not None, self.dp)
        if self.asynchronous is not None:
            check_async_settings(self.strategy, self.suspects, self.policy.participation)
        check_sample_settings(self.seed_labels, self.max_sample_share)
        check_statistics_settings(self.strategy, self.recipe, self.spec.trainable)
        if self.recipe.secure_aggregation != "off":
            from coordinator.secure.rounds import check_secure_settings  # cryptography: loaded by secure runs only

            check_secure_settings(self.strategy, self.recipe, self.suspects, self.asynchronous is not None)


def check_statistics_settings(strategy: str, recipe: messages.Recipe, trainable: str) -> None:
    """UsageError (one line) unless a statistics strategy and the class-statistics rule come together, on a spec that
    trains the classifier alone (a relay then sends its site's mean statistics: pooled_head.SiteStatistics); and unless
    the pools' statistics come with rounds that do not acquire (the only rounds that use them)."""
    statistics = strategy in STRATEGIES and STRATEGIES.get(strategy).statistics
    if statistics != (recipe.local_rule == STATISTICS_RULE):
        fitting = ", ".join(STRATEGIES.select(lambda known: known.statistics))
        raise UsageError(
            f"--strategy {fitting} and --local-rule {STATISTICS_RULE} go together: one fits the head from the "
            "statistics the other sends"
        )
    if statistics and trainable != "head":
        raise UsageError(
            f"--strategy {strategy} fits a linear head: the model spec must train the head alone (a spec that trains "
            "more: average the trained models, --strategy avefl --local-rule kept-labels)"
        )
    if recipe.options.get(POOL_STATISTICS) and recipe.rounds_per_acquisition < 2:
        raise UsageError(
            "--pool-statistics 1 refines the head in rounds without new labels: set --rounds-per-acquisition 2 "
            "(each acquisition's round, then one that refines)"
        )


OPEN_FLEET_FLAG = "--secagg-open-fleet-unsafe"


def check_fleet_logins(settings: ServerSettings) -> None:
    """UsageError (one line) for secure aggregation on a fleet without per-device logins and identity keys (no
    --secure), unless the operator passed OPEN_FLEET_FLAG: there any client may advertise keys under an honest
    device's id before it does and rebuild that device's update from the shares it is sent, which the signed key
    adverts of a provisioned fleet prevent."""
    if settings.recipe.secure_aggregation == "off" or settings.secure_dir is not None:
        return
    if not settings.secagg_open_fleet_unsafe:
        raise UsageError(
            "--secure-aggregation needs per-device logins and identity keys (--secure DIR from `fl-coordinator "
            f"provision`): on an open fleet an impostor's key advert recovers honest updates ({OPEN_FLEET_FLAG} "
            "accepts that)"
        )


def fleet_identities(settings: ServerSettings) -> dict[str, bytes]:
    """The identity public keys a secure run checks key adverts with: its provisioned fleet's. A run without per-device
    logins, or on a fleet provisioned before identity keys, is refused (one line) unless its operator passed
    OPEN_FLEET_FLAG: then adverts go unchecked."""
    check_fleet_logins(settings)
    if settings.secure_dir is None:
        return {}
    identities = load_secure_fleet(settings.secure_dir).identities
    if not identities and not settings.secagg_open_fleet_unsafe:
        raise UsageError(
            f"{settings.secure_dir} holds no device identity keys (provisioned before them): provision the fleet "
            f"again for --secure-aggregation, or pass {OPEN_FLEET_FLAG}"
        )
    return identities


def check_sample_settings(seed_labels: int | None, max_sample_share: float) -> None:
    """ValueError naming the flag when the seed count is negative or the share cap lies outside (0, 1]."""
    if seed_labels is not None and seed_labels < 0:
        raise ValueError(f"--seed-labels must be at least 0, got {seed_labels}")
    if not 0.0 < max_sample_share <= 1.0:
        raise ValueError(f"--max-sample-share must lie in (0, 1], got {max_sample_share}")


def settings_as_dict(settings: ServerSettings) -> dict:
    """JSON-able settings for the store (paths as strings)."""
    return {key: str(value) if isinstance(value, Path) else value for key, value in asdict(settings).items()}
