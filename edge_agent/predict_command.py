# `edge-agent predict`: a bundle's predictions of an image folder, once, as JSON lines or CSV (no torch).
from __future__ import annotations

import argparse
import csv
import json
import sys
import time
from pathlib import Path
from typing import Any

from edge_agent.data.feature_cache import content_digests
from edge_agent.data.image_files import FolderImages, InputSpec, read_image_folder
from edge_agent.learning.bundle import BundleError, load_bundle
from edge_agent.learning.predict import verdicts
from edge_agent.score_command import make_scorer, run_settings
from protocol.errors import UsageError

COLUMNS = ("file", "content_hash", "class_index", "class_name", "probability", "uncertainty", "model_hash", "time")
DEFAULT_BATCH = 64
SHOWN_SKIPPED = 3


def predict_folder(
    bundle_path: Path,
    pool: Path,
    passes: int,
    batch_size: int | None = None,
    limit: int | None = None,
    seed: int = 0,
    threads: int = 0,
    providers: tuple[str, ...] = ("CPUExecutionProvider",),
) -> tuple[list[dict[str, Any]], FolderImages]:
    """One prediction per readable image of the folder (what a field device logs for each image, without a serving
    version), and the folder as read (its skipped files)."""
    if not pool.is_dir():
        raise UsageError(
            f"--pool {pool} is not a folder of images" if pool.exists() else f"pool folder {pool} does not exist"
        )
    if passes < 1:
        raise UsageError(f"--passes must be at least 1, got {passes}")
    try:
        bundle = load_bundle(bundle_path)
    except BundleError as error:  # here the bundle is the user's file, not one a coordinator sent
        raise UsageError(str(error)) from None
    folder = read_image_folder(pool, InputSpec.from_manifest(bundle.manifest), limit, raw=True)
    scorer = make_scorer("onnxruntime", bundle, batch_size or DEFAULT_BATCH, threads, providers=providers)
    found = verdicts(scorer.probabilities(folder.images, passes, seed))
    names, now = bundle.manifest.spec.class_names, round(time.time(), 3)
    rows = []
    for file, digest, index, probability, uncertainty in zip(
        folder.files,
        content_digests(folder.images),
        found.classes.tolist(),
        found.probabilities.tolist(),
        found.uncertainties.tolist(),
    ):
        name = names[index] if index < len(names) else str(index)
        values = (file, digest.tobytes().hex(), index, name, round(probability, 6), round(uncertainty, 6))
        rows.append(dict(zip(COLUMNS, (*values, bundle.manifest.weights_hash, now))))
    return rows, folder


def add_arguments(predict: argparse.ArgumentParser) -> None:
    """`edge-agent predict`: a bundle, an image folder, the output format and how to run it."""
    predict.add_argument("--bundle", required=True, type=Path, help="a model bundle folder written by fl-export")
    predict.add_argument("--pool", required=True, type=Path, help="a folder of JPEG/PNG images")
    output = predict.add_mutually_exclusive_group()
    output.add_argument("--json", action="store_true", help="one JSON object a line, one line an image (the default)")
    output.add_argument("--csv", action="store_true", help="CSV with a header row, one row an image")
    predict.add_argument("--passes", type=int, default=10, help="MC-dropout passes (capped by --profile)")
    predict.add_argument("--batch", type=int, help="images per inference batch (default: the profile's, else 64)")
    predict.add_argument("--threads", type=int, help="intra-op threads (default: the profile's, else the runtime's)")
    predict.add_argument("--limit", type=int, help="predict only the first N images (capped by --profile)")
    predict.add_argument("--profile", type=Path, help="a firmware_configs/*.toml device profile")
    predict.add_argument("--seed", type=int, default=0, help="seed of the dropout masks")
    predict.add_argument("--log-level", default="warning")


def run(args: argparse.Namespace) -> int:
    """Predicts every image of a folder and prints one line (JSON) or row (CSV) per image; skipped files are named
    on stderr in one line."""
    if args.limit is not None and args.limit < 1:
        raise UsageError(f"--limit must be at least 1, got {args.limit}")
    settings = run_settings(args)
    rows, folder = predict_folder(
        args.bundle,
        args.pool,
        settings["passes"],
        args.batch or settings["batch"],
        settings["limit"],
        args.seed,
        args.threads or settings["threads"],
        tuple(settings["providers"]),
    )
    if args.csv:
        writer = csv.DictWriter(sys.stdout, COLUMNS, lineterminator="\n")
        writer.writeheader()
        writer.writerows(rows)
    else:
        sys.stdout.writelines(json.dumps(row) + "\n" for row in rows)
    if folder.skipped:
        shown = "; ".join(f"{s.file[:60]}: {s.reason[:80]}" for s in folder.skipped[:SHOWN_SKIPPED])
        print(f"edge-agent: skipped {len(folder.skipped)} unreadable files ({shown})", file=sys.stderr)
    return 0
