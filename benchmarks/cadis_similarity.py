# CADIS on a clusters:K bench: the running classifier-update similarity within and across the true clusters, per round.
"""Why CADIS forms clusters or not. Runs one `simulate` with the clusters:K partition, the CADIS strategy and its
cadis-kd local rule (or reads a finished run with --run-dir), then, from the CADIS state the coordinator stored
with every round, prints one JSON object per round:

  similarity_within / similarity_across   mean, min and max of the running similarity S_ij (Eq. 11-12) over
                                          the observed pairs of devices in the same true cluster / in different ones
  q_within / q_across                     the same for the rescaled Q_ij that the threshold cuts
  threshold                               tau of that round; cluster_sizes: |C(k)| per device under it
  separating_thresholds                   [max Q across, min Q within] when some tau would recover the true
                                          clusters exactly, else null

Usage: python benchmarks/cadis_similarity.py [--clusters 3] [--devices 9] [--rounds 6] [--pool 500]
       [--labels 50] [--epochs 5] [--lr 0.01] [--momentum 0.9] [--split] [--seed 0] [--run-dir DIR]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import numpy as np
from label_efficiency import RunSpec, Scale, run_one

from bench.partition import cluster_members
from coordinator.storage.store import RunStore
from coordinator.strategies.cadis import CadisState, cluster_sizes, q_matrix, running_similarity


def stored_states(run_dir: Path) -> list[tuple[int, CadisState, float]]:
    """(round id, CADIS state after it, the tau the round clustered with, from its report) for every committed
    round of the run."""
    with RunStore(run_dir, read_only=True) as store:
        taus = {record.round_id: float(record.report["threshold"]) for record in store.rounds()}
        rows = store.database.read(
            "SELECT round_id, body FROM strategy_state WHERE strategy = 'cadis' ORDER BY round_id"
        )
    return [(round_id, CadisState.from_json(json.loads(body)), taus[round_id]) for round_id, body in rows]


def spread(values: np.ndarray) -> dict[str, float] | None:
    """Mean, min and max of the values (None for none)."""
    if values.size == 0:
        return None
    return {
        "mean": round(float(values.mean()), 4),
        "min": round(float(values.min()), 4),
        "max": round(float(values.max()), 4),
    }


def pair_masks(
    devices: list[str], clusters: int, num_devices: int, observed: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Masks of the observed off-diagonal pairs in the same true cluster and in different ones (device ids are
    the bench's dev-NN, NN its index in the partition)."""
    cluster_of = {
        int(index): group for group, members in enumerate(cluster_members(num_devices, clusters)) for index in members
    }
    truth = np.array([cluster_of[int(device.rsplit("-", 1)[1])] for device in devices])
    same = truth[:, None] == truth[None, :]
    off_diagonal = ~np.eye(len(devices), dtype=bool)
    return same & off_diagonal & observed, ~same & observed


def round_view(round_id: int, state: CadisState, clusters: int, num_devices: int, threshold: float) -> dict[str, Any]:
    """One round's similarity and Q within and across the true clusters, the cluster sizes under `threshold` (the
    tau the round used) and the thresholds that would separate the clusters."""
    observed = state.counts > 0
    similarity = running_similarity(state.sums, state.counts)
    q = q_matrix(similarity, observed)
    within, across = pair_masks(state.devices, clusters, num_devices, observed)
    separable = bool(within.any() and across.any() and q[across].max() < q[within].min())
    return {
        "round": round_id,
        "similarity_within": spread(similarity[within]),
        "similarity_across": spread(similarity[across]),
        "q_within": spread(q[within]),
        "q_across": spread(q[across]),
        "threshold": round(threshold, 4),
        "cluster_sizes": dict(zip(state.devices, cluster_sizes(q, threshold).tolist())),
        "separating_thresholds": [round(float(q[across].max()), 4), round(float(q[within].min()), 4)]
        if separable
        else None,
    }


def main() -> None:
    """Runs (or reads) the clusters:K CADIS run and prints its per-round view."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for key, default in (
        ("clusters", 3),
        ("devices", 9),
        ("rounds", 6),
        ("pool", 500),
        ("labels", 50),
        ("epochs", 5),
        ("seed", 0),
    ):
        parser.add_argument(f"--{key}", type=int, default=default)
    parser.add_argument("--lr", type=float, default=0.01, help="local SGD learning rate (the authors': 1e-3)")
    parser.add_argument("--momentum", type=float, default=0.9, help="local SGD momentum")
    parser.add_argument("--split", action="store_true", help="CADIS's tau from the data each round (--cadis-split 1)")
    parser.add_argument("--run-dir", type=Path, help="a finished clusters:K CADIS run to read instead of running one")
    parser.add_argument("--out", type=Path, default=Path("runs") / "cadis-similarity")
    args = parser.parse_args()
    partition = f"clusters:{args.clusters}"
    run_dir = args.run_dir
    if run_dir is None:
        scale = Scale({partition: args.devices}, args.pool, args.rounds, args.labels, args.epochs, mc_passes=4)
        recipe = {"learning_rate": args.lr, "momentum": args.momentum}
        strategy_options = {"split": 1.0} if args.split else {}
        spec = RunSpec(partition, "entropy", args.seed, "cadis", "cadis-kd", scale, args.out, recipe, strategy_options)
        curve = run_one(spec)
        print(json.dumps({"accuracy": curve["accuracy"], "labels": curve["labels"], "seconds": curve["seconds"]}))
        run_dir = args.out / spec.name
    for round_id, state, threshold in stored_states(run_dir):
        print(json.dumps(round_view(round_id, state, args.clusters, args.devices, threshold)))


if __name__ == "__main__":
    main()
