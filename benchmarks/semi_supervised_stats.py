# The semi-supervised sweep's statistics: each semi-supervised curve against the supervised ones, paired by seed, and the rare classes.
"""Reads camera_al's JSON of settings run with "semi:NAME" or "pooled-em:NAME" spellings (semi_supervised_sweep.sh)
and, per setting, pairs each such curve (the pseudo-labels rule; the pooled head refined by the pools) by seed with
the supervised camera default's and with its curve on the labels alone (NAME; pooled:NAME) where it ran (and a semi spelling with rule options, e.g. semi:NAME:pseudo_alignment=1, with the
same spelling without them where it ran): the AULC gain over every round and over the rounds at 40-120 labels (points, 90%
t-intervals, camera_al_stats.t_interval), the mean gain per round; beside them each curve's gain over random and
the share of random's labels it needs to reach random's final accuracy (camera_al's intervals), and the final
recall of three watched classes: the pools' rarest (imbalanced; the fewest of random's labels) or the hardest
(balanced; the lowest all-labels recall); every class's in the JSON.

Usage: python benchmarks/semi_supervised_stats.py OUT/*/camera_al.json [--out DIR]
  prints the markdown table; with --out, writes DIR/summary.json and DIR/table.md
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from camera_al_stats import DEFAULT, by_seed, shown, t_interval
from curves import sampler_and_options

SEMI = "semi:"
SUPERVISED = {SEMI: "", "pooled-em:": "pooled:"}  # a semi-supervised prefix, and its curve on the labels alone
SHOWN = (SEMI, "pooled-em:", "pooled:")  # the prefixes of the curves a setting's table shows
EARLY = (40, 120)  # the label counts the must-hold reads the gain at
RARE = 3
TABLE_HEAD = (
    "| setting | curve | AULC gain over the supervised camera default, 40-120 labels | the same, all rounds |"
    " gain over its own sampler supervised, 40-120 labels | gain over the rule without its options, 40-120 labels /"
    " all rounds | AULC gain over random | share of random's labels to reach its final | final recall of the rarest"
    " (imbalanced) or hardest (balanced) classes |\n"
    "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"
)


def paired(runs: list[dict[str, Any]], sampler: str, baseline: str) -> dict[str, Any] | None:
    """`sampler`'s federated curve against `baseline`'s, per seed both ran (None where none did): AULC gains (all
    rounds and the rounds within EARLY labels, points) with their 90% intervals, and the mean gain per round."""
    keyed = by_seed(runs, "federated")
    seeds = sorted(seed for name, seed in keyed if name == sampler and (baseline, seed) in keyed)
    if not seeds:
        return None
    gains = np.array([np.subtract(keyed[sampler, s]["accuracy"], keyed[baseline, s]["accuracy"]) * 100 for s in seeds])
    labels = np.array(keyed[baseline, seeds[0]]["labels"])
    early = (labels >= EARLY[0]) & (labels <= EARLY[1])
    return {
        "baseline": baseline,
        "seeds": seeds,
        "labels": labels.tolist(),
        "aulc_gain_points": gains.mean(axis=1).round(2).tolist(),
        "aulc_gain_interval": t_interval(gains.mean(axis=1).tolist()),
        "early_labels": labels[early].tolist(),
        "early_gain_points": gains[:, early].mean(axis=1).round(2).tolist(),
        "early_gain_interval": t_interval(gains[:, early].mean(axis=1).tolist()),
        "gain_per_round": gains.mean(axis=0).round(2).tolist(),
    }


def watched_classes(result: dict[str, Any]) -> list[int]:
    """The RARE classes random's final labels hold least of on imbalanced pools (the pools' rarest), or on
    balanced ones the RARE with the lowest all-labels ceiling recall (the hardest), mean over seeds."""
    if result["fleet"]["mix"]["value"] == 1.0:
        recall = np.mean(list(result["ceiling_class_recall"].values()), axis=0)
        return [int(c) for c in np.argsort(recall, kind="stable")[:RARE]]
    runs = [run for run in result["runs"] if run["sampler"] == "random" and run["partition"] == "federated"]
    counts = np.mean([run["final_class_counts"] for run in runs], axis=0)
    return [int(c) for c in np.argsort(counts, kind="stable")[:RARE]]


def fewer_options(sampler: str, curves: list[str]) -> str | None:
    """Among `curves`, the semi spelling of the same sampler whose options are a strict part of `sampler`'s (the
    most of them; None where `sampler` is not semi or none ran): the same rule without the options it adds."""
    if not sampler.startswith(SEMI):
        return None
    name, options = sampler_and_options(sampler.removeprefix(SEMI))
    within = []
    for curve in curves:
        other, others = sampler_and_options(curve.removeprefix(SEMI)) if curve.startswith(SEMI) else ("", {})
        if curve != sampler and curve.startswith(SEMI) and other == name and others.items() < options.items():
            within.append((len(others), curve))
    return max(within)[1] if within else None


def supervised_counterpart(sampler: str) -> str | None:
    """The same curve on the labels alone: semi:NAME's is NAME, pooled-em:NAME's pooled:NAME; None for others."""
    for prefix, supervised in SUPERVISED.items():
        if sampler.startswith(prefix):
            return supervised + sampler.removeprefix(prefix)
    return None


def curve_summary(result: dict[str, Any], sampler: str, watched: list[int]) -> dict[str, Any]:
    """One curve: against the supervised camera default, (a semi-supervised spelling) the same on the labels alone
    (supervised_counterpart) and the rule without the options the spelling adds (fewer_options), against random
    (camera_al's intervals), its final per-class recall and that of the watched classes."""
    runs, found = result["runs"], result["intervals"][sampler]["federated"]
    base = supervised_counterpart(sampler)
    recall = result["final_class_recall"][sampler]
    plainer = fewer_options(sampler, list(result["summary"]["federated"]))
    return {
        "vs_camera_default": paired(runs, sampler, DEFAULT) if sampler != DEFAULT else None,
        "vs_own_sampler": paired(runs, sampler, base) if base is not None else None,
        "vs_rule_without_options": paired(runs, sampler, plainer) if plainer is not None else None,
        "vs_random": {
            "aulc_gain_interval": found["aulc_gain_interval"],
            "reach_share_interval": found["reach_share_interval"],
            "never": found["never"],
            "fraction_of_random_labels_mean_curve": result["summary"]["federated"][sampler][
                "fraction_of_random_labels"
            ],
        },
        "final": result["summary"]["federated"][sampler]["final"],
        "final_class_recall": recall,
        "watched_class_recall": [recall[c] for c in watched],
    }


def setting_summary(result: dict[str, Any]) -> dict[str, Any]:
    """The camera default and every semi spelling of one camera_al run."""
    names = [name for name, _ in result["settings"]["classes"]]
    watched = watched_classes(result)
    curves = [name for name in result["summary"]["federated"] if name == DEFAULT or name.startswith(SHOWN)]
    return {
        "setting": result["settings"]["setting"] or "",
        "watched_classes": [names[c] for c in watched],
        "curves": {sampler: curve_summary(result, sampler, watched) for sampler in curves},
    }


def reach(found: dict[str, Any]) -> str:
    """The reach share's interval in percent, or how many seeds never reached random's final."""
    if found["reach_share_interval"] is not None:
        return shown(found["reach_share_interval"], 100, 0) + "%"
    return f"never on {found['never']} seeds"


def gain(found: dict[str, Any] | None, key: str) -> str:
    """A paired gain's interval, or `-`."""
    return "-" if found is None else shown(found[key])


def table_rows(summary: dict[str, Any]) -> list[str]:
    """One markdown row per curve of a setting."""
    rows = []
    for sampler, found in summary["curves"].items():
        recall = " / ".join(
            f"{name} {value:.2f}" for name, value in zip(summary["watched_classes"], found["watched_class_recall"])
        )
        rows.append(
            f"| {summary['setting']} | `{sampler}` | {gain(found['vs_camera_default'], 'early_gain_interval')} |"
            f" {gain(found['vs_camera_default'], 'aulc_gain_interval')} |"
            f" {gain(found['vs_own_sampler'], 'early_gain_interval')} |"
            f" {gain(found['vs_rule_without_options'], 'early_gain_interval')} /"
            f" {gain(found['vs_rule_without_options'], 'aulc_gain_interval')} |"
            f" {shown(found['vs_random']['aulc_gain_interval'])} | {reach(found['vs_random'])} | {recall} |"
        )
    return rows


def tables_main(
    doc: str | None,
    summarise: Callable[[dict[str, Any]], dict[str, Any]],
    rows: Callable[[dict[str, Any]], list[str]],
    head: str,
) -> None:
    """The stats scripts' command line: every camera_al JSON summarised, the markdown table (`head`, then each
    setting's rows) printed, both written under --out."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", nargs="+", type=Path, help="camera_al.py's JSON, one per setting")
    parser.add_argument("--out", type=Path, help="write summary.json and table.md here")
    args = parser.parse_args()
    summaries = [summarise(json.loads(path.read_text())) for path in args.results]
    table = "\n".join([head, *(row for summary in summaries for row in rows(summary))])
    print(table)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "summary.json").write_text(json.dumps(summaries, indent=1) + "\n")
        (args.out / "table.md").write_text(table + "\n")


def main() -> None:
    """Every JSON's summary, the table printed, both written under --out."""
    tables_main(__doc__, setting_summary, table_rows, TABLE_HEAD)


if __name__ == "__main__":
    main()
