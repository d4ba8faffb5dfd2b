# The same rounds judged again on the server's test set: where the field gate and the server's set part, model by model.
"""For each field_gate.py run folder whose field set decided (`seedN-field`, `seedN-drift-watch`, ...), every gate
decision is judged again on the server's test images: the same candidate against the same serving model, from the
checkpoints the run kept, by the same rule (`coordinator.rounds.promotion.verdict`). Prints one JSON object: per run
the rounds where the two sets part (the field set held what the server's set would promote, or promoted what it
would hold), each with both reasons and the candidate's accuracy on the post-drift scenes when field_gate.py's JSON
is given; and the counts over all runs.

Usage: python benchmarks/gate_counterfactual.py WORK_DIR... [--runs field_gate.json]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import numpy as np

from bench.camera_fleet import SERVER_FILE, SPEC_FILE
from coordinator.rounds.evaluation import Evaluator, LabelledSplit
from coordinator.rounds.promotion import PromotionGate, verdict
from coordinator.storage.store import RunStore
from protocol.model_spec import load_model_spec

PROMOTED = "promoted"


def judged_again(work: Path) -> list[dict[str, Any]]:
    """Each gate decision of the run in `work` beside the server's test set's verdict on the same two models."""
    spec = load_model_spec(work / "fleet" / SPEC_FILE).spec
    with np.load(work / "fleet" / SERVER_FILE) as arrays:
        test = LabelledSplit.from_uint8(arrays["test_images"], arrays["test_labels"])
    evaluator = Evaluator(spec, test, test, 1, 0)
    rows, serving = [], 0
    with RunStore(work / "run", read_only=True) as store:
        for event in (event for event in store.serving.events() if event.who == "gate"):
            evidence = evaluator.evidence(event.round_id, serving, store.checkpoints.load)
            server = verdict(PromotionGate(), evidence, spec.class_names)
            rows.append(
                {
                    "round": event.round_id,
                    "serving_before": serving,
                    "taken": event.decision,
                    "taken_reason": event.reason,
                    "server_set": PROMOTED if server.promote else "held",
                    "server_reason": server.reason,
                }
            )
            serving = event.serving
    return rows


def post_drift(runs_file: Path | None) -> dict[tuple[str, int], float]:
    """(run folder name, round) -> that round's candidate accuracy on the post-drift scenes where it served (from
    field_gate.py's JSON); empty without one."""
    if runs_file is None:
        return {}
    found = {}
    for run in json.loads(runs_file.read_text())["runs"]:
        for row in run["rounds"]:
            if row["serving"] == row["round"]:
                found[(f"seed{run['seed']}-{run['arm']}", row["round"])] = row["served_post_drift_accuracy"]
    return found


def main() -> None:
    """Judges every given run again and prints the JSON."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("works", nargs="+", type=Path)
    parser.add_argument("--runs", type=Path, help="field_gate.py's JSON of these runs (post-drift accuracies)")
    args = parser.parse_args()
    accuracy = post_drift(args.runs)
    runs, counts = {}, {"decisions": 0, "field_held_server_would_promote": 0, "field_promoted_server_would_hold": 0}
    for work in args.works:
        rows = judged_again(work)
        parted = [row for row in rows if row["taken"] != row["server_set"]]
        for row in parted:
            row["post_drift_accuracy"] = accuracy.get((work.name, row["round"]))
        counts["decisions"] += len(rows)
        counts["field_held_server_would_promote"] += sum(row["taken"] == "held" for row in parted)
        counts["field_promoted_server_would_hold"] += sum(row["taken"] == PROMOTED for row in parted)
        runs[work.name] = parted
    print(json.dumps({"counts": counts, "parted": runs}, indent=1))


if __name__ == "__main__":
    main()
