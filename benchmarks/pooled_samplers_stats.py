# Which sampler pays on top of the pooled head: each pooled:NAME curve against pooled:random and the camera path's, by seed.
"""Reads camera_al's JSON of settings run with "pooled:NAME" spellings only (the pooled head, the camera path's head)
and pairs each curve by seed with pooled:random and with the camera path's sampler on the pooled head
(pooled:typical-then-balanced-margin): the AULC gain over every round and over the rounds at 40-120 labels (points,
90% t-intervals, semi_supervised_stats.paired), the share of pooled:random's labels at which it reaches
pooled:random's final accuracy (per seed; camera_al_stats.reach_share), and the final recall of the three classes
pooled:random's labels hold least of (imbalanced pools) or the all-labels ceiling finds hardest (balanced).

Usage: python benchmarks/pooled_samplers_stats.py OUT/*/camera_al.json [--out DIR]
  prints the markdown table; with --out, writes DIR/summary.json and DIR/table.md
"""

from __future__ import annotations

from typing import Any

import numpy as np
from camera_al_stats import DEFAULT, by_seed, reach_share, shown, t_interval
from semi_supervised_stats import RARE, paired, tables_main

POOLED = "pooled:"
RANDOM, CAMERA = POOLED + "random", POOLED + DEFAULT
TABLE_HEAD = (
    "| setting | sampler | AULC | gain over pooled:random, all rounds / 40-120 labels | gain over the camera path's"
    " sampler, all rounds / 40-120 labels | share of pooled:random's labels to reach its final | final recall of the"
    " rarest (imbalanced) or hardest (balanced) classes |\n| --- | --- | --- | --- | --- | --- | --- |"
)


def watched(result: dict[str, Any]) -> list[int]:
    """The RARE classes pooled:random's final labels hold least of (imbalanced pools), or with the lowest all-labels
    ceiling recall (balanced), mean over seeds."""
    if result["fleet"]["mix"]["value"] == 1.0:
        recall = np.mean(list(result["ceiling_class_recall"].values()), axis=0)
        return [int(c) for c in np.argsort(recall, kind="stable")[:RARE]]
    runs = [run for run in result["runs"] if run["sampler"] == RANDOM and run["partition"] == "federated"]
    counts = np.mean([run["final_class_counts"] for run in runs], axis=0)
    return [int(c) for c in np.argsort(counts, kind="stable")[:RARE]]


def reach(runs: list[dict[str, Any]], sampler: str) -> dict[str, Any]:
    """Per seed, the share of pooled:random's labels at which `sampler` reaches pooled:random's final accuracy; its
    interval when every seed reached it, how many never did, and the same share on the two mean curves."""
    keyed = by_seed(runs, "federated")
    seeds = sorted(seed for name, seed in keyed if name == sampler and (RANDOM, seed) in keyed)
    shares = [reach_share(keyed[sampler, seed], keyed[RANDOM, seed]["accuracy"][-1]) for seed in seeds]
    reached = [share for share in shares if share is not None]
    mean_curve = {
        "labels": keyed[sampler, seeds[0]]["labels"],
        "accuracy": np.mean([keyed[sampler, seed]["accuracy"] for seed in seeds], axis=0).tolist(),
    }
    target = float(np.mean([keyed[RANDOM, seed]["accuracy"][-1] for seed in seeds]))
    return {
        "shares": shares,
        "interval": t_interval(reached) if len(reached) == len(shares) else None,
        "never": len(shares) - len(reached),
        "mean_curve_share": reach_share(mean_curve, target),
    }


def setting_summary(result: dict[str, Any]) -> dict[str, Any]:
    """Every pooled curve of one camera_al run against pooled:random and the camera path's sampler."""
    runs, names, rare = result["runs"], [name for name, _ in result["settings"]["classes"]], watched(result)
    curves = {}
    for sampler, summary in result["summary"]["federated"].items():
        recall = result["final_class_recall"][sampler]
        curves[sampler] = {
            "aulc": summary["aulc"],
            "vs_random": paired(runs, sampler, RANDOM) if sampler != RANDOM else None,
            "vs_camera": paired(runs, sampler, CAMERA) if sampler != CAMERA else None,
            "reach": reach(runs, sampler),
            "watched_class_recall": [recall[c] for c in rare],
        }
    return {"setting": result["settings"]["setting"] or "", "watched_classes": [names[c] for c in rare], **curves}


def gains(found: dict[str, Any] | None) -> str:
    """A paired gain's intervals, all rounds / 40-120 labels, or `-`."""
    return "-" if found is None else f"{shown(found['aulc_gain_interval'])} / {shown(found['early_gain_interval'])}"


def table_rows(summary: dict[str, Any]) -> list[str]:
    """One markdown row per curve of a setting."""
    rows = []
    for sampler, found in summary.items():
        if not isinstance(found, dict):
            continue
        share, never, mean = (found["reach"][key] for key in ("interval", "never", "mean_curve_share"))
        reached = f"never on {never} seeds" if share is None else shown(share, 100, 0) + "%"
        reached += "; mean curves: " + ("never" if mean is None else f"{100 * mean:.0f}%")
        recall = " / ".join(f"{n} {v:.2f}" for n, v in zip(summary["watched_classes"], found["watched_class_recall"]))
        rows.append(
            f"| {summary['setting']} | `{sampler}` | {100 * found['aulc']:.1f} | {gains(found['vs_random'])} |"
            f" {gains(found['vs_camera'])} | {reached} | {recall} |"
        )
    return rows


def main() -> None:
    """Every JSON's summary, the table printed, both written under --out."""
    tables_main(__doc__, setting_summary, table_rows, TABLE_HEAD)


if __name__ == "__main__":
    main()
