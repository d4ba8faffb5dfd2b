# Label efficiency: samplers x partitions x seeds through the real bench; accuracy-against-labels curves, JSON and a PNG.
"""Every run is one `simulate` (agent processes, an embedded mosquitto, the coordinator and its store), so what
it measures is what a user runs. Per partition and sampler it reports, over the seeds:

  aulc           area under the learning curve: the mean test accuracy over the acquisition points
  final          the final test accuracy
  labels_to_random_final   the labels the sampler's mean curve needed to reach random's mean final accuracy,
                 and that as a fraction of random's labels (null where it never got there)
  weak_label_accuracy      (runs whose devices hold machine labels, FAST) the share of their last weak labels
                 that match the ground truth

Usage: python benchmarks/label_efficiency.py [--quick] [--samplers random entropy power-bald:power_beta=4 ...]
       [--partitions type2 dirichlet:0.3] [--seeds 0 1 2] [--epochs E] [--labels L] [--rounds R] [--pool P]
       [--jobs N] [--encoder FILE.onnx] [--lr-schedules constant cosine] [--local-rule R] [--strategy S] [--out DIR]
A sampler may carry recipe options after a colon (`NAME:key=value,key=value`); each spelling is its own curve.
A curve is named by the spelling followed by what else differs from the default run, joined by `+`: the local rule
(other than kept-labels), the strategy (other than avefl), the encoder's file stem (FAST with --encoder), and
`lr_schedule=NAME` (other than constant), e.g. `ksas+kcfu` or `margin+lr_schedule=cosine`.
The full default sweep takes hours on 2 cores; --jobs runs that many simulations side by side.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
from curves import plot, sampler_and_options, summarise

from bench.shard import Shard, load_shard
from bench.simulate import BenchSettings, simulate
from coordinator.intake.observer import RoundResult
from coordinator.rounds.rules import RoundPolicy
from coordinator.setup.settings import InitSettings, ServerSettings
from edge_agent.data.device_data import LABELS_FILE
from edge_agent.data.labelled_record import LabelledRecord
from edge_agent.learning.lr_schedules import LR_SCHEDULES
from edge_agent.learning.sampling import make_sampler
from protocol import messages


@dataclasses.dataclass(frozen=True)
class Scale:
    """How big one run is: devices per partition, pool per device, rounds, labels per acquisition, epochs."""

    devices: dict[str, int]
    pool: int
    rounds: int
    labels: int
    epochs: int
    mc_passes: int


FULL = Scale({"type2": 4, "dirichlet:0.3": 10}, pool=5000, rounds=10, labels=200, epochs=5, mc_passes=10)
QUICK = Scale({"type2": 2, "dirichlet:0.3": 3}, pool=300, rounds=3, labels=20, epochs=1, mc_passes=4)


DEFAULT_RULE, DEFAULT_STRATEGY, DEFAULT_SCHEDULE = messages.Recipe.local_rule, "avefl", messages.Recipe.lr_schedule


@dataclasses.dataclass(frozen=True)
class RunSpec:
    """One simulation of the sweep."""

    partition: str
    sampler: str
    seed: int
    strategy: str
    local_rule: str
    scale: Scale
    out: Path
    recipe: dict[str, Any] = dataclasses.field(default_factory=dict)  # other recipe fields, e.g. learning_rate
    strategy_options: dict[str, float] = dataclasses.field(default_factory=dict)
    encoder: Path | None = None  # FAST's frozen encoder; W0's penultimate layers without one

    @property
    def encoder_used(self) -> Path | None:
        """The encoder the run gives its sampler: --encoder where the sampler needs one (FAST), else None."""
        needs = make_sampler(sampler_and_options(self.sampler)[0]).needs_encoder
        return self.encoder if needs else None

    @property
    def curve(self) -> str:
        """The curve the run belongs to: the sampler's spelling, then what else differs from the default run (a local
        rule other than kept-labels, a strategy other than AveFL, the encoder file's stem, other recipe fields)."""
        encoder = self.encoder_used
        parts = [
            self.sampler,
            *([] if self.local_rule == DEFAULT_RULE else [self.local_rule]),
            *([] if self.strategy == DEFAULT_STRATEGY else [self.strategy]),
            *([] if encoder is None else [encoder.stem]),
            *(f"{key}={value}" for key, value in sorted(self.recipe.items())),
        ]
        return "+".join(parts)

    @property
    def name(self) -> str:
        """The run's directory name."""
        curve = re.sub(r"[^A-Za-z0-9.-]+", "_", self.curve)
        return f"{self.partition.replace(':', '')}-{curve}-seed{self.seed}"


def run_one(spec: RunSpec) -> dict[str, Any]:
    """One simulate run; its curve (labels, accuracy per round) and timing."""
    scale = spec.scale
    devices = scale.devices.get(spec.partition, 4)
    sampler, options = sampler_and_options(spec.sampler)
    settings = ServerSettings(
        run_dir=spec.out / spec.name,
        fleet=f"le-{spec.name}",
        strategy=spec.strategy,
        strategy_options=spec.strategy_options,
        recipe=dataclasses.replace(
            messages.Recipe(),
            sampler=sampler,
            options=options,
            local_rule=spec.local_rule,
            labels_per_acquisition=scale.labels,
            acquisitions_per_round=1,
            epochs=scale.epochs,
            mc_passes=scale.mc_passes,
            seed=spec.seed,
            **spec.recipe,
        ),
        policy=RoundPolicy(rounds=scale.rounds, min_devices=devices, quorum=devices, round_timeout=3600),
        init=InitSettings(samples=100, seed=spec.seed),
        torch_threads=1,
        encoder_path=spec.encoder_used,
        ship_bundles=False,
        evaluate_devices=False,
    )
    results: list[RoundResult] = []
    started = time.monotonic()
    bench = BenchSettings(devices=devices, partition=spec.partition, pool_size=scale.pool, seed=spec.seed)
    simulate(settings, bench, results.append)
    weak = weak_label_accuracy(settings.run_dir)
    return {
        "partition": spec.partition,
        "sampler": spec.curve,
        "seed": spec.seed,
        "devices": devices,
        "labels": [r.labels for r in results],
        "accuracy": [r.accuracy for r in results],
        "seconds": round(time.monotonic() - started, 1),
        **({} if weak is None else {"weak_label_accuracy": weak}),
    }


def finished_device(device: Path) -> tuple[Shard, LabelledRecord]:
    """A bench device's shard (its ground truth) and its labelled record as the run left them."""
    shard = load_shard(device / "shard.npz")
    return shard, LabelledRecord.load(device / "state" / LABELS_FILE, len(shard.all_labels))


def weak_label_accuracy(run_dir: Path) -> float | None:
    """The share of the devices' last weak (machine, e.g. FAST's kNN) labels that match their shard's ground truth;
    None where no device holds a weak label."""
    right = total = 0
    for device in sorted((run_dir / "devices").iterdir()):
        shard, record = finished_device(device)
        truth, weak = shard.all_labels, ~record.human
        right += int(np.sum(record.labels[weak] == truth[record.indices[weak]]))
        total += int(weak.sum())
    return round(right / total, 4) if total else None


def add_scale_options(parser: argparse.ArgumentParser) -> None:
    """--quick and the per-run overrides of a sweep's scale (shared by the benchmarks that drive simulate)."""
    parser.add_argument("--quick", action="store_true", help="a smoke run: tiny pools, few rounds")
    for key, meaning in (("epochs", "local epochs"), ("labels", "labels per acquisition"), ("rounds", "rounds")):
        parser.add_argument(f"--{key}", type=int, help=f"{meaning} (overrides the scale's)")
    parser.add_argument("--pool", type=int, help="pool per device (overrides the scale's)")


def scale_of(args: argparse.Namespace, quick: Scale = QUICK, full: Scale = FULL) -> Scale:
    """The quick or full scale with the command line's overrides."""
    scale = quick if args.quick else full
    overrides = {key: getattr(args, key) for key in ("epochs", "labels", "rounds", "pool") if getattr(args, key)}
    return dataclasses.replace(scale, **overrides)


def sweep(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Runs the chosen simulations (side by side with --jobs), printing each finished run as one JSON line."""
    scale = scale_of(args)
    specs = [
        RunSpec(partition, sampler, seed, args.strategy, args.local_rule, scale, args.out, recipe, encoder=args.encoder)
        for partition in args.partitions
        for seed in args.seeds
        for sampler in args.samplers
        for recipe in (
            {} if schedule == DEFAULT_SCHEDULE else {"lr_schedule": schedule} for schedule in args.lr_schedules
        )
    ]
    runs = []
    with ProcessPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        for run in pool.map(run_one, specs):
            runs.append(run)
            print(json.dumps({"progress": f"{len(runs)}/{len(specs)}", "run": run}), flush=True)
    return runs


def main() -> None:
    """Runs the sweep (or re-reads the run lines of earlier sweeps), writes the JSON and the PNG, prints the summary."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_scale_options(parser)
    parser.add_argument("--samplers", nargs="+", default=["random", "margin", "entropy", "power-entropy", "badge"])
    parser.add_argument("--partitions", nargs="+", default=["type2", "dirichlet:0.3"])
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--strategy", default=DEFAULT_STRATEGY)
    parser.add_argument("--local-rule", default=DEFAULT_RULE)
    parser.add_argument(
        "--lr-schedules",
        nargs="+",
        default=[DEFAULT_SCHEDULE],
        choices=LR_SCHEDULES,
        help="local learning-rate schedules, each its own curve (SPELLING+lr_schedule=NAME where not constant)",
    )
    parser.add_argument("--jobs", type=int, default=1, help="simulations run side by side")
    parser.add_argument(
        "--encoder",
        type=Path,
        help="frozen encoder ONNX for the samplers that need one (e.g. `fl-coordinator encoder`)",
    )
    parser.add_argument("--from-lines", nargs="+", type=Path, help="summarise the run lines these files hold instead")
    parser.add_argument("--no-plot", action="store_true", help="skip the PNG (no matplotlib where it runs)")
    parser.add_argument("--baseline", default="random", help="the spelling the others are measured against")
    parser.add_argument("--out", type=Path, default=Path("runs") / f"label-efficiency-{time.strftime('%Y%m%d-%H%M%S')}")
    args = parser.parse_args()
    runs = read_run_lines(args.from_lines) if args.from_lines else sweep(args)
    summary = summarise(runs, args.baseline)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "label_efficiency.json").write_text(json.dumps({"summary": summary, "runs": runs}, indent=1))
    if not args.no_plot:
        plot(summary, args.out / "label_efficiency.png", args.baseline)
    brief = {
        p: {s: {k: v for k, v in c.items() if k not in CURVE_KEYS} for s, c in cs.items()} for p, cs in summary.items()
    }
    print(json.dumps({"summary": brief, "out": str(args.out)}, indent=1))


CURVE_KEYS = ("labels", "mean", "low", "high")


def read_run_lines(paths: list[Path]) -> list[dict[str, Any]]:
    """The runs of earlier sweeps' progress lines (other lines are skipped)."""
    runs = []
    for path in paths:
        for line in path.read_text().splitlines():
            if line.startswith('{"progress"'):
                runs.append(json.loads(line)["run"])
    return runs


if __name__ == "__main__":
    main()
