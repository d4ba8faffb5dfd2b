# What a class sum over k labels tells whoever reads it: how often it picks out the labelled images among a pool.
"""The privacy guide's numbers for the pooled head: a device's class sum over k human labels of one class (what
pooled-head's statistics carry in the clear without secure aggregation, and what the fleet's sum is when the whole
fleet holds k labels of a class) is the mean of those k images' 1280 backbone features. Given the cached features of
a camera fleet (camera_al's cache: --features, the .npz its --work holds) as the candidates a curious coordinator
might hold (the images themselves, or the same scenes from elsewhere), for each k: how often the k labelled images
are the k candidates nearest the class mean (cosine), and how often each one is among the nearest 10, over --trials
draws. Prints one JSON object.

Usage: python benchmarks/pooled_head_exposure.py --features runs/camera-al/features-....npz [--trials 200]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from protocol.head_statistics import HeadStatistics


def exposure(pool: np.ndarray, labels: np.ndarray, k: int, trials: int, seed: int) -> dict[str, float]:
    """Over `trials` draws of k same-class images of the pool: the share whose class sum's k nearest candidates are
    exactly them, and the share of the k that are among its 10 nearest."""
    rng = np.random.default_rng(seed)
    unit = pool / np.linalg.norm(pool, axis=1, keepdims=True)
    exact, top10 = 0, 0
    for _ in range(trials):
        chosen = rng.choice(np.flatnonzero(labels == rng.choice(np.unique(labels))), k, replace=False)
        statistics = HeadStatistics.of_labels(pool[chosen], np.zeros(k, np.int64), 1)
        mean = statistics.class_sums[0] / statistics.class_counts[0]
        order = np.argsort(-(unit @ (mean / np.linalg.norm(mean))))
        exact += set(order[:k].tolist()) == set(chosen.tolist())
        top10 += len(set(order[:10].tolist()) & set(chosen.tolist()))
    return {
        "k": k,
        "exactly_the_k_nearest": round(exact / trials, 3),
        "each_in_the_10_nearest": round(top10 / (trials * k), 3),
    }


def main() -> None:
    """Each k of 1, 2, 5, 10 over the fleet's pools as the candidates."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--features", type=Path, required=True)
    parser.add_argument("--trials", type=int, default=200)
    args = parser.parse_args()
    cache = np.load(args.features)
    devices = sorted(int(key.removeprefix("features_")) for key in cache.files if key.startswith("features_"))[:-1]
    pool = np.concatenate([cache[f"features_{n}"] for n in devices]).astype(np.float64)
    labels = np.concatenate([cache[f"labels_{n}"] for n in devices])
    found = [exposure(pool, labels, k, args.trials, seed=k) for k in (1, 2, 5, 10)]
    print(json.dumps({"candidates": len(pool), "trials": args.trials, "exposure": found}))


if __name__ == "__main__":
    main()
