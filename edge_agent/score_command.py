# `edge-agent score`: MC-dropout scores of a pool file with a bundle's model, top-k, throughput and peak memory.
from __future__ import annotations

import resource
import sys
import time
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from edge_agent.bundle import Bundle, load_bundle
from edge_agent.data import load_shard, normalise, read_idx
from edge_agent.mc_scorer import MCScorer
from edge_agent.ort_scorer import CPU_PROVIDER, OrtMCDropout
from edge_agent.sampling import make_heuristic, top_k

BACKENDS = ("onnxruntime", "torch")


def load_pool_images(path: Path) -> np.ndarray:
    """uint8 images (N, 28, 28) from an IDX images file (.gz ok) or the pool of a shard .npz."""
    if path.is_dir():
        raise ValueError(f"{path} is a folder; image folders are not supported yet: pass an IDX images file or a "
                         "shard .npz")
    if not path.is_file():
        raise FileNotFoundError(f"pool file {path} does not exist")
    images = load_shard(path).images if path.suffix == ".npz" else read_idx(path)
    if images.dtype != np.uint8 or images.ndim != 3 or images.shape[1:] != (28, 28):
        raise ValueError(f"{path}: pool images are {images.dtype} {images.shape}, expected uint8 (N, 28, 28)")
    return images


def make_scorer(backend: str, bundle: Bundle, batch_size: int, threads: int = 0, precision: str = "fp32",
                providers: Sequence[str] = (CPU_PROVIDER,)) -> MCScorer:
    """The bundle's model behind one back end; torch is imported only when the torch back end is chosen."""
    if backend == "onnxruntime":
        return OrtMCDropout(bundle, batch_size, precision, threads, providers)
    if backend != "torch":
        raise ValueError(f"unknown backend {backend!r}; known: {', '.join(BACKENDS)}")
    if precision != "fp32":
        raise ValueError("the torch back end scores in fp32 only; use --backend onnxruntime for int8")
    from edge_agent.torch_bundle import torch_scorer_from_bundle

    return torch_scorer_from_bundle(bundle, batch_size, threads)


def peak_rss_mb() -> float:
    """This process's peak resident set size in MiB (ru_maxrss is KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / (1 << 20) if sys.platform == "darwin" else peak / 1024


def score_pool(bundle_path: Path, pool_path: Path, passes: int, top: int, sampler: str, backend: str = "onnxruntime",
               batch_size: int = 256, limit: int | None = None, seed: int = 0, threads: int = 0,
               precision: str = "fp32", providers: Sequence[str] = (CPU_PROVIDER,)) -> dict[str, Any]:
    """Scores a pool and returns the selection with images_per_second and peak_rss_mb (the command's JSON)."""
    heuristic = make_heuristic(sampler)
    if limit is not None and limit < 1:
        raise ValueError(f"--limit must be at least 1, got {limit}")
    images = load_pool_images(pool_path)[:limit]
    scorer = make_scorer(backend, load_bundle(bundle_path), batch_size, threads, precision, providers)
    started = time.perf_counter()
    probabilities = scorer.probabilities(normalise(images), passes, seed) if heuristic.needs_probabilities else None
    scores = heuristic.scores(probabilities, len(images), np.random.default_rng(seed))
    selected = top_k(scores, top)
    seconds = time.perf_counter() - started
    return {"backend": scorer.name, "precision": precision, "passes": passes, "sampler": sampler,
            "images": len(images), "selected": len(selected), "seconds": round(seconds, 4),
            "images_per_second": round(len(images) / seconds, 2) if seconds > 0 else None,
            "peak_rss_mb": round(peak_rss_mb(), 1), "indices": selected.tolist()}
