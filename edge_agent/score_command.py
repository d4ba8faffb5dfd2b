# `edge-agent score`: MC-dropout scores of a pool file or image folder with a bundle's model, top-k, speed and memory.
from __future__ import annotations

import argparse
import hashlib
import json
import resource
import sys
import time
import zipfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from edge_agent.data.device_data import Samples
from edge_agent.data.fashion_mnist import read_idx
from edge_agent.data.image_arrays import IMAGE_SHAPE, check_images
from edge_agent.data.image_files import FolderImages, InputSpec, read_image_folder
from edge_agent.learning.acquisition_scores import top_k
from edge_agent.learning.bundle import Bundle, BundleError, bundle_weights, load_bundle
from edge_agent.learning.mc_scorer import MCScorer
from edge_agent.learning.sampling import make_heuristic
from edge_agent.loop.profile import load_profile
from protocol import messages
from protocol.errors import UsageError

BACKENDS = ("onnxruntime", "torch")
CPU_PROVIDER = "CPUExecutionProvider"
# Images per inference batch when none is given: onnxruntime's peak RSS grows ~0.33 MB per image of batch at
# flat throughput from 64 up (see ort_scorer); torch's fixed cost dwarfs its batch and it is faster at 256.
DEFAULT_BATCHES = {"onnxruntime": 64, "torch": 256}


def _read_npz_images(path: Path) -> np.ndarray:
    """The `images` array of a shard .npz, read alone (labels and seeds are not needed to score)."""
    try:
        with np.load(path, allow_pickle=False) as archive:
            if not isinstance(archive, np.lib.npyio.NpzFile) or "images" not in archive.files:
                raise ValueError("not a shard archive with an images array")
            return archive["images"]
    # numpy raises ValueError for a damaged archive: the person's file
    except (ValueError, OSError, EOFError, zipfile.BadZipFile) as exc:
        raise UsageError(f"{path}: corrupt or unreadable array archive ({exc})") from exc


def load_pool_images(path: Path, limit: int | None = None, image_shape: tuple[int, ...] = IMAGE_SHAPE) -> np.ndarray:
    """uint8 images (N, *image_shape) from an IDX images file (.gz ok), the pool of a shard .npz, or an .npy array
    (image_shape: the model spec's, (H, W) grey or (H, W, C) colour).

    An .npy file is memory-mapped read-only, so only the pages a batch touches are resident; IDX and .npz
    pools are read once as uint8 (an IDX file only up to `limit` images). Images are normalised a batch at a time while scoring.
    """
    if not path.is_file():
        raise UsageError(f"pool file {path} does not exist")
    if path.suffix == ".npy":
        try:
            images = np.load(path, mmap_mode="r", allow_pickle=False)
        # numpy raises ValueError for a damaged .npy: the person's file
        except (ValueError, OSError, EOFError) as exc:
            raise UsageError(f"{path}: corrupt or unreadable .npy array ({exc})") from exc
    else:
        images = _read_npz_images(path) if path.suffix == ".npz" else read_idx(path, limit)
    check_images(images, f"{path}: pool", image_shape)
    return images


def make_scorer(
    backend: str,
    bundle: Bundle,
    batch_size: int,
    threads: int = 0,
    precision: str = "fp32",
    providers: Sequence[str] = (CPU_PROVIDER,),
) -> MCScorer:
    """The bundle's model behind one back end; each back end's runtime is imported only when it is chosen."""
    if backend == "onnxruntime":
        from edge_agent.learning.ort_scorer import OrtMCDropout

        return OrtMCDropout(bundle, batch_size, precision, threads, providers)
    if backend != "torch":
        raise UsageError(f"unknown backend {backend!r}; known: {', '.join(BACKENDS)}")
    if precision != "fp32":
        raise UsageError("the torch back end scores in fp32 only; use --backend onnxruntime for int8")
    from edge_agent.learning.torch_bundle import torch_scorer_from_bundle

    return torch_scorer_from_bundle(bundle, batch_size, threads)


def peak_rss_mb() -> float:
    """This process's peak resident set size in MiB (ru_maxrss is KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / (1 << 20) if sys.platform == "darwin" else peak / 1024


def score_pool(
    bundle_path: Path,
    pool_path: Path,
    passes: int,
    top: int,
    sampler: str,
    backend: str = "onnxruntime",
    batch_size: int | None = None,
    limit: int | None = None,
    seed: int = 0,
    threads: int = 0,
    precision: str = "fp32",
    providers: Sequence[str] = (CPU_PROVIDER,),
    cache_dir: Path | None = None,
) -> dict[str, Any]:
    """Scores a pool and returns the selection with images_per_second and peak_rss_mb (the command's JSON).

    An array pool stays uint8 (memory-mapped for .npy); an image folder is decoded to the bundle's input (--limit
    bounds it), its broken files skipped and reported. With cache_dir, the prefix outputs are kept there.
    """
    heuristic = make_heuristic(sampler)
    check_score_request(backend, precision, limit, cache_dir)
    bundle = load_bundle(bundle_path)
    folder = (
        read_image_folder(pool_path, InputSpec.from_manifest(bundle.manifest), limit) if pool_path.is_dir() else None
    )
    shape = bundle.manifest.spec.image_shape
    images = folder.images if folder is not None else load_pool_images(pool_path, limit, shape)[:limit]
    batch_size = batch_size if batch_size is not None else DEFAULT_BATCHES.get(backend, DEFAULT_BATCHES["onnxruntime"])
    scorer = make_scorer(backend, bundle, batch_size, threads, precision, providers)
    started = time.perf_counter()
    probabilities = None
    if heuristic.needs_probabilities:
        pool_key = pool_identity(pool_path, folder.files if folder is not None else None) if cache_dir else ""
        probabilities = pool_probabilities(scorer, images, cache_dir, pool_key, passes, seed)
    scores = heuristic.scores(probabilities, len(images), np.random.default_rng(seed))
    selected = top_k(scores, top)
    seconds = time.perf_counter() - started
    run = {"backend": scorer.name, "precision": precision, "passes": passes, "sampler": sampler}
    return {**run, **selection_report(len(images), batch_size, selected, seconds), **_folder_report(folder, selected)}


def check_score_request(backend: str, precision: str, limit: int | None, cache_dir: Path | None) -> None:
    """A UsageError for a --limit below one, or a --cache-dir with another back end than onnxruntime at fp32."""
    if cache_dir is not None and (backend, precision) != ("onnxruntime", "fp32"):
        raise UsageError(
            "--cache-dir keeps the fp32 prefix's outputs: use it with --backend onnxruntime --precision fp32"
        )
    if limit is not None and limit < 1:
        raise UsageError(f"--limit must be at least 1, got {limit}")


def pool_probabilities(
    scorer: MCScorer, images: np.ndarray, cache_dir: Path | None, pool_key: str, passes: int, seed: int
) -> np.ndarray:
    """The pool's MC-dropout probabilities: through the feature cache in cache_dir when one is given."""
    if cache_dir is None:
        return scorer.probabilities(images, passes, seed)
    return cached_probabilities(scorer, images, cache_dir, pool_key, passes, seed)


def pool_identity(pool_path: Path, files: list[str] | None) -> str:
    """What the positions of a pool index: the pool file (path, size, modification time), or an image folder's files
    read, each with its size and modification time; a change gives another feature cache."""
    paths = [pool_path] if files is None else [pool_path / name for name in files]
    stats = [(str(path.resolve()), path.stat().st_size, path.stat().st_mtime_ns) for path in paths]
    return hashlib.sha256(json.dumps(stats).encode()).hexdigest()


def cached_probabilities(
    scorer: MCScorer, images: np.ndarray, cache_dir: Path, pool_key: str, passes: int, seed: int
) -> np.ndarray:
    """MC-dropout outputs of the pool through a feature cache in cache_dir (keyed by the bundle's prefix and the
    pool): every image's pixels are hashed, the prefix runs only on images without a cached row that is theirs,
    then the tail alone over the rows. A cache_dir that cannot be written is warned about once and not used for
    storing (the result is the same)."""
    from edge_agent.data.feature_cache import content_digests
    from edge_agent.learning.cached_prefix import CachedPrefix
    from edge_agent.learning.ort_scorer import OrtMCDropout

    assert isinstance(scorer, OrtMCDropout)  # score_pool allows the cache on onnxruntime only
    bundle = scorer.bundle
    weights = bundle_weights(bundle)
    prefix = CachedPrefix(bundle, cache_dir, weights, scorer.batch_size, scorer.threads, scorer.providers, pool_key)
    digests = content_digests(images)
    rows = prefix.rows(
        Samples(np.arange(len(images)), lambda indices: images[indices], lambda indices: digests[indices])
    )
    return scorer.feature_probabilities(rows, passes, seed)


def _folder_report(folder: FolderImages | None, selected: np.ndarray) -> dict[str, Any]:
    """For an image folder: the selected files, and the files skipped with their reasons (nothing for arrays)."""
    return {} if folder is None else folder.report(selected)


def selection_report(images: int, batch_size: int, selected: np.ndarray, seconds: float) -> dict[str, Any]:
    """The measured part of the command's JSON: images, batch, the selection, time, speed and peak RSS."""
    return {
        "images": images,
        "batch": batch_size,
        "selected": len(selected),
        "seconds": round(seconds, 4),
        "images_per_second": round(images / seconds, 2) if seconds > 0 else None,
        "peak_rss_mb": round(peak_rss_mb(), 1),
        "indices": selected.tolist(),
    }


def add_arguments(score: argparse.ArgumentParser) -> None:
    """`edge-agent score`: a bundle, a pool, the sampler and how to run it."""
    score.add_argument("--bundle", required=True, type=Path, help="a model bundle folder written by fl-export")
    score.add_argument(
        "--pool",
        required=True,
        type=Path,
        help="an IDX images file (.gz ok), a shard .npz, an .npy array, or a folder of JPEG/PNG images",
    )
    score.add_argument("--passes", type=int, default=20, help="MC-dropout passes (capped by --profile)")
    score.add_argument("--top", type=int, default=400, help="how many samples to select")
    score.add_argument("--sampler", default=messages.Recipe.sampler)
    score.add_argument("--backend", choices=BACKENDS, help="default: the profile's, else onnxruntime")
    score.add_argument("--precision", choices=("fp32", "int8"), default="fp32", help="onnxruntime graphs to run")
    score.add_argument(
        "--batch",
        type=int,
        help="images per inference batch (default: the profile's, else 64 for onnxruntime, 256 for torch)",
    )
    score.add_argument("--threads", type=int, help="intra-op threads (default: the profile's, else the runtime's)")
    score.add_argument("--limit", type=int, help="score only the first N pool images (capped by --profile)")
    score.add_argument("--profile", type=Path, help="a firmware_configs/*.toml device profile")
    score.add_argument("--seed", type=int, default=0, help="seed of the dropout masks")
    score.add_argument(
        "--cache-dir",
        type=Path,
        help="keep the pool's prefix outputs here (float16, keyed by the bundle's prefix and the pool): a later run "
        "with the same backbone and pool runs only the tail (onnxruntime, fp32)",
    )
    score.add_argument("--json", action="store_true", help="print the result as one JSON line (the only format)")
    score.add_argument("--log-level", default="warning")


def run_settings(args: argparse.Namespace) -> dict[str, Any]:
    """score_pool's passes, limit and run settings: the command line's, within a device profile's caps and with its
    back end, batch, threads and providers as defaults (no profile: onnxruntime on the CPU)."""
    settings: dict[str, Any] = {"passes": args.passes, "limit": args.limit, "threads": 0}
    if args.profile is None:
        return {**settings, "backend": "onnxruntime", "batch": None, "providers": (CPU_PROVIDER,)}
    profile = load_profile(args.profile)
    return {
        "passes": min(args.passes, profile.mc_passes_cap),
        "limit": min(args.limit or profile.pool_size_cap, profile.pool_size_cap),
        "backend": profile.backend,
        "batch": profile.inference_batch,
        "threads": profile.threads,
        "providers": profile.execution_providers,
    }


def run(args: argparse.Namespace) -> int:
    """Scores a pool with a bundle, honouring a device profile's caps, and prints the JSON result."""
    settings = run_settings(args)
    try:
        result = score_pool(
            args.bundle,
            args.pool,
            settings["passes"],
            args.top,
            args.sampler,
            backend=args.backend or settings["backend"],
            batch_size=args.batch or settings["batch"],
            limit=settings["limit"],
            seed=args.seed,
            threads=args.threads or settings["threads"],
            precision=args.precision,
            providers=settings["providers"],
            cache_dir=args.cache_dir,
        )
    except BundleError as error:  # here the bundle is the user's file, not one a coordinator sent
        raise UsageError(str(error)) from None
    print(json.dumps(result))
    return 0
