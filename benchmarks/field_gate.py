# The gate on a drifting camera fleet: the server's test set deciding against the field set deciding, paired by seed.
"""Prints one JSON object: per seed and arm, each round's accuracy on the server's test set and on the field set
(with their sizes), the gate's decision, the version serving after it and that version's accuracy on the devices'
post-drift images; and for each arm after the first, per seed the paired difference of the served model's
post-drift accuracy (that arm less the first) over the rounds after the drift, with a 90% t-interval over seeds.

Each run is the field loop of docs/first-camera-fleet.md (bench.camera_path: a real coordinator with its labelling
queue and page, real field agents labelling centrally, the bench's person answering on the page), with a share of
the queries marked as field test queries (`--field-test-share`). After round `--drift-after` commits, the field
changes at every camera, and each device's camera folder receives the new scenes, which its agent takes into its
pool, asks about and predicts: `--drift lighting` (as many scenes again, darkened and tinted blue) or `--drift mix`
(the class mix changes: two classes twice as many scenes each, the others a fifth, under the same light: what the
server's balanced test set cannot see). The devices' post-drift images are a held-out set of such scenes from the
test items, never in any pool. The arms (`--arms`, the first the baseline) differ only in which set decides the
gate and in the devices' drift watch: `server` (the server's test set: `--promotion-field-images` beyond reach),
`field` (the field set once it holds `--field-images`), `field-window` (the same, the field set the newest
`--field-window` answers) and `drift-watch` (the field set deciding, and the devices asking only about their new
images for `--drift-acquisitions` acquisitions once they see them drift); every arm's fleet is built alike from the
seed. Each arm's tracking: over its promoted rounds after the drift, how far the field set's accuracy and the server
test set's were from the promoted model's accuracy on the post-drift images (mean absolute gap, points).

Usage: python benchmarks/field_gate.py [--seeds 0 1 2 3 4] [--devices 2] [--per-class 20] [--rounds 6]
       [--labels 6] [--drift-after 3] [--drift lighting|mix] [--field-test-share 0.3] [--field-images 20]
       [--arms server field field-window drift-watch] [--field-window 60] [--drift-acquisitions 3]
       [--averaged-heads] [--out DIR]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
from camera_al_stats import t_interval

from bench.camera_drift import DRIFTS, drift_scenes, drift_when_committed
from bench.camera_fleet import POOL_DIR, SPEC_FILE, FleetSettings, PeopleAtThePage, build_fleet, device_dir
from bench.camera_path import CameraSite, CentralLabelling, run_camera_site
from bench.camera_scenes import DEFAULT_CLASSES, SceneSet, parse_classes
from coordinator.fleet.broker import free_loopback_port
from coordinator.rounds.closing import FIELD_ACCURACY, FIELD_IMAGES, TEST_IMAGES
from coordinator.rounds.evaluation import Evaluator, LabelledSplit
from coordinator.storage.store import RunStore
from edge_agent.data.fashion_mnist import load_fashion_mnist
from edge_agent.data.image_arrays import ImageDataset
from edge_agent.data.image_files import InputSpec, decode_image
from protocol.model_spec import ModelSpec, load_model_spec

WAIT_SECONDS = 3600
NEVER = 10**9  # --promotion-field-images the field set never reaches: the server's test set decides
DRIFT_STREAM = 900  # the held-out post-drift scenes' stream of the test items
ARMS = ("server", "field", "field-window", "drift-watch")


def decoded(scenes: SceneSet, spec: ModelSpec, folder: Path) -> LabelledSplit:
    """The scenes decoded as a device decodes its camera's files (at the spec's input), as a test split."""
    folder.mkdir(parents=True, exist_ok=True)
    images = []
    for number, jpeg in enumerate(scenes.jpegs):
        path = folder / f"{number:05d}.jpg"
        path.write_bytes(jpeg)
        images.append(decode_image(path, InputSpec(spec.channels, spec.height, spec.width)))
    return LabelledSplit.from_uint8(np.stack(images), scenes.labels)


def run_arm(args: argparse.Namespace, seed: int, arm: str, dataset: ImageDataset) -> dict[str, Any]:
    """One run of the drifting fleet with the gate deciding on `arm`'s set; its rounds as the store keeps them and
    the served version's accuracy on the post-drift held-out scenes after each round."""
    work = args.out / f"seed{seed}-{arm}"
    fleet_dir = work / "fleet"
    settings = FleetSettings(
        args.devices, args.classes, args.per_class, args.test_per_class, seed=seed, server_per_class=args.init_per_class
    )
    build_fleet(fleet_dir, settings, dataset)
    spec = load_model_spec(fleet_dir / SPEC_FILE).spec
    train, test, size = (
        (dataset.train_images, dataset.train_labels),
        (dataset.test_images, dataset.test_labels),
        settings.size,
    )
    pools = [
        (
            device_dir(fleet_dir, n) / POOL_DIR,
            drift_scenes(train, args.classes, args.per_class, size, seed, 100 + n, args.drift),
        )
        for n in range(args.devices)
    ]
    held_out = decoded(
        drift_scenes(test, args.classes, args.test_per_class, size, seed, DRIFT_STREAM, args.drift),
        spec,
        work / "drift",
    )
    field_images = NEVER if arm == "server" else args.field_images
    flags = (
        *("--init-samples", str(len(args.classes) * args.init_per_class), "--epochs", str(args.epochs)),
        *("--validation-samples", "0", "--sampler", "random", "--seed", str(seed)),
        *("--promotion-field-images", str(field_images)),
        *(("--drift-acquisitions", str(args.drift_acquisitions)) if arm == "drift-watch" else ()),
        *(("--field-test-window", str(args.field_window)) if arm == "field-window" else ()),
    )
    central = CentralLabelling(free_loopback_port(), field_test_share=args.field_test_share)
    site = CameraSite(
        *(fleet_dir, work, free_loopback_port(), args.devices, args.rounds, args.labels, flags),
        central=central,
        averaged_heads=args.averaged_heads,
    )
    people = site.people(tuple(spec.class_names))
    if not isinstance(people, PeopleAtThePage):
        raise TypeError("a central labelling site's people are at the page")
    for _, scenes in pools:  # the bench's person knows a drifted scene by its image too
        people.key.update(
            (hashlib.sha256(jpeg).hexdigest(), int(label)) for jpeg, label in zip(scenes.jpegs, scenes.labels)
        )
    stop = threading.Event()
    drifter = threading.Thread(target=drift_when_committed, args=(site.run_dir, args.drift_after, pools, stop))
    drifter.start()
    started = time.perf_counter()
    try:
        codes = run_camera_site(site, WAIT_SECONDS, people)
    finally:
        stop.set()
        drifter.join()
    return {
        "seed": seed,
        "arm": arm,
        "exit_codes": codes,
        "seconds": round(time.perf_counter() - started, 1),
        "rounds": round_table(site.run_dir, spec, held_out),
    }


def round_table(run_dir: Path, spec: ModelSpec, held_out: LabelledSplit) -> list[dict[str, Any]]:
    """Each committed round: its accuracy on both test sets with their sizes, the gate's decision, the version
    serving after it and that version's accuracy on the post-drift held-out scenes."""
    evaluator = Evaluator(spec, held_out, held_out, 1, 0)
    served: dict[int, float] = {}
    rows = []
    with RunStore(run_dir, read_only=True) as store:
        gate = {event.round_id: event for event in store.serving.events() if event.who == "gate"}
        for record in store.rounds():
            event = gate.get(record.round_id)
            version = event.serving if event is not None else 0
            if version not in served:
                served[version] = evaluator.test_scores(store.checkpoints.load(version)).accuracy
            rows.append(
                {
                    "round": record.round_id,
                    "test_accuracy": round(record.accuracy, 4),
                    "test_images": record.metrics.get(TEST_IMAGES),
                    "field_accuracy": record.metrics.get(FIELD_ACCURACY),
                    "field_images": record.metrics.get(FIELD_IMAGES, 0),
                    "decision": None if event is None else event.decision,
                    "reason": None if event is None else event.reason,
                    "serving": version,
                    "served_post_drift_accuracy": round(served[version], 4),
                }
            )
    return rows


def paired(runs: list[dict[str, Any]], drift_after: int, arm: str, baseline: str) -> dict[str, Any]:
    """Per seed, `arm`'s served post-drift accuracy less `baseline`'s, averaged over the rounds after the drift and
    at the last round; their means with 90% t-intervals over seeds."""
    by_key = {(run["seed"], run["arm"]): run for run in runs}
    seeds = sorted({seed for seed, _ in by_key if (seed, arm) in by_key and (seed, baseline) in by_key})
    after, last = [], []
    for seed in seeds:
        ours, theirs = (
            [row["served_post_drift_accuracy"] for row in by_key[(seed, name)]["rounds"] if row["round"] > drift_after]
            for name in (arm, baseline)
        )
        count = min(len(ours), len(theirs))
        if count:
            after.append(float(np.mean(ours[:count]) - np.mean(theirs[:count])))
            last.append(ours[count - 1] - theirs[count - 1])
    return {"seeds": seeds, "after_drift": t_interval(after), "last_round": t_interval(last)}


def tracking(runs: list[dict[str, Any]], drift_after: int, arm: str) -> dict[str, Any]:
    """How far each test set's accuracy was from the post-drift accuracy of the model it judged, over `arm`'s
    promoted rounds after the drift (the promoted model serves, so its post-drift accuracy is the served one):
    per seed the mean absolute gap, in points, of the field set and of the server's test set, with 90% intervals."""
    field, server = [], []
    for run in (run for run in runs if run["arm"] == arm):
        rows = [
            row
            for row in run["rounds"]
            if row["round"] > drift_after and row["decision"] == "promoted" and row["field_accuracy"] is not None
        ]
        if rows:
            truth = np.array([row["served_post_drift_accuracy"] for row in rows])
            field.append(float(np.mean(np.abs(np.array([row["field_accuracy"] for row in rows]) - truth))) * 100)
            server.append(float(np.mean(np.abs(np.array([row["test_accuracy"] for row in rows]) - truth))) * 100)
    return {"field_set_gap": t_interval(field), "server_test_gap": t_interval(server)}


def main() -> None:
    """Runs both arms for each seed, one after another, and prints the JSON."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2, 3, 4])
    for flag, default in (("devices", 2), ("per-class", 20), ("rounds", 6), ("labels", 6), ("epochs", 10)):
        parser.add_argument(f"--{flag}", type=int, default=default)
    parser.add_argument("--init-per-class", type=int, default=10, help="the server's labelled scenes per class (W0)")
    parser.add_argument("--test-per-class", type=int, default=30, help="the server's and the post-drift test scenes")
    parser.add_argument("--drift-after", type=int, default=3, help="the round after whose commit the field changes")
    parser.add_argument("--drift", choices=DRIFTS, default="lighting", help="the lighting changes, or the class mix")
    parser.add_argument("--arms", nargs="+", choices=ARMS, default=["server", "field"], help="the first: the baseline")
    parser.add_argument("--drift-acquisitions", type=int, default=3, help="the drift-watch arm's recipe value")
    parser.add_argument("--field-window", type=int, default=60, help="the field-window arm's --field-test-window")
    parser.add_argument("--field-test-share", type=float, default=0.3)
    parser.add_argument("--field-images", type=int, default=20, help="the field arm's --promotion-field-images")
    parser.add_argument("--classes", type=parse_classes, default=DEFAULT_CLASSES)
    parser.add_argument(
        "--averaged-heads",
        action="store_true",
        help="the guide's averaged heads (its command until 2026-11-28) in place of its pooled head",
    )
    parser.add_argument("--out", type=Path, default=Path("runs") / f"field-gate-{time.strftime('%Y%m%d-%H%M%S')}")
    args = parser.parse_args()
    dataset = load_fashion_mnist()
    runs = [run_arm(args, seed, arm, dataset) for seed in args.seeds for arm in args.arms]
    baseline = args.arms[0]
    comparisons = {f"{arm} less {baseline}": paired(runs, args.drift_after, arm, baseline) for arm in args.arms[1:]}
    tracked = {arm: tracking(runs, args.drift_after, arm) for arm in args.arms if arm != "server"}
    result = {"out": str(args.out), "arms": args.arms, "runs": runs, "paired": comparisons, "tracking": tracked}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "field_gate.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
