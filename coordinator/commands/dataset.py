# `fl-coordinator dataset`: the server's labelled images (--dataset's .npz) built from a team's photos, with a report.
from __future__ import annotations

import argparse
from pathlib import Path

from coordinator.setup.site_images import DEFAULT_SEED, DEFAULT_TEST_SHARE, build_site_dataset
from coordinator.setup.site_report import SHOWN_LINES, report_csv, report_path, summary_lines
from edge_agent.data.image_arrays import DATASET_KEYS
from protocol.errors import UsageError
from protocol.files import atomic_write_bytes, save_arrays
from protocol.model_spec import load_model_spec


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The photos, the spec they are decoded for, the split and where the data set and its report go."""
    parser.add_argument(
        "--images",
        type=Path,
        required=True,
        metavar="FOLDER|CSV",
        help="a folder with one folder of JPEG/PNG photos per class name, or a CSV of path,class (paths relative "
        "to the CSV)",
    )
    parser.add_argument(
        "--model-spec", type=Path, required=True, metavar="FILE", help="TOML model spec: its class names and input size"
    )
    parser.add_argument(
        "--out",
        type=Path,
        required=True,
        metavar="FILE.npz",
        help="the .npz to write (then: run --dataset FILE); NAME.report.csv beside it",
    )
    parser.add_argument(
        "--test-share",
        type=float,
        metavar="SHARE",
        default=DEFAULT_TEST_SHARE,
        help="share of each class's photos kept as test images (default: %(default)s)",
    )
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED, help="seed of the test split (default: %(default)s)")
    parser.add_argument(
        "--ignore-unknown-classes",
        action="store_true",
        help="leave out (and report) photos of classes the spec does not name, instead of refusing them",
    )
    parser.add_argument(
        "--shown",
        type=int,
        metavar="N",
        default=SHOWN_LINES,
        help="classes and left-out files printed (every file is in the report)",
    )
    parser.add_argument("--log-level", default="warning")


def run(args: argparse.Namespace) -> int:
    """Builds the data set, writes it and its per-file report atomically, and prints the bounded summary."""
    if args.shown < 0:
        raise UsageError(f"--shown must be 0 or more, got {args.shown}")
    spec = load_model_spec(args.model_spec).spec
    site = build_site_dataset(
        args.images, spec, args.model_spec.name, args.test_share, args.seed, args.ignore_unknown_classes
    )
    data = site.dataset
    save_arrays(args.out, {key: getattr(data, key) for key in DATASET_KEYS})
    report = report_path(args.out)
    atomic_write_bytes(report, report_csv(site.rows))
    lines = summary_lines(site, spec.class_names, args.shown)
    print(f"wrote {args.out}: {lines[0]}")
    print("\n".join(lines[1:]))
    print(f"every file and why it was kept or left out: {report}")
    return 0
