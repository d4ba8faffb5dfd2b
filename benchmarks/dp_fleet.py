# Benchmark (issue 28): DP-FedAvg at fleet scale against the non-private run of the same invocation; prints JSON.
"""Runs `fl-bench simulate` with 500 virtual devices (pools of 50), 10% of them a round, on Type ii and Dirichlet 0.3
partitions, W0 from the server's --init-samples: the non-private run (AveFL; a fixed-size draw of the devices) and
DP-FedAvg calibrated to each target epsilon at delta 1e-5 over the run's rounds (dp_accounting's calibration chooses
the noise multiplier; Poisson sampling, as the accountant assumes), with the adaptive clip (median of the norms). For
every run: the final and per-round accuracy, the fleet's labels per round, and from the store the accountant's
epsilon, the clips and the noise multiplier; per setting, the seeds' curve against labels beside the non-private
run's (--out/dp_fleet.png).

    python benchmarks/dp_fleet.py --seeds 0 1 2 --rounds 20 --out /tmp/dpbench 2> progress.log
    python benchmarks/dp_fleet.py --from-runs progress.log --out /tmp/dpbench   # the curves of runs already made
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from label_efficiency import plot, summarise
from virtual_fleet import simulate_command

from coordinator.storage.store import RunStore
from protocol.dp_accountant import noise_for_epsilon

DELTA = 1e-5


def arguments() -> argparse.Namespace:
    """The fleet, the partitions, the targets, the seeds and where the runs go."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--devices", type=int, default=500)
    parser.add_argument("--participation", type=float, default=0.1)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--partitions", nargs="+", default=["type2", "dirichlet:0.3"])
    parser.add_argument("--epsilons", nargs="+", type=float, default=[8.0, 2.0])
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--placement", choices=("central", "device"), default="central")
    parser.add_argument("--clip", type=float, default=0.1, help="the first round's clip (adapted to the median)")
    parser.add_argument("--init-samples", type=int, default=500, help="the server's labelled samples for W0")
    parser.add_argument("--init-epochs", type=int, default=2)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument(
        "--from-runs", type=Path, help="summarise the run lines an earlier invocation printed on stderr (no new runs)"
    )
    return parser.parse_args()


def private_options(args: argparse.Namespace, epsilon: float | None) -> tuple[list[str], float | None]:
    """(the simulate flags of one setting, its noise multiplier): none for the non-private run."""
    if epsilon is None:
        return [], None
    noise = noise_for_epsilon(epsilon, DELTA, args.participation, args.rounds)
    flags = ["--dp", args.placement, "--dp-clip", str(args.clip), "--dp-noise-multiplier", f"{noise:.6f}"]
    return [*flags, "--dp-clip-quantile", "0.5", "--dp-delta", str(DELTA)], noise


def run_name(partition: str, seed: int, epsilon: float | None) -> str:
    """The folder of one run under --out."""
    return f"{partition.replace(':', '')}-seed{seed}-{'plain' if epsilon is None else f'eps{epsilon:g}'}"


def store_labels(run_dir: Path) -> list[int]:
    """The fleet's labels after each committed round (W0's included), from the run's store."""
    with RunStore(run_dir, read_only=True) as store:
        return [record.labels for record in store.rounds()]


def run_one(args: argparse.Namespace, partition: str, seed: int, epsilon: float | None) -> dict:
    """One simulate run and what its output and store say."""
    folder = args.out / run_name(partition, seed, epsilon)
    folder.mkdir(parents=True, exist_ok=True)
    dp_flags, noise = private_options(args, epsilon)
    extra = [*("--partition", partition, "--seed", str(seed), "--participation", str(args.participation)), *dp_flags]
    extra += ["--init-samples", str(args.init_samples), "--init-epochs", str(args.init_epochs)]
    started = time.monotonic()
    with open(folder / "simulate.log", "wb") as log_stream:
        done = subprocess.run(
            simulate_command(args.devices, args.rounds, folder / "run", [*extra, "--strategy", "avefl"]),
            stdout=subprocess.PIPE,
            stderr=log_stream,
            check=False,
        )
    lines = [json.loads(line) for line in done.stdout.decode().splitlines() if line.startswith("{")]
    rounds = [line for line in lines if "round" in line]
    with RunStore(folder / "run", read_only=True) as store:
        reports = [record.report.get("dp", {}) for record in store.rounds()]
    last = reports[-1] if reports else {}
    return {
        "partition": partition,
        "seed": seed,
        "target_epsilon": epsilon,
        "exit_code": done.returncode,
        "wall_seconds": round(time.monotonic() - started, 1),
        "rounds_completed": len(rounds),
        "final_accuracy": rounds[-1]["accuracy"] if rounds else None,
        "round_accuracy": [line["accuracy"] for line in rounds],
        "labels": store_labels(folder / "run"),
        "participants_per_round": [len(line["divergence"]) for line in rounds],
        "epsilon": last.get("epsilon"),
        "noise_multiplier": noise,
        "delta_noise_multiplier": last.get("delta_noise_multiplier"),
        "last_clip": last.get("clip"),
        "clips": [report.get("clip") for report in reports],
    }


def curves(runs: list[dict], out: Path) -> dict:
    """Per partition, per setting: the seeds' accuracy against labels (mean, band, AULC, final) beside the
    non-private run's, plotted to out/dp_fleet.png."""
    for run in runs:
        run["sampler"] = "non-private" if run["target_epsilon"] is None else f"epsilon {run['target_epsilon']:g}"
        run["accuracy"] = run["round_accuracy"]
        run.setdefault(
            "labels", store_labels(out / run_name(run["partition"], run["seed"], run["target_epsilon"]) / "run")
        )
    summary = summarise(runs, baseline="non-private")
    plot(summary, out / "dp_fleet.png", baseline="non-private")
    return summary


def main() -> None:
    """Every partition, seed and setting (non-private first): each run on stderr as it ends, one JSON object at the
    end with the curves (or, with --from-runs, the curves of runs already made)."""
    args = arguments()
    settings: list[float | None] = [None, *args.epsilons]
    runs = []
    if args.from_runs:
        runs = [json.loads(line) for line in args.from_runs.read_text().splitlines() if line.startswith("{")]
    for partition in [] if args.from_runs else args.partitions:
        for seed in args.seeds:
            for epsilon in settings:
                runs.append(run_one(args, partition, seed, epsilon))
                print(json.dumps(runs[-1]), file=sys.stderr, flush=True)  # progress: each run as it ends
    summary = {
        "devices": args.devices,
        "participation": args.participation,
        "rounds": args.rounds,
        "init_samples": args.init_samples,
        "init_epochs": args.init_epochs,
        "delta": DELTA,
        "placement": args.placement,
        "curves": curves(runs, args.out),
        "runs": runs,
    }
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
