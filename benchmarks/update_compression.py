# Update compression: bytes per update and final accuracy of float32, fp16 and int8 deltas through the real bench.
"""Every run is one `simulate` (agent processes, an embedded mosquitto, the coordinator and its store), driven by
label_efficiency's run_one; only the recipe's update encoding differs between the runs of a seed. Per partition
and encoding it reports, over the seeds:

  bytes_per_update   the mean size of the accepted update messages as the coordinator received them (RunStore)
  bytes_per_parameter  that over the model's parameter count (what is above 4, 2 or 1 is the message's envelope:
                     ids, hashes, nonce, counts, metrics, tensor headers and int8's scales)
  bytes_ratio        that over float32's (the baseline, measured in the same sweep)
  final, final_std   the final test accuracy
  cost_points        float32's final minus this encoding's, in accuracy points (mean over paired seeds)

and checks the issue's bounds: fp16 at most 0.5x the bytes at a cost of at most 0.5 points, int8 at most 0.27x
at a cost of at most 1 point.

Usage: python benchmarks/update_compression.py [--quick] [--partitions type2 type1] [--seeds 0 1 2]
       [--encodings float32 fp16 int8 int8-channel int8-channel-top10 fp16+deflate int8+deflate] [--epochs E]
       [--labels L] [--rounds R] [--pool P] [--jobs N] [--from-lines EARLIER_LOG ...] [--out DIR]
(float32, the baseline, joins the sweep unless --from-lines brings its runs from an earlier sweep.)
"""

from __future__ import annotations

import argparse
import json
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
from curves import curve_of
from label_efficiency import RunSpec, Scale, add_scale_options, read_run_lines, run_one, scale_of

from coordinator.storage.store import RunStore

ENCODINGS: dict[str, dict[str, Any]] = {
    "float32": {},
    "fp16": {"update_encoding": "fp16-delta"},
    "int8": {"update_encoding": "int8-delta"},
    "int8-channel": {"update_encoding": "int8-delta", "update_scales": "channel"},
    "int8-channel-top10": {"update_encoding": "int8-delta", "update_scales": "channel", "update_top_k": 0.1},
    "fp16+deflate": {"update_encoding": "fp16-delta", "update_compression": "deflate"},
    "int8+deflate": {"update_encoding": "int8-delta", "update_compression": "deflate"},
}
FP16_BOUND, INT8_BOUND = (0.5, 0.5), (0.27, 1.0)  # (bytes ratio, cost in points)
BOUNDS = {"fp16": FP16_BOUND, "fp16+deflate": FP16_BOUND, "int8": INT8_BOUND, "int8-channel": INT8_BOUND}
BOUNDS["int8+deflate"] = INT8_BOUND
FULL = Scale({"type2": 4, "type1": 4}, pool=5000, rounds=10, labels=200, epochs=5, mc_passes=10)
QUICK = Scale({"type2": 2, "type1": 2}, pool=200, rounds=2, labels=20, epochs=1, mc_passes=2)


def run_encoding(job: tuple[str, RunSpec]) -> dict[str, Any]:
    """One simulate run with one encoding: its curve, and the sizes of the updates the coordinator accepted."""
    encoding, spec = job
    run = run_one(spec)
    with RunStore(spec.out / spec.name, read_only=True) as store:
        sizes = [record.update_bytes for record in store.device_rounds() if record.accepted]
        parameters = sum(array.size for array in store.checkpoints.load(0).values())
    return {
        **run,
        "encoding": encoding,
        "bytes_per_update": float(np.mean(sizes)),
        "updates": len(sizes),
        "parameters": parameters,
    }


def jobs_of(args: argparse.Namespace, scale: Scale) -> list[tuple[str, RunSpec]]:
    """Every (encoding, run) of the sweep; each encoding's runs live in their own folder."""
    return [
        (encoding, RunSpec(partition, "random", seed, "avefl", "kept-labels", scale, args.out / encoding, recipe))
        for partition in args.partitions
        for seed in args.seeds
        for encoding, recipe in ((name, ENCODINGS[name]) for name in args.encodings)
    ]


def summarise(runs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per partition, per encoding: bytes per update, its ratio to float32's, final accuracy and its cost."""
    summary: dict[str, dict[str, Any]] = {}
    for partition in sorted({run["partition"] for run in runs}):
        of_partition = [run for run in runs if run["partition"] == partition]
        baseline = {run["seed"]: run for run in of_partition if run["encoding"] == "float32"}
        rows = {}
        for encoding in dict.fromkeys(run["encoding"] for run in of_partition):
            chosen = [run for run in of_partition if run["encoding"] == encoding]
            rows[encoding] = row_of(chosen, baseline)
        summary[partition] = rows
    return summary


def row_of(runs: list[dict[str, Any]], baseline: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """One encoding's figures over its seeds, beside float32's runs of the same seeds (and the issue's bounds)."""
    curve = curve_of(runs)
    row: dict[str, Any] = {"seeds": curve["seeds"], "final": curve["final"], "final_std": curve["final_std"]}
    row["bytes_per_update"] = round(float(np.mean([run["bytes_per_update"] for run in runs])))
    row["bytes_per_parameter"] = round(row["bytes_per_update"] / runs[0]["parameters"], 4)
    paired = [run for run in runs if run["seed"] in baseline]
    if paired:
        base_bytes = np.mean([baseline[run["seed"]]["bytes_per_update"] for run in paired])
        cost = np.mean([baseline[run["seed"]]["accuracy"][-1] - run["accuracy"][-1] for run in paired]) * 100
        row["bytes_ratio"] = round(float(np.mean([run["bytes_per_update"] for run in paired]) / base_bytes), 4)
        row["cost_points"] = round(float(cost), 2)
    encoding = runs[0]["encoding"]
    if encoding in BOUNDS and paired:
        ratio_bound, cost_bound = BOUNDS[encoding]
        row["holds"] = row["bytes_ratio"] <= ratio_bound and row["cost_points"] <= cost_bound
    return row


def main() -> None:
    """Runs the sweep (side by side with --jobs), prints each run as a JSON line, then writes and prints the summary."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_scale_options(parser)
    parser.add_argument("--partitions", nargs="+", default=["type2", "type1"])
    parser.add_argument("--seeds", nargs="+", type=int, help="default 0 1 2 (0 with --quick)")
    parser.add_argument("--encodings", nargs="+", default=list(ENCODINGS), choices=list(ENCODINGS))
    parser.add_argument("--jobs", type=int, default=1, help="simulations run side by side")
    parser.add_argument("--from-lines", nargs="+", type=Path, help="also summarise the run lines of earlier sweeps")
    parser.add_argument(
        "--out", type=Path, default=Path("runs") / f"update-compression-{time.strftime('%Y%m%d-%H%M%S')}"
    )
    args = parser.parse_args()
    args.seeds = args.seeds or ([0] if args.quick else [0, 1, 2])
    if "float32" not in args.encodings and not args.from_lines:
        args.encodings.insert(0, "float32")
    jobs = jobs_of(args, scale_of(args, QUICK, FULL))
    runs = read_run_lines(args.from_lines) if args.from_lines else []
    with ProcessPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        for done, run in enumerate(pool.map(run_encoding, jobs), start=1):
            runs.append(run)
            print(json.dumps({"progress": f"{done}/{len(jobs)}", "run": run}), flush=True)
    summary = summarise(runs)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "update_compression.json").write_text(json.dumps({"summary": summary, "runs": runs}, indent=1))
    print(json.dumps({"summary": summary, "out": str(args.out)}, indent=1))


if __name__ == "__main__":
    main()
