# The same rounds judged again on the server's test set: where the field gate and the server's set part, model by model.
"""For each field_gate.py run folder whose field set decided (`seedN-field`, `seedN-drift-watch`, ...), every gate
decision is judged again on the server's test images: the same candidate against the same serving model, from the
checkpoints the run kept, by the same rule (`coordinator.rounds.promotion.verdict`). Prints one JSON object: per run
the rounds where the two sets part (the field set held what the server's set would promote, or promoted what it
would hold), each with both reasons and, given `--drift` (the run's), both models' accuracy on the run's held-out
post-drift scenes (rendered again from the seed, as field_gate.py renders them); and the counts over all runs.

Usage: python benchmarks/gate_counterfactual.py WORK_DIR... [--drift lighting|mix] [--test-per-class 30]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import numpy as np
from field_gate import DRIFT_STREAM, decoded

from bench.camera_drift import DRIFTS, drift_scenes
from bench.camera_fleet import SERVER_FILE, SPEC_FILE
from bench.camera_scenes import DEFAULT_CLASSES
from coordinator.rounds.evaluation import Evaluator, LabelledSplit
from coordinator.rounds.promotion import PromotionGate, verdict
from coordinator.storage.store import RunStore
from edge_agent.data.fashion_mnist import load_fashion_mnist
from protocol.model_spec import ModelSpec, load_model_spec

PROMOTED = "promoted"


def judged_again(work: Path, post_drift: LabelledSplit | None) -> list[dict[str, Any]]:
    """Each gate decision of the run in `work` beside the server's test set's verdict on the same two models, and
    both models' accuracy on the post-drift scenes where given."""
    spec = load_model_spec(work / "fleet" / SPEC_FILE).spec
    with np.load(work / "fleet" / SERVER_FILE) as arrays:
        test = LabelledSplit.from_uint8(arrays["test_images"], arrays["test_labels"])
    evaluator = Evaluator(spec, test, test, 1, 0)
    drifted = None if post_drift is None else Evaluator(spec, post_drift, post_drift, 1, 0)
    rows, serving = [], 0
    with RunStore(work / "run", read_only=True) as store:
        for event in (event for event in store.serving.events() if event.who == "gate"):
            evidence = evaluator.evidence(event.round_id, serving, store.checkpoints.load)
            server = verdict(PromotionGate(), evidence, spec.class_names)
            row: dict[str, Any] = {
                "round": event.round_id,
                "serving_before": serving,
                "taken": event.decision,
                "taken_reason": event.reason,
                "server_set": PROMOTED if server.promote else "held",
                "server_reason": server.reason,
            }
            if drifted is not None and row["taken"] != row["server_set"]:
                for name, version in (("candidate", event.round_id), ("serving", serving)):
                    accuracy = drifted.test_scores(store.checkpoints.load(version)).accuracy
                    row[f"{name}_post_drift_accuracy"] = round(accuracy, 4)
            rows.append(row)
            serving = event.serving
    return rows


def post_drift_scenes(
    work: Path, spec: ModelSpec, drift: str, per_class: int, items: tuple[np.ndarray, np.ndarray]
) -> LabelledSplit:
    """The run's held-out post-drift scenes from the test `items`, rendered again from its seed (the folder's
    `seedN-...` name)."""
    seed = int(work.name.removeprefix("seed").split("-")[0])
    scenes = drift_scenes(items, DEFAULT_CLASSES, per_class, spec.height, seed, DRIFT_STREAM, drift)
    return decoded(scenes, spec, work / "drift-again")


def main() -> None:
    """Judges every given run again and prints the JSON."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("works", nargs="+", type=Path)
    parser.add_argument("--drift", choices=DRIFTS, help="the runs' drift: score the parted rounds on its scenes")
    parser.add_argument("--test-per-class", type=int, default=30, help="the runs' --test-per-class")
    args = parser.parse_args()
    dataset = load_fashion_mnist() if args.drift else None
    items = None if dataset is None else (dataset.test_images, dataset.test_labels)
    runs, counts = {}, {"decisions": 0, "field_held_server_would_promote": 0, "field_promoted_server_would_hold": 0}
    for work in args.works:
        spec = load_model_spec(work / "fleet" / SPEC_FILE).spec
        scenes = None if items is None else post_drift_scenes(work, spec, args.drift, args.test_per_class, items)
        rows = judged_again(work, scenes)
        parted = [row for row in rows if row["taken"] != row["server_set"]]
        counts["decisions"] += len(rows)
        counts["field_held_server_would_promote"] += sum(row["taken"] == "held" for row in parted)
        counts["field_promoted_server_would_hold"] += sum(row["taken"] == PROMOTED for row in parted)
        runs[work.name] = parted
    print(json.dumps({"counts": counts, "parted": runs}, indent=1))


if __name__ == "__main__":
    main()
