"""How often the pooled head's suspicion (coordinator.intake.label_agreement) flags a camera whose person answers at
random, and how often an honest one, on camera_al.py's cached fleets (EfficientNet-Lite0 features of the bench's
rendered scenes: 4 devices, 10 classes).

Each seed draws every device's labelled rows uniformly from its pool, the same for every budget (LABELS per device,
each a round's statistics: class sums and shares over those rows); the liar's answers are uniform over the classes
(or, with --liar shifted, each truth's next class). Every device's statistics go through label_margins and
disagreeing_devices, as the round aggregator judges a round. Per budget: how many seeds flagged the liar, and how many honest devices were
flagged in the runs with a liar and in the runs without one. With --dirichlet the same scenes are dealt non-IID
(camera_al_fleet.redealt). Prints one JSON object.

Usage: python benchmarks/statistics_suspects.py CACHE.npz [--dirichlet 0.3] [--liar random|shifted] [--seeds 10]
       (CACHE: a features-*.npz camera_al.py --features-only wrote under its --work)
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
from camera_al_fleet import redealt

from coordinator.intake.label_agreement import disagreeing_devices, label_margins
from coordinator.strategies.aggregate import ClientUpdate
from protocol.head_statistics import HeadStatistics

DEVICES, CLASSES, LIAR = 4, 10, "cam-3"
BUDGETS = (10, 20, 40, 70, 100)


def round_updates(fleet: dict[str, np.ndarray], orders: list[np.ndarray], labels: int, liar: str | None, seed: int):
    """Each device's statistics update over its first `labels` rows; the liar's answers as --liar says."""
    rng = np.random.default_rng([seed, labels])
    updates = []
    for number in range(DEVICES):
        rows = orders[number][:labels]
        answers = fleet[f"labels_{number}"][rows]
        if liar is not None and number == DEVICES - 1:
            answers = rng.integers(CLASSES, size=labels) if liar == "random" else (answers + 1) % CLASSES
        statistics = HeadStatistics.of_labels(fleet[f"features_{number}"][rows], answers, CLASSES)
        updates.append(ClientUpdate(f"cam-{number}", statistics.tensors(), float(labels)))
    return updates


def measured(fleet: dict[str, np.ndarray], args: argparse.Namespace, liar: str | None) -> dict[str, dict]:
    """Per budget: seeds whose liar was flagged, honest devices flagged, and the mean label margin per device."""
    found: dict[str, dict] = {}
    for labels in BUDGETS:
        caught, honest_flagged, margins = 0, 0, []
        for seed in range(args.seeds):
            dealt = redealt(fleet, DEVICES, args.dirichlet, seed) if args.dirichlet else fleet
            orders = [np.random.default_rng([seed, n]).permutation(len(dealt[f"labels_{n}"])) for n in range(DEVICES)]
            updates = round_updates(dealt, orders, labels, liar, seed)
            judged = label_margins(updates)
            suspects = disagreeing_devices(judged)
            caught += LIAR in suspects
            honest_flagged += len(set(suspects) - {LIAR}) if liar else len(suspects)
            margins.append([judged.get(f"cam-{n}", np.nan) for n in range(DEVICES)])
        found[str(labels)] = {
            **({"liar_flagged": caught} if liar else {}),
            "honest_flagged": honest_flagged,
            "honest_judged": args.seeds * (DEVICES - 1 if liar else DEVICES),
            "mean_margin": [mean_of_judged(column) for column in np.array(margins).T],
        }
    return found


def mean_of_judged(margins: np.ndarray) -> float | None:
    """The mean over the seeds that judged the device (None when none did)."""
    judged = margins[np.isfinite(margins)]
    return round(float(judged.mean()), 2) if len(judged) else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("cache", type=Path)
    parser.add_argument("--dirichlet", type=float, default=0.0)
    parser.add_argument("--liar", choices=("random", "shifted"), default="random")
    parser.add_argument("--seeds", type=int, default=10)
    args = parser.parse_args()
    with np.load(args.cache) as arrays:
        fleet = {name: arrays[name] for name in arrays.files}
    print(
        json.dumps(
            {
                "cache": args.cache.name,
                "dirichlet": args.dirichlet,
                "liar": args.liar,
                "seeds": args.seeds,
                "with_liar": measured(fleet, args, args.liar),
                "honest_fleet": measured(fleet, args, None),
            }
        )
    )


if __name__ == "__main__":
    main()
