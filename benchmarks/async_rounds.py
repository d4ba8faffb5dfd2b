# Asynchronous against synchronous rounds with slow devices: accuracy against wall time, JSON and a PNG.
"""Every run is one `simulate` (agent processes, an embedded mosquitto, the coordinator and its store). Per seed
the same fleet (devices, partition, pools, recipe, a seeded --slow-fraction of the devices --slow-factor times
slower) runs synchronously (every round waits for every device) and asynchronously (FedBuff: a version every
--buffer updates), with the same number of device updates (hence the same label budget: rounds x devices), or
--async-budget times as many, so that time-to-accuracy is not cut off where the updates run out.

Reported per seed and mode: the curve (seconds since the first announcement, test accuracy, labels) read from the
run's store, and the final accuracy; per seed, the seconds (and labels) each mode took to first reach the
synchronous run's final accuracy (the synchronous run itself: its last round) and the ratio of the seconds.

Usage: python benchmarks/async_rounds.py [--seeds 0 1 2] [--devices 10] [--rounds 5] [--buffer 5]
       [--max-staleness 10] [--server-lr 1] [--async-budget 1] [--slow-fraction 0.2] [--slow-factor 5]
       [--partition type1] [--pool 400] [--labels 20] [--epochs 2] [--mc-passes 4] [--out DIR] [--no-plot]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.simulate import BenchSettings, simulate, slow_devices
from coordinator.asynchronous.intake import AsyncPolicy
from coordinator.rounds.rules import RoundPolicy
from coordinator.setup.settings import InitSettings, ServerSettings
from coordinator.storage.store import RunStore
from protocol import messages


def settings_for(args: argparse.Namespace, seed: int, mode: str) -> ServerSettings:
    """One run's coordinator settings: synchronous rounds over every device, or FedBuff with the same updates."""
    asynchronous = None
    rounds = args.rounds
    if mode == "async":
        asynchronous = AsyncPolicy(args.buffer, args.max_staleness, args.server_lr)
        rounds = math.ceil(args.rounds * args.devices * args.async_budget / args.buffer)
    return ServerSettings(
        run_dir=args.out / f"{mode}-seed{seed}",
        fleet=f"async-{mode}-{seed}",
        strategy="avefl",
        recipe=dataclasses.replace(
            messages.Recipe(),
            sampler=args.sampler,
            labels_per_acquisition=args.labels,
            epochs=args.epochs,
            mc_passes=args.mc_passes,
            seed=seed,
        ),
        policy=RoundPolicy(rounds=rounds, min_devices=1, quorum=args.devices, round_timeout=3600),
        init=InitSettings(samples=100, seed=seed),
        test_samples=args.test_samples,
        torch_threads=1,
        ship_bundles=False,
        evaluate_devices=False,
        asynchronous=asynchronous,
    )


def run_one(args: argparse.Namespace, seed: int, mode: str) -> dict[str, Any]:
    """One simulate run; its curve read back from the store (seconds since the first announcement)."""
    settings = settings_for(args, seed, mode)
    bench = BenchSettings(
        devices=args.devices,
        partition=args.partition,
        pool_size=args.pool,
        seed=seed,
        slow_fraction=args.slow_fraction,
        slow_factor=args.slow_factor,
    )
    started = time.monotonic()
    simulate(settings, bench, lambda result: None)
    with RunStore(settings.run_dir, read_only=True) as store:
        rounds = store.rounds()
    start = rounds[0].started_at
    staleness = [item["staleness"] for record in rounds for item in record.report.get("folded", [])]
    return {
        "mode": mode,
        "seed": seed,
        "slow_devices": sorted(slow_devices(bench)),
        "seconds": [round(record.closed_at - start, 2) for record in rounds],
        "accuracy": [record.accuracy for record in rounds],
        "labels": [record.labels for record in rounds],
        "updates": sum(record.accepted for record in rounds),
        "staleness": {str(tau): staleness.count(tau) for tau in sorted(set(staleness))},
        "wall_seconds": round(time.monotonic() - started, 1),
    }


def first_reach(run: dict[str, Any], target: float) -> tuple[float, int] | tuple[None, None]:
    """(seconds, labels) when the run's accuracy first reached `target`; (None, None) if it never did."""
    reached = [(s, n) for s, a, n in zip(run["seconds"], run["accuracy"], run["labels"]) if a >= target]
    return reached[0] if reached else (None, None)


def compare(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per seed: the synchronous final accuracy, each mode's seconds to reach it and the ratio; then the means."""
    seeds = sorted({run["seed"] for run in runs})
    per_seed = []
    for seed in seeds:
        sync = next(run for run in runs if run["seed"] == seed and run["mode"] == "sync")
        asynchronous = next(run for run in runs if run["seed"] == seed and run["mode"] == "async")
        target = sync["accuracy"][-1]
        (sync_seconds, sync_labels), (async_seconds, async_labels) = (
            first_reach(sync, target),
            first_reach(asynchronous, target),
        )
        per_seed.append(
            {
                "seed": seed,
                "sync_final": round(target, 4),
                "async_final": round(asynchronous["accuracy"][-1], 4),
                "async_best": round(max(asynchronous["accuracy"]), 4),
                "sync_seconds_to_sync_final": sync_seconds,
                "async_seconds_to_sync_final": async_seconds,
                "async_over_sync_time": None if async_seconds is None else round(async_seconds / sync_seconds, 3),
                "sync_labels_at_sync_final": sync_labels,
                "async_labels_at_sync_final": async_labels,
                "sync_total_seconds": sync["seconds"][-1],
                "async_total_seconds": asynchronous["seconds"][-1],
            }
        )
    ratios = [row["async_over_sync_time"] for row in per_seed if row["async_over_sync_time"] is not None]
    return {
        "per_seed": per_seed,
        "seeds_where_async_reached_sync_final": len(ratios),
        "mean_async_over_sync_time": round(float(np.mean(ratios)), 3) if ratios else None,
        "mean_sync_final": round(float(np.mean([row["sync_final"] for row in per_seed])), 4),
        "mean_async_final": round(float(np.mean([row["async_final"] for row in per_seed])), 4),
    }


def plot(runs: list[dict[str, Any]], path: Path) -> None:
    """Test accuracy against wall time, one line per run (sync solid, async dashed), one colour per seed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(7, 4.5))
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for run in runs:
        style = "-" if run["mode"] == "sync" else "--"
        colour = colours[run["seed"] % len(colours)]
        axis.plot(
            run["seconds"], run["accuracy"], style, color=colour, marker=".", label=f"{run['mode']} seed {run['seed']}"
        )
    axis.set(xlabel="seconds since the first announcement", ylabel="test accuracy")
    axis.set_title("synchronous rounds vs FedBuff, 20% of devices 5x slower", fontsize=10)
    axis.grid(alpha=0.3)
    axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def parse_args() -> argparse.Namespace:
    """The bench's settings."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--devices", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=5, help="synchronous rounds (async: rounds x devices / buffer)")
    parser.add_argument("--buffer", type=int, default=5)
    parser.add_argument("--max-staleness", type=int, default=10)
    parser.add_argument("--server-lr", type=float, default=1.0)
    parser.add_argument(
        "--async-budget",
        type=float,
        default=1.0,
        help="async device updates as a multiple of the synchronous run's (1: the same labels; 2: room to run on "
        "past the synchronous run's wall time, so time-to-accuracy is measured, not cut off at equal updates)",
    )
    parser.add_argument("--slow-fraction", type=float, default=0.2)
    parser.add_argument("--slow-factor", type=float, default=5.0)
    parser.add_argument("--partition", default="type1")
    parser.add_argument("--sampler", default="margin")
    parser.add_argument("--pool", type=int, default=400)
    parser.add_argument("--labels", type=int, default=20)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--mc-passes", type=int, default=4)
    parser.add_argument("--test-samples", type=int, default=2000)
    parser.add_argument("--out", type=Path, default=Path("runs") / f"async-rounds-{time.strftime('%Y%m%d-%H%M%S')}")
    parser.add_argument("--no-plot", action="store_true", help="skip the PNG")
    return parser.parse_args()


def main() -> None:
    """Runs each seed in both modes, prints each run and then the comparison as JSON lines, and writes the JSON and
    the figure to --out."""
    args = parse_args()
    runs = []
    for seed in args.seeds:
        for mode in ("sync", "async"):
            run = run_one(args, seed, mode)
            print(json.dumps({"run": run}), flush=True)
            runs.append(run)
    settings = {key: str(value) if isinstance(value, Path) else value for key, value in vars(args).items()}
    result = {"settings": settings, "runs": runs, "comparison": compare(runs)}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "async_rounds.json").write_text(json.dumps(result, indent=1))
    if not args.no_plot:
        plot(runs, args.out / "async_rounds.png")
    print(json.dumps(result["comparison"]), flush=True)


if __name__ == "__main__":
    main()
