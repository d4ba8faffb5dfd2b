# The camera_al benchmark's statistics: paired-by-seed intervals of the gains over random, gaps to the probe, a table.
"""Pure functions over camera_al's runs (one dict per sampler, seed and partition, with `labels` and `accuracy` per
round): the paired 90% t-intervals of a sampler's AULC gain over random and of the share of random's labels it needs
to reach random's final accuracy (per seed: the same W0, cold start and fleet), the federated curve's gap to the
centralised probe on the same labels, and the markdown table the docs quote.

Usage: python benchmarks/camera_al_stats.py OUT/*/camera_al.json [--figures]
  prints one markdown table over the settings and each setting's must-hold checks; --figures draws curves.png and
  default_vs_random.png beside each JSON (for JSON written where matplotlib was missing)
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

import numpy as np
from curves import plot

DEFAULT = "typical-then-balanced-margin"  # the camera path's sampler, the one the must-holds judge
ORACLE = "oracle-balanced"  # camera_al's class-balanced oracle: it reads the answers, the bound on class balancing

T_95 = {1: 6.314, 2: 2.920, 3: 2.353, 4: 2.132, 5: 2.015, 6: 1.943, 7: 1.895, 8: 1.860, 9: 1.833, 10: 1.812}
"""The t distribution's 0.95 quantile by degrees of freedom (a two-sided 90% interval); 1.645 beyond 10 is within
0.17 of the exact value for any df above 10, and the sweeps here have 5-10 seeds."""


def t_interval(values: list[float]) -> dict[str, Any]:
    """Mean and the two-sided 90% t-interval of the mean (null bounds for fewer than 2 values)."""
    data = np.asarray(values, dtype=np.float64)
    mean = float(data.mean()) if len(data) else math.nan
    if len(data) < 2:
        return {"mean": round(mean, 4), "low": None, "high": None, "n": len(data)}
    half = T_95.get(len(data) - 1, 1.645) * float(data.std(ddof=1)) / math.sqrt(len(data))
    return {"mean": round(mean, 4), "low": round(mean - half, 4), "high": round(mean + half, 4), "n": len(data)}


def by_seed(runs: list[dict[str, Any]], partition: str) -> dict[tuple[str, int], dict[str, Any]]:
    """The runs of one partition keyed by (sampler, seed)."""
    return {(run["sampler"], run["seed"]): run for run in runs if run["partition"] == partition}


def reach_share(curve: dict[str, Any], target: float) -> float | None:
    """The first label count at which the curve is at or above `target`, over the curve's last label count (null:
    never)."""
    for labels, accuracy in zip(curve["labels"], curve["accuracy"]):
        if accuracy >= target:
            return labels / curve["labels"][-1]
    return None


def paired_gains(runs: list[dict[str, Any]], sampler: str, partition: str = "federated") -> dict[str, Any]:
    """Per seed that random also ran: the AULC gain over random (points) and the share of random's labels at which
    the sampler reached random's final accuracy on that seed; their 90% t-intervals (the share's only when every
    seed reached it; `never` counts the seeds that did not)."""
    keyed = by_seed(runs, partition)
    seeds = sorted(seed for name, seed in keyed if name == sampler and ("random", seed) in keyed)
    gains, shares = [], []
    for seed in seeds:
        own, random = keyed[sampler, seed], keyed["random", seed]
        gains.append(100 * (float(np.mean(own["accuracy"])) - float(np.mean(random["accuracy"]))))
        shares.append(reach_share(own, random["accuracy"][-1]))
    reached = [share for share in shares if share is not None]
    return {
        "seeds": seeds,
        "aulc_gain_points": [round(gain, 2) for gain in gains],
        "aulc_gain_interval": t_interval(gains),
        "reach_share": shares,
        "reach_share_interval": t_interval(reached) if len(reached) == len(shares) else None,
        "never": len(shares) - len(reached),
    }


def probe_gaps(runs: list[dict[str, Any]], sampler: str) -> dict[str, Any]:
    """Per round, the federated accuracy minus the centralised probe's on the same labels (points): mean over seeds
    and the largest shortfall, with the label counts."""
    federated, central = by_seed(runs, "federated"), by_seed(runs, "centralised")
    seeds = sorted(seed for name, seed in federated if name == sampler and (sampler, seed) in central)
    if not seeds:
        return {}
    gaps = np.array(
        [np.subtract(federated[sampler, s]["accuracy"], central[sampler, s]["accuracy"]) * 100 for s in seeds]
    )
    return {
        "labels": federated[sampler, seeds[0]]["labels"],
        "mean_gap_points": gaps.mean(axis=0).round(2).tolist(),
        "worst_gap_points": gaps.min(axis=0).round(2).tolist(),
    }


def intervals(runs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Every sampler's paired gains over random (federated and centralised) and its federated gap to the probe."""
    samplers = list(dict.fromkeys(run["sampler"] for run in runs))
    return {
        sampler: {
            "federated": paired_gains(runs, sampler, "federated"),
            "centralised": paired_gains(runs, sampler, "centralised"),
            "gap_to_probe": probe_gaps(runs, sampler),
        }
        for sampler in samplers
    }


def shown(interval: dict[str, Any] | None, scale: float = 1.0, digits: int = 1) -> str:
    """An interval as `mean [low, high]` (scaled), or `-` where there is none."""
    if interval is None:
        return "-"
    if interval["low"] is None:
        return f"{interval['mean'] * scale:.{digits}f}"
    low, mean, high = (interval[key] * scale for key in ("low", "mean", "high"))
    return f"{mean:.{digits}f} [{low:.{digits}f}, {high:.{digits}f}]"


def table(setting: str, summary: dict[str, Any], found: dict[str, dict[str, Any]]) -> str:
    """Markdown rows, one per sampler of the setting: AULC, the paired gain's 90% interval, the reach share's, the
    federated accuracy at the first three rounds and the last, the worst gap to the probe from round 1 on."""
    rows = []
    for sampler, curve in summary["federated"].items():
        stats = found[sampler]["federated"]
        share = stats["reach_share_interval"]
        reach = shown(share, 100, 0) + "%" if share else f"never on {stats['never']} of {len(stats['seeds'])} seeds"
        early = " / ".join(f"{value:.3f}" for value in curve["mean"][:3])
        gaps = found[sampler]["gap_to_probe"].get("mean_gap_points", [math.nan])
        rows.append(
            f"| {setting} | `{sampler}` | {100 * curve['aulc']:.1f} | {shown(stats['aulc_gain_interval'])} | {reach} "
            f"| {early} | {curve['mean'][-1]:.3f} | {min(gaps):+.1f} |"
        )
    return "\n".join(rows)


TABLE_HEAD = (
    "| setting | sampler | AULC | AULC gain vs random, 90% CI | reaches random's final at (share of its labels, "
    "90% CI) | rounds 1 / 2 / 3 | final | worst mean gap to the probe (points) |\n"
    "| --- | --- | --- | --- | --- | --- | --- | --- |"
)


def figures(
    summary: dict[str, Any],
    folder: Path,
    default: str,
    recalls: dict[str, list[float]] | None = None,
    names: tuple[str, ...] | list[str] = (),
) -> None:
    """curves.png (every sampler, federated and centralised), default_vs_random.png (with the class-balanced oracle
    where it ran) and, given the final per-class recalls, recall.png (random, the default, the oracle) in the
    folder; where matplotlib is missing (a lent accelerator), one line on stderr and no figures (`--figures` draws
    them later)."""
    try:
        plot(summary, folder / "curves.png")
    except ImportError:
        print("no matplotlib here: no figures (camera_al_stats.py --figures draws them)", file=sys.stderr, flush=True)
        return
    shown = [key for key in ("random", default, ORACLE) if key in summary["federated"]]
    focus = {key: summary["federated"][key] for key in shown}
    plot({"federated: default, random, class-balanced oracle": focus}, folder / "default_vs_random.png")
    if recalls:
        recall_bars({key: recalls[key] for key in shown if key in recalls}, list(names), folder / "recall.png")


def recall_bars(recalls: dict[str, list[float]], names: list[str], path: Path) -> None:
    """One group of bars per class: each sampler's final federated recall of that class (mean over seeds)."""
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(10, 4))
    width = 0.8 / max(len(recalls), 1)
    for number, (sampler, recall) in enumerate(recalls.items()):
        axis.bar(np.arange(len(recall)) + number * width, recall, width, label=sampler)
    axis.set_xticks(np.arange(len(names)) + 0.4 - width / 2, names, rotation=30, fontsize=8)
    axis.set(ylabel="final test recall (mean over seeds)", ylim=(0, 1.15))
    axis.grid(alpha=0.3, axis="y")
    axis.legend(fontsize=8, loc="upper center", ncols=3)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def main() -> None:
    """The settings' table rows under one head, then each setting's must-hold checks; figures on request."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", nargs="+", type=Path, help="camera_al.py's JSON, one per setting")
    parser.add_argument("--figures", action="store_true", help="draw each JSON's figures beside it")
    args = parser.parse_args()
    rows, checks = [], []
    for path in args.results:
        result = json.loads(path.read_text())
        rows.append(result["table"].split("\n", 2)[2])
        checks.append(f"- `{path}`: {json.dumps(result['must_hold'])}")
        if args.figures:
            names = [name for name, _ in result["settings"]["classes"]]
            figures(result["summary"], path.parent, DEFAULT, result.get("final_class_recall"), names)
    print("\n".join([TABLE_HEAD, *rows, "", *checks]))


if __name__ == "__main__":
    main()
