# FAST's kNN weak labels after a bench run: the device's own human labels as references against as many random ones.
"""For each finished bench run directory (from `label_efficiency.py --samplers fast...`), each device's final
human labels (its seeds and FAST's picks) vote the kNN label of every other pool sample in the run's encoder space,
exactly as FAST does; the same vote from the same number of uniformly drawn pool samples (plus the same seeds) is
the reference. Prints JSON: per run, the mean accuracy of both against the shards' ground truth.

Usage: python benchmarks/fast_references.py RUN_DIR... [--encoder FILE.onnx] [--knn-k 10] [--seed 0]
(the encoder defaults to RUN_DIR/encoder.onnx, what the coordinator exported from W0)
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
from label_efficiency import finished_device

from edge_agent.learning.acquisition_scores import knn_labels
from edge_agent.learning.encoder import OnnxEncoder


def vote_accuracy(embeddings: np.ndarray, truth: np.ndarray, references: np.ndarray, pool: int, k: int) -> float:
    """Accuracy of the kNN vote of `references` (their true labels) over the pool samples not among them."""
    rest = np.setdiff1d(np.arange(pool), references)
    voted = knn_labels(embeddings[rest], embeddings[references], truth[references], k, int(truth.max()) + 1)
    return float(np.mean(voted == truth[rest]))


def device_accuracies(device: Path, encoder: OnnxEncoder, k: int, rng: np.random.Generator) -> tuple[float, float]:
    """(FAST's references, random references) for one device of a finished run."""
    shard, record = finished_device(device)
    truth, human = shard.all_labels, record.indices[record.human]
    drawn = rng.choice(len(shard.images), len(human) - len(shard.seed_indices), replace=False)
    embeddings = encoder.embed(shard.all_images)
    picked = vote_accuracy(embeddings, truth, human, len(shard.images), k)
    uniform = vote_accuracy(embeddings, truth, np.concatenate([drawn, shard.seed_indices]), len(shard.images), k)
    return picked, uniform


def main() -> None:
    """Prints, per run directory, the weak-label accuracy from FAST's own references and from random ones."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", type=Path)
    parser.add_argument("--encoder", type=Path, help="the encoder the runs used (default RUN_DIR/encoder.onnx)")
    parser.add_argument("--knn-k", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    for run in args.runs:
        encoder = OnnxEncoder((args.encoder or run / "encoder.onnx").read_bytes(), threads=2)
        rng = np.random.default_rng(args.seed)
        pairs = [device_accuracies(d, encoder, args.knn_k, rng) for d in sorted((run / "devices").iterdir())]
        picked, uniform = np.mean(pairs, axis=0)
        print(
            json.dumps({"run": run.name, "fast_references": round(picked, 4), "random_references": round(uniform, 4)})
        )


if __name__ == "__main__":
    main()
