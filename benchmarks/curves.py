# Learning curves over seeds, pure: a sampler spelling's options, the seeds' summary per sampler, and the plot.
"""What the label-efficiency and camera benchmarks share to summarise runs: each run is a dict with `partition`,
`sampler`, `seed`, `labels` and `accuracy` per acquisition point. Imports no runtime room, so a benchmark that only
summarises loads without the bench's simulate stack."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np


def sampler_and_options(spelling: str) -> tuple[str, dict[str, float]]:
    """`NAME` or `NAME:key=value,key=value` as the sampler's name and its recipe options."""
    name, _, rest = spelling.partition(":")
    options = {}
    for pair in filter(None, rest.split(",")):
        key, separator, value = pair.partition("=")
        if not separator:
            raise ValueError(f"sampler option {pair!r} in {spelling!r} is not key=value")
        options[key] = float(value)
    return name, options


def summarise(runs: list[dict[str, Any]], baseline: str = "random") -> dict[str, dict[str, Any]]:
    """Per partition, per sampler: mean curve, its band, AULC, final accuracy, labels to the baseline's final."""
    summary: dict[str, dict[str, Any]] = {}
    for partition in sorted({run["partition"] for run in runs}):
        curves = {}
        for sampler in sorted({run["sampler"] for run in runs if run["partition"] == partition}):
            chosen = [run for run in runs if run["partition"] == partition and run["sampler"] == sampler]
            curves[sampler] = curve_of(chosen)
        summary[partition] = with_label_savings(curves, baseline)
    return summary


def curve_of(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The seeds' mean curve and spread, AULC (mean over acquisition points) and final accuracy (mean, std)."""
    length = min(len(run["accuracy"]) for run in runs)
    accuracy = np.array([run["accuracy"][:length] for run in runs])
    labels = np.mean([run["labels"][:length] for run in runs], axis=0)
    aulcs = accuracy.mean(axis=1)
    weak = [run["weak_label_accuracy"] for run in runs if "weak_label_accuracy" in run]
    return {
        **({"weak_label_accuracy": round(float(np.mean(weak)), 4)} if weak else {}),
        "seeds": [run["seed"] for run in runs],
        "labels": labels.round().astype(int).tolist(),
        "mean": accuracy.mean(axis=0).round(4).tolist(),
        "low": accuracy.min(axis=0).round(4).tolist(),
        "high": accuracy.max(axis=0).round(4).tolist(),
        "aulc": round(float(aulcs.mean()), 4),
        "aulc_std": round(float(aulcs.std()), 4),
        "final": round(float(accuracy[:, -1].mean()), 4),
        "final_std": round(float(accuracy[:, -1].std()), 4),
    }


def with_label_savings(curves: dict[str, dict[str, Any]], baseline: str = "random") -> dict[str, dict[str, Any]]:
    """Adds, where the baseline (random, or the spelling --baseline names) ran, each sampler's AULC gain over it and
    the labels it needed to reach the baseline's final accuracy (first point of its mean curve at or above it), also
    as a fraction of the baseline's labels; the keys keep the name random."""
    if baseline not in curves:
        return curves
    target, random_labels = curves[baseline]["final"], curves[baseline]["labels"][-1]
    for curve in curves.values():
        reached = [labels for labels, mean in zip(curve["labels"], curve["mean"]) if mean >= target]
        curve["aulc_gain_over_random"] = round(curve["aulc"] - curves[baseline]["aulc"], 4)
        curve["labels_to_random_final"] = reached[0] if reached else None
        curve["fraction_of_random_labels"] = round(reached[0] / random_labels, 3) if reached else None
    return curves


def plot(summary: dict[str, dict[str, Any]], path: Path, baseline: str = "random") -> None:
    """One panel per partition, one curve per sampler: mean accuracy against labels with the min-max band."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, len(summary), figsize=(6 * len(summary), 4.5), squeeze=False)
    for axis, (partition, curves) in zip(axes[0], summary.items()):
        for sampler, curve in curves.items():
            style = {"color": "black", "linestyle": "--"} if sampler == baseline else {}
            seeds = len(curve["seeds"])
            label = f"{sampler} (AULC {curve['aulc']:.3f}, {seeds} seed{'s' if seeds > 1 else ''})"
            axis.plot(curve["labels"], curve["mean"], label=label, **style)
            axis.fill_between(
                curve["labels"],
                curve["low"],
                curve["high"],
                alpha=0.15,
                **({"color": "black"} if sampler == baseline else {}),
            )
        axis.set(title=partition, xlabel="labels (all devices + W0's)", ylabel="test accuracy")
        axis.grid(alpha=0.3)
        axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
