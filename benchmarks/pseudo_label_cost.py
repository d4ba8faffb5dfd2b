# What a round of the pseudo-labels rule costs a head-only device: selection plus training time, and peak memory.
"""One round of a camera device under the pseudo-labels rule (edge_agent.learning.propagation), over cached feature
rows as its feature cache holds them (float16, read as float32; EfficientNet-Lite0's 1280 features): the camera
default's acquisition of 10 (typical-then-balanced-margin in its margin phase: 10 MC-dropout passes of the head
over the pool, the devices' numpy loop) holding --labels human labels, then the rule's training (a teacher on the
labels, the kNN graph and propagation over the pool, the teacher trained on with its pseudo-labels; the recipe's
SGD). Beside it, kept-labels' training alone. The rows are camera_al's cached features (--features, resampled with
replacement) or, without it, synthetic ones. The time is over --rows (median of --tries); the peak RSS (VmHWM)
comes from a fresh process (no torch, as on a Pi Zero 2 W) running one round over --pi-rows, the profile's pool
cap, beside the RSS it held after its imports. Prints one JSON object.

Usage: python benchmarks/pseudo_label_cost.py [--features runs/camera-al/features-....npz] [--rows 10000]
       [--pi-rows 4000] [--labels 40] [--tries 3]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
from camera_al_stats import DEFAULT

from edge_agent.learning.head_training import HeadSettings, softmax, train_classifier
from edge_agent.learning.heuristics import AcquisitionContext, Embeddings
from edge_agent.learning.local_rules import KeptLabels, PseudoLabelled
from edge_agent.learning.mc_scorer import DropoutSpec, mc_probabilities
from edge_agent.learning.ort_scorer import DEFAULT_BATCH, TAIL_ROWS
from edge_agent.learning.sampling import make_sampler
from protocol import messages

CLASSES = 10
FEATURES = 1280  # EfficientNet-Lite0's pooled features (edge_agent.learning.efficientnet holds it, and imports torch)
DROPOUT = 0.2  # the head's one dropout, EfficientNetLite0.default_dropout (the same module)
RECIPE = messages.Recipe(local_rule=PseudoLabelled.name, options={"logit_adjustment": 1.0})


def peak_rss_mb() -> float:
    """This process's peak resident set (VmHWM) in MB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def cached_rows(path: Path | None, rows: int, labels: int) -> tuple[np.ndarray, np.ndarray]:
    """(rows + labels feature rows as float32 read from float16, their classes): camera_al's cached pools resampled
    with replacement, or synthetic rows (ten clusters of ReLU6-clipped features) without a cache."""
    rng = np.random.default_rng(0)
    if path is None:
        truth = rng.integers(CLASSES, size=rows + labels)
        means = rng.uniform(0.0, 1.0, size=(CLASSES, FEATURES))
        features = np.clip(means[truth] + rng.normal(0.0, 1.0, (rows + labels, FEATURES)), 0.0, 6.0)
        return features.astype(np.float16).astype(np.float32), truth
    with np.load(path) as cached:
        names = sorted(name for name in cached.files if name.startswith("features_"))[:-1]  # the last is the test set
        features = np.concatenate([cached[name] for name in names])
        truth = np.concatenate([cached[name.replace("features_", "labels_")] for name in names])
    drawn = rng.integers(len(features), size=rows + labels)
    return features[drawn].astype(np.float16).astype(np.float32), truth[drawn]


def settings(seed: int) -> HeadSettings:
    """The recipe's SGD with the head's dropout."""
    recipe = RECIPE
    return HeadSettings(
        recipe.epochs,
        recipe.batch_size,
        recipe.learning_rate,
        recipe.momentum,
        recipe.weight_decay,
        DROPOUT,
        seed,
        recipe.lr_schedule,
    )


def selection(pool: np.ndarray, human: np.ndarray, labels: np.ndarray, head: tuple[np.ndarray, np.ndarray]) -> None:
    """The camera default's acquisition of 10 over the pool: MC-dropout passes of the head, then its sampler."""
    weight, bias = head
    spec = DropoutSpec((DROPOUT,), ((FEATURES,),))

    def probabilities() -> np.ndarray:
        return mc_probabilities(
            lambda x: x.reshape(len(x), -1),
            lambda h, masks: softmax((h * masks[0]) @ weight.T + bias),
            spec,
            pool[:, :, None, None],
            RECIPE.mc_passes,
            0,
            DEFAULT_BATCH,
            TAIL_ROWS,
        )

    context = AcquisitionContext(
        num_samples=len(pool),
        rng=np.random.default_rng(0),
        class_counts=np.bincount(labels, minlength=CLASSES),
        options={},
        probabilities=cache(probabilities),
        own_logits=lambda: np.zeros(0),
        global_logits=lambda: np.zeros(0),
        embeddings=cache(lambda: Embeddings(pool, human, labels)),
        features=lambda: pool,
        labelled_features=lambda: human,
    )
    make_sampler(DEFAULT).choose(context, 10)


def one_round(features: np.ndarray, truth: np.ndarray, labels: int, semi: bool) -> dict[str, float]:
    """Seconds of one acquisition and of one training (the pseudo-labels rule, or kept-labels alone) of a device
    holding the first `labels` rows as human labels and the rest as its pool."""
    rng = np.random.default_rng(1)
    head = (rng.normal(0.0, 0.01, (CLASSES, FEATURES)).astype(np.float32), np.zeros(CLASSES, np.float32))
    human, known, pool = features[:labels], truth[:labels], features[labels:]
    started = time.perf_counter()
    selection(pool, human, known, head)
    chosen = time.perf_counter()
    bias = KeptLabels().logit_bias(known, CLASSES, RECIPE)
    if semi:
        PseudoLabelled().semi_supervised(pool, RECIPE).trained(human, known, pool, head, settings(0), bias)
    else:
        train_classifier(human, known, *head, settings(0), bias)
    return {"selection": chosen - started, "training": time.perf_counter() - chosen}


def timed(features: np.ndarray, truth: np.ndarray, labels: int, tries: int, semi: bool) -> dict[str, Any]:
    """The median over `tries` rounds of selection, training and both, with every try's total."""
    found = [one_round(features, truth, labels, semi) for _ in range(tries)]
    totals = [round(sum(times.values()), 3) for times in found]
    return {
        "selection_seconds": round(float(np.median([times["selection"] for times in found])), 3),
        "training_seconds": round(float(np.median([times["training"] for times in found])), 3),
        "round_seconds": round(float(np.median(totals)), 3),
        "tries": totals,
    }


def child(rows: Path) -> dict[str, Any]:
    """One round over the rows saved at `rows` (float16, as a feature cache holds them) in this fresh process: its
    peak RSS after the imports and after the round."""
    imported = peak_rss_mb()
    with np.load(rows) as saved:
        features, truth = saved["features"].astype(np.float32), saved["truth"]
    labels = int(len(truth) - saved_pool(rows))
    times = one_round(features, truth, labels, True)
    return {
        "rows": len(truth) - labels,
        "torch_loaded": "torch" in sys.modules,
        "peak_rss_mb_after_imports": round(imported, 1),
        "peak_rss_mb": round(peak_rss_mb(), 1),
        **{f"{name}_seconds": round(value, 3) for name, value in times.items()},
    }


def saved_pool(rows: Path) -> int:
    """The pool size a child's rows file names (rows-POOL.npz)."""
    return int(rows.stem.split("-")[-1])


def parse_args() -> argparse.Namespace:
    """The rows, labels, tries and the feature cache."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--features", type=Path, help="camera_al's feature cache (.npz); synthetic rows without it")
    for flag, default in (("rows", 10000), ("pi-rows", 4000), ("labels", 40), ("tries", 3)):
        parser.add_argument(f"--{flag}", type=int, default=default)
    parser.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.features is not None and not args.features.is_file():
        parser.error(f"--features {str(args.features)[:200]!r} is not a file (camera_al.py --features-only writes it)")
    if min(args.rows, args.pi_rows, args.labels, args.tries) < 1:
        parser.error("--rows, --pi-rows, --labels and --tries must be at least 1")
    return args


def pi_round(features: np.ndarray, truth: np.ndarray, args: argparse.Namespace) -> dict[str, Any]:
    """The Pi-sized round's memory: its rows saved as float16, then one round in a fresh process (child)."""
    count = args.pi_rows + args.labels
    with tempfile.TemporaryDirectory() as folder:
        rows = Path(folder) / f"rows-{args.pi_rows}.npz"
        np.savez(rows, features=features[:count].astype(np.float16), truth=truth[:count])
        script = str(Path(__file__).resolve())
        done = subprocess.run(
            [sys.executable, script, "--child", str(rows)], check=True, capture_output=True, text=True
        )
    found: dict[str, Any] = json.loads(done.stdout)
    return found


def main() -> None:
    """The timings over --rows here, then the Pi-sized round's memory in a fresh process; one JSON object."""
    args = parse_args()
    if args.child is not None:
        print(json.dumps(child(args.child)))
        return
    features, truth = cached_rows(args.features, max(args.rows, args.pi_rows), args.labels)
    result = {
        "rows": args.rows,
        "labels": args.labels,
        "features": str(args.features) if args.features else "synthetic",
        "cpus": os.cpu_count(),
        "threads": {name: os.environ.get(name) for name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS")},
        "pseudo_labels": timed(features[: args.rows + args.labels], truth, args.labels, args.tries, True),
        "kept_labels": timed(features[: args.rows + args.labels], truth, args.labels, args.tries, False),
        "pi_zero_round": pi_round(features, truth, args),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
