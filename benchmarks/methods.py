# Compares the FAL methods through the real bench (agents, broker, store): accuracy against labels; prints JSON.
"""KAFAL-style comparison on Fashion-MNIST: 10 devices, participation 0.8, 10% random initial labels, 5% more
at the start of each of the active rounds that follow, several seeds, mean and standard deviation.

A configuration is NAME=SAMPLER:LOCAL_RULE:STRATEGY[@PARTITION] (partition default dirichlet:0.1). Defaults:
  sampler side (dirichlet:0.1)  random, entropy, bald (local SGD = fedprox with mu 0, FedAvg),
                                ksas+kcfu (KAFAL), fast (FAST weak + human labels, fedprox mu 0)
  aggregation side (clusters:3) fedavg, cadis (cadis-kd), fmlu (dmlu), all with random sampling
A configuration naming a sampler, rule, strategy or partition this checkout does not know is skipped with a
one-line reason on stderr and in the JSON ("skipped"), and the others still run.

Scale (one full run must stay under 60 minutes on 2 cores, so the pool and the rounds are smaller than the
paper's; the JSON's "settings" says what was used): --pool-size per device, --rounds-per-active-round T,
--active-rounds A (acquisitions after the initial active round), --epochs, --test-samples.

Usage: python benchmarks/methods.py [--configs NAME=... ...] [--seeds 0 1 2] [--out runs/bench-methods]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from bench.partition import partition_indices
from bench.simulate import BenchSettings, simulate
from coordinator.intake.observer import RoundResult
from coordinator.rounds.rules import RoundPolicy
from coordinator.setup.settings import InitSettings, ServerSettings
from coordinator.strategies.registry import make_strategy
from edge_agent.learning.local_rules import make_local_rule
from edge_agent.learning.sampling import make_sampler
from protocol import messages

DEFAULT_CONFIGS = (
    "random=random:fedprox:fedavg",
    "entropy=entropy:fedprox:fedavg",
    "bald=bald:fedprox:fedavg",
    "ksas+kcfu=ksas:kcfu:fedavg",
    "fast=fast:fedprox:fedavg",
    "fedavg=random:fedprox:fedavg@clusters:3",
    "cadis=random:cadis-kd:cadis@clusters:3",
    "fmlu=random:dmlu:fmlu@clusters:3",
)


@dataclass(frozen=True)
class Config:
    """One method combination of the comparison."""

    name: str
    sampler: str
    local_rule: str
    strategy: str
    partition: str = "dirichlet:0.1"


@dataclass(frozen=True)
class Scale:
    """How big each run is (chosen so that the default full run fits in an hour on 2 cores)."""

    devices: int = 10
    participation: float = 0.8
    pool_size: int = 200
    initial_label_fraction: float = 0.1
    label_fraction: float = 0.05
    active_rounds: int = 5
    rounds_per_active_round: int = 2
    epochs: int = 2
    batch_size: int = 16
    learning_rate: float = 0.01
    mc_passes: int = 5
    test_samples: int = 2000
    init_samples: int = 100

    @property
    def rounds(self) -> int:
        """The initial active round (training on the random labels alone) plus one per acquisition."""
        return (self.active_rounds + 1) * self.rounds_per_active_round


def parse_config(text: str) -> Config:
    """NAME=SAMPLER:RULE:STRATEGY[@PARTITION] -> Config; ValueError saying what is malformed."""
    name, _, spec = text.partition("=")
    spec, _, partition = spec.partition("@")
    parts = spec.split(":")
    if not name or len(parts) != 3 or not all(parts):
        raise ValueError(f"configuration {text!r} is not NAME=SAMPLER:LOCAL_RULE:STRATEGY[@PARTITION]")
    sampler, local_rule, strategy = parts
    return Config(name, sampler, local_rule, strategy, partition=partition or "dirichlet:0.1")


def unknown_part(config: Config, devices: int) -> str | None:
    """Why this checkout cannot run the configuration with this many devices (an unknown name, a partition
    that does not fit), or None when it can."""
    try:
        make_sampler(config.sampler)
        make_local_rule(config.local_rule)
        make_strategy(config.strategy)
        partition_indices(np.repeat(np.arange(10), 10 * devices), config.partition, devices, np.random.default_rng(0))
    except ValueError as error:
        return str(error)
    return None


def methods_recipe(config: Config, scale: Scale, seed: int) -> messages.Recipe:
    """The round recipe of a configuration at this scale: labels by fraction of each device's data."""
    return messages.Recipe(
        sampler=config.sampler,
        local_rule=config.local_rule,
        labels_per_acquisition=0,
        epochs=scale.epochs,
        batch_size=scale.batch_size,
        learning_rate=scale.learning_rate,
        mc_passes=scale.mc_passes,
        seed=seed,
        options={"mu": 0.0} if config.local_rule == "fedprox" else {},
        rounds_per_acquisition=scale.rounds_per_active_round,
        initial_label_fraction=scale.initial_label_fraction,
        label_fraction=scale.label_fraction,
    )


def run_one(config: Config, scale: Scale, seed: int, out: Path) -> dict:
    """One bench run of a configuration; accuracy and the labelled fraction after every round."""
    settings = ServerSettings(
        run_dir=out / f"{config.name}-seed{seed}",
        fleet=f"methods-{seed}",
        strategy=config.strategy,
        recipe=methods_recipe(config, scale, seed),
        policy=RoundPolicy(rounds=scale.rounds, min_devices=1, round_timeout=1800, participation=scale.participation),
        init=InitSettings(samples=scale.init_samples, seed=seed),
        validation_samples=0,
        test_samples=scale.test_samples,
        evaluate_devices=False,
        torch_threads=1,
    )
    results: list[RoundResult] = []
    started = time.monotonic()
    bench = BenchSettings(
        devices=scale.devices, partition=config.partition, pool_size=scale.pool_size, seed=seed, seed_per_class=0
    )
    simulate(settings, bench, results.append)
    return {**curves(results, scale), "seconds": round(time.monotonic() - started, 1)}


def curves(results: list[RoundResult], scale: Scale) -> dict:
    """Accuracy per round and per active round, the labelled fraction and the labels reported per active round."""
    active = [r for r in results if r.round_id % scale.rounds_per_active_round == 0]
    return {
        "accuracy_per_round": [r.accuracy for r in results],
        "accuracy_per_active_round": [r.accuracy for r in active],
        "label_fraction_per_active_round": [
            round(scale.initial_label_fraction + index * scale.label_fraction, 4) for index in range(len(active))
        ],
        "labels_reported": [r.labels for r in active],
        "final_accuracy": results[-1].accuracy,
    }


def summarise(runs: list[dict]) -> dict:
    """Mean and standard deviation over seeds, per active round and at the end."""
    per_active = np.array([run["accuracy_per_active_round"] for run in runs])
    finals = np.array([run["final_accuracy"] for run in runs])
    return {
        "label_fraction": runs[0]["label_fraction_per_active_round"],
        "accuracy_mean": per_active.mean(axis=0).round(4).tolist(),
        "accuracy_std": per_active.std(axis=0).round(4).tolist(),
        "final_mean": round(float(finals.mean()), 4),
        "final_std": round(float(finals.std()), 4),
        "seconds": round(sum(run["seconds"] for run in runs), 1),
    }


def run_config(config: Config, scale: Scale, seeds: list[int], out: Path) -> dict:
    """Every seed of one configuration (a progress line each), with the summary over them."""
    runs = []
    for seed in seeds:
        runs.append(run_one(config, scale, seed, out))
        progress = {"progress": config.name, "seed": seed, **{k: runs[-1][k] for k in ("final_accuracy", "seconds")}}
        print(json.dumps(progress), flush=True)
    return {"config": asdict(config), **summarise(runs), "runs": runs}


def main() -> int:
    """Runs every runnable configuration for every seed and prints one JSON document (progress lines first)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--configs", nargs="+", default=list(DEFAULT_CONFIGS), help="NAME=SAMPLER:RULE:STRATEGY[@PARTITION]"
    )
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--out", type=Path, default=Path("runs") / f"bench-methods-{time.strftime('%Y%m%d-%H%M%S')}")
    for field_name, default in asdict(Scale()).items():
        parser.add_argument(f"--{field_name.replace('_', '-')}", type=type(default), default=default)
    args = parser.parse_args()
    scale = Scale(**{name: getattr(args, name) for name in asdict(Scale())})
    try:
        configs = [parse_config(text) for text in args.configs]
    except ValueError as error:
        print(f"methods.py: {error}", file=sys.stderr)
        return 2
    skipped = {config.name: reason for config in configs if (reason := unknown_part(config, scale.devices)) is not None}
    for name, reason in skipped.items():
        print(f"methods.py: skipping configuration {name!r}: {reason}", file=sys.stderr, flush=True)
    started = time.monotonic()
    results = {
        config.name: run_config(config, scale, args.seeds, args.out) for config in configs if config.name not in skipped
    }
    print(
        json.dumps(
            {
                "settings": {**asdict(scale), "rounds": scale.rounds, "seeds": args.seeds},
                "results": results,
                "skipped": skipped,
                "seconds": round(time.monotonic() - started, 1),
            },
            indent=1,
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
