# Scoring a head-only device's pool from its feature cache against the uncached path, in one run; prints JSON.
"""Usage: python benchmarks/feature_cache.py [--rows 10000] [--passes 20] [--baseline-images 300] [--side 32]

A MobileNet of width 1.25 (1280 features before its one dropout, 0.2, and a 1280->10 classifier) with a frozen
prefix (trainable = "head") is exported as a bundle. The cache is filled with random float16 rows tied to random
image digests (the cost depends on neither's values); one round's scoring then reads the rows, checks each one's
tag (sha256 of the key, the image's digest and the row) and that it is finite, and runs the tail `passes` times
(`HeadLearner.probabilities`' path). The uncached baseline scores `baseline-images` random images of `side` px
through prefix and tail, per image; the issue's target is under 2 s for 10000 cached rows.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from edge_agent.data.device_data import Samples
from edge_agent.data.feature_cache import FeatureCache
from edge_agent.learning.bundle import Bundle, load_bundle
from edge_agent.learning.cached_prefix import CachedPrefix, prefix_frozen, prefix_key
from edge_agent.learning.models import build_model, get_weights
from edge_agent.learning.ort_scorer import OrtMCDropout
from export.bundle_writer import write_bundle
from protocol.model_spec import ModelSpec
from protocol.tensors import Weights

T = TypeVar("T")


def spec(side: int) -> ModelSpec:
    """The benchmark's model: MobileNet 1.25 (1280 features), 10 classes, dropout 0.2, frozen prefix."""
    return ModelSpec(
        architecture="mobilenet",
        channels=3,
        height=side,
        width=side,
        mean=[0.5] * 3,
        std=[0.5] * 3,
        class_names=[f"class{index}" for index in range(10)],
        width_multiplier=1.25,
        dropout=[0.2],
        trainable="head",
    )


def timed(work: Callable[[], T]) -> tuple[T, float]:
    """(result, seconds) of work()."""
    started = time.perf_counter()
    result = work()
    return result, time.perf_counter() - started


def cached_rounds(bundle: Bundle, folder: Path, weights: Weights, args: argparse.Namespace) -> dict[str, Any]:
    """Fills the cache with random rows, then times `repeats` rounds of reading (and checking) them and scoring."""
    rng = np.random.default_rng(0)
    digests = rng.integers(0, 256, (args.rows, 32), np.uint8)  # the images' content digests (values do not matter)
    fill = FeatureCache(folder, prefix_key(bundle, weights), batch_size=1000)
    rows = np.arange(args.rows)
    _, fill_seconds = timed(lambda: fill.rows(rows, digests, lambda i: rng.random((len(i), 1280), np.float32)))
    scorer = OrtMCDropout(bundle, 64, threads=args.threads)
    prefix = CachedPrefix(bundle, folder, weights, 64, args.threads)
    blank = np.zeros((1, args.side, args.side, 3), np.uint8)
    samples = Samples(rows, lambda indices: blank.repeat(len(indices), axis=0), lambda indices: digests[indices])
    reads, scores = [], []
    for repeat in range(args.repeats):
        started = time.perf_counter()
        cached = prefix.rows(samples)
        read_seconds = time.perf_counter() - started
        scorer.feature_probabilities(cached, args.passes, repeat)
        score_seconds = time.perf_counter() - started - read_seconds
        reads.append(round(read_seconds, 3))
        scores.append(round(score_seconds, 3))
    return {
        "features": int(cached.shape[1]),
        "cache_fill_seconds": round(fill_seconds, 3),
        "cached_read_and_check_seconds": reads,
        "cached_score_seconds": scores,
        "cached_round_seconds_median": round(float(np.median(np.add(reads, scores))), 3),
    }


def uncached_per_image(bundle: Bundle, args: argparse.Namespace) -> float:
    """Seconds per image of scoring random images through prefix and tail (the path without a cache)."""
    images = np.random.default_rng(1).integers(0, 256, (args.baseline_images, args.side, args.side, 3), np.uint8)
    scorer = OrtMCDropout(bundle, 64, threads=args.threads)
    _, seconds = timed(lambda: scorer.probabilities(images, args.passes, 0))
    return seconds / args.baseline_images


def main() -> None:
    """Runs both paths and prints one JSON object."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=10000)
    parser.add_argument("--passes", type=int, default=20)
    parser.add_argument("--baseline-images", type=int, default=300)
    parser.add_argument("--side", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1, help="onnxruntime intra-op threads (0: its default)")
    parser.add_argument("--repeats", type=int, default=3, help="cached rounds timed (the median is reported)")
    args = parser.parse_args()
    model_spec = spec(args.side)
    weights = get_weights(build_model(model_spec, seed=0))
    with tempfile.TemporaryDirectory() as folder:
        write_bundle(weights, Path(folder) / "bundle", model_spec)
        bundle = load_bundle(Path(folder) / "bundle")
        assert prefix_frozen(bundle)
        cached = cached_rounds(bundle, Path(folder) / "features", weights, args)
        per_image = uncached_per_image(bundle, args)
    run = {"rows": args.rows, "passes": args.passes, "threads": args.threads, "target_seconds": 2.0}
    baseline = {
        "uncached_input_side": args.side,
        "uncached_images": args.baseline_images,
        "uncached_seconds_per_image": round(per_image, 5),
        "uncached_seconds_for_rows": round(per_image * args.rows, 2),
        "speedup": round(per_image * args.rows / cached["cached_round_seconds_median"], 1),
    }
    print(json.dumps({**run, **cached, **baseline}))


if __name__ == "__main__":
    main()
