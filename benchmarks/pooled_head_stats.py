# The pooled head's statistics over camera_al runs: its gap to the probe, its gain over FedAvg, the served accuracy.
"""Pure functions over camera_al's runs where each sampler ran twice, as FedAvg of trained heads ("NAME") and as the
pooled head ("pooled:NAME"): per round, the federated curve's mean gap to the centralised probe on the same labels;
paired by seed, the pooled head's AULC gain over FedAvg's; and each device's served accuracy on test images dealt
like its pool (its class prior adapted, edge_agent.learning.prior_shift; and plain EM for comparison) against the
global head's on the same images: the AULC gain's 90% t-interval and the worst single point of any seed.

Usage: python benchmarks/pooled_head_stats.py OUT/<setting>/camera_al.json ... [--figures]
  prints the markdown table docs/benchmarks/pooled_head quotes and writes summary.json beside the first JSON's
  folder's parent; --figures draws pooled.png (accuracy against labels) beside each JSON
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import numpy as np
from camera_al_stats import DEFAULT, t_interval

POOLED = "pooled:"
SAMPLERS = ("random", DEFAULT)
HEAD = (
    "| setting | sampler | head | AULC | gap to the probe at 40 / 80 / 120 / 200 / 400 labels (worst of all 10), points | AULC gain over "
    "FedAvg, 90% CI | served vs global AULC gain, 90% CI | served: worst point | plain EM: AULC gain, worst point |\n"
    "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"
)
BUDGETS = (40, 80, 120, 200, 400)


def keyed(runs: list[dict[str, Any]], partition: str) -> dict[tuple[str, int], dict[str, Any]]:
    """The runs of one partition by (sampler, seed)."""
    return {(run["sampler"], run["seed"]): run for run in runs if run["partition"] == partition}


def probe_gaps(runs: list[dict[str, Any]], sampler: str) -> dict[int, float]:
    """Labels -> the mean over seeds of the federated accuracy minus the probe's on the same labels (points)."""
    federated, central = keyed(runs, "federated"), keyed(runs, "centralised")
    pairs = [(run, central[key]) for key, run in federated.items() if key[0] == sampler]
    gaps = np.mean([np.subtract(run["accuracy"], probe["accuracy"]) for run, probe in pairs], axis=0) * 100
    return {int(labels): round(float(gap), 2) for labels, gap in zip(pairs[0][0]["labels"], gaps)}


def aulc_gain(runs: list[dict[str, Any]], sampler: str, baseline: str) -> dict[str, Any]:
    """The paired 90% t-interval of sampler's AULC minus baseline's (points), over the seeds both ran."""
    federated = keyed(runs, "federated")
    seeds = sorted(seed for name, seed in federated if name == sampler and (baseline, seed) in federated)
    gains = [
        100 * (np.mean(federated[sampler, s]["accuracy"]) - np.mean(federated[baseline, s]["accuracy"])) for s in seeds
    ]
    return t_interval(gains)


def served_gain(runs: list[dict[str, Any]], sampler: str, served: str) -> dict[str, Any]:
    """The device-served accuracy (`served`: "served" or "em") against the global head's on the same devices' test
    images: the paired AULC gain's interval over seeds and the worst point of any seed and round (points)."""
    federated = [run for (name, _), run in keyed(runs, "federated").items() if name == sampler]
    gains = np.array([[point[served] - point["global"] for point in run["served"]] for run in federated]) * 100
    return {**t_interval(gains.mean(axis=1).tolist()), "worst_point": round(float(gains.min()), 2)}


def setting_summary(result: dict[str, Any]) -> dict[str, Any]:
    """Per sampler and head: the AULC, the gaps to the probe, the gain over FedAvg (pooled head) and the served
    accuracy's gains."""
    runs, found = result["runs"], {}
    for sampler in SAMPLERS:
        for name in (sampler, POOLED + sampler):
            if not any(run["sampler"] == name for run in runs):
                continue
            federated = [run for (spelled, _), run in keyed(runs, "federated").items() if spelled == name]
            found[name] = {
                "aulc": round(100 * float(np.mean([np.mean(run["accuracy"]) for run in federated])), 2),
                "probe_gap_points": probe_gaps(runs, name),
                "served": served_gain(runs, name, "served"),
                "em": served_gain(runs, name, "em"),
                **({"gain_over_fedavg": aulc_gain(runs, name, sampler)} if name.startswith(POOLED) else {}),
            }
    return found


def shown(interval: dict[str, Any]) -> str:
    """mean [low, high] in points."""
    return f"{interval['mean']:+.1f} [{interval['low']:+.1f}, {interval['high']:+.1f}]"


def table_rows(setting: str, found: dict[str, Any]) -> list[str]:
    """The markdown rows of one setting."""
    rows = []
    for name, entry in found.items():
        head = "pooled" if name.startswith(POOLED) else "FedAvg"
        gaps = " / ".join(f"{entry['probe_gap_points'].get(b, float('nan')):+.1f}" for b in BUDGETS)
        gaps += f" (worst {min(entry['probe_gap_points'].values()):+.1f})"
        gain = shown(entry["gain_over_fedavg"]) if "gain_over_fedavg" in entry else "-"
        em = f"{entry['em']['mean']:+.1f}, {entry['em']['worst_point']:+.1f}"
        rows.append(
            f"| {setting} | `{name.removeprefix(POOLED)}` | {head} | {entry['aulc']:.1f} | {gaps} | {gain} | "
            f"{shown(entry['served'])} | {entry['served']['worst_point']:+.1f} | {em} |"
        )
    return rows


def figure(result: dict[str, Any], path: Path) -> None:
    """Mean accuracy against labels: FedAvg, the pooled head, the probe on the pooled head's labels, and what the
    pooled head's devices serve, per sampler."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = result["runs"]
    figure_, axes = plt.subplots(1, len(SAMPLERS), figsize=(12, 4.2), sharey=True)
    for axis, sampler in zip(np.atleast_1d(axes), SAMPLERS):
        federated, central = keyed(runs, "federated"), keyed(runs, "centralised")
        curves = {
            "FedAvg of trained heads": [run["accuracy"] for (n, _), run in federated.items() if n == sampler],
            "pooled head": [run["accuracy"] for (n, _), run in federated.items() if n == POOLED + sampler],
            "probe, same labels": [run["accuracy"] for (n, _), run in central.items() if n == POOLED + sampler],
            "pooled head, devices' own images": [
                [p["global"] for p in run["served"]] for (n, _), run in federated.items() if n == POOLED + sampler
            ],
            "pooled head, served (adapted)": [
                [p["served"] for p in run["served"]] for (n, _), run in federated.items() if n == POOLED + sampler
            ],
        }
        labels = next(run["labels"] for (n, _), run in federated.items() if n == sampler)
        for name, values in curves.items():
            if values:
                data = np.asarray(values)
                axis.plot(labels, data.mean(0), marker=".", label=name)
                axis.fill_between(labels, data.min(0), data.max(0), alpha=0.12)
        axis.set_title(f"{result['settings'].get('setting') or ''}: {sampler}", fontsize=9)
        axis.set_xlabel("labels (fleet)")
        axis.grid(alpha=0.3)
    np.atleast_1d(axes)[0].set_ylabel("test accuracy (mean of seeds, band: min-max)")
    np.atleast_1d(axes)[0].legend(fontsize=7)
    figure_.tight_layout()
    figure_.savefig(path, dpi=110)
    plt.close(figure_)


def main() -> None:
    """The table over the settings given, summary.json beside them, figures on request."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", nargs="+", type=Path, help="camera_al.py's JSON, one per setting")
    parser.add_argument("--figures", action="store_true", help="draw pooled.png beside each JSON")
    args = parser.parse_args()
    rows, summary = [HEAD], {}
    for path in args.results:
        result = json.loads(path.read_text())
        setting = result["settings"].get("setting") or path.parent.name
        summary[setting] = setting_summary(result)
        rows += table_rows(setting, summary[setting])
        if args.figures:
            figure(result, path.parent / "pooled.png")
    (args.results[0].parent.parent / "summary.json").write_text(json.dumps(summary, indent=1))
    print("\n".join(rows))


if __name__ == "__main__":
    main()
