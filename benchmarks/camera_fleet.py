# Builds a camera fleet for the field bench: per-device folders of colour JPEG scenes, answer keys, a test set.
"""Prints one JSON object (the fleet's folders, image counts, class names, bytes and seconds).

Each device gets DIR/device-NN/pool/ (its camera folder: the agent's --pool-dir) and DIR/device-NN/answers.csv
(file,label: what the bench's person answers through the folder oracle, see bench.camera_fleet
.answer_queries); DIR/server.npz is the coordinator's --dataset (its own labelled scenes for W0 and the selection
split, and the test scenes: uint8 (N, size, size, 3)), DIR/model_spec.toml the --model-spec of both sides and
DIR/classes.json the class names. Scenes are Fashion-MNIST items rendered by
bench.camera_scenes: tinted, scaled, tilted and placed at random on textured backgrounds, as JPEGs."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from bench.camera_fleet import BACKBONE_SPECS, FleetSettings, build_fleet
from bench.camera_scenes import DEFAULT_CLASSES, parse_classes
from edge_agent.data.fashion_mnist import load_fashion_mnist

DEFAULTS = FleetSettings()


def main() -> None:
    """Parses the flags, builds the fleet and prints its summary."""
    parser = argparse.ArgumentParser(description=__doc__)
    default_classes = ",".join(f"{c.name}={c.source}" for c in DEFAULT_CLASSES)
    parser.add_argument("--out", type=Path, required=True, help="the fleet folder to write")
    parser.add_argument("--devices", type=int, default=DEFAULTS.devices)
    parser.add_argument("--classes", default=default_classes, help="NAME=FASHION_MNIST_CLASS,... (number or name)")
    parser.add_argument("--per-class", type=int, default=DEFAULTS.per_class, help="scenes per class on each device")
    parser.add_argument("--test-per-class", type=int, default=DEFAULTS.test_per_class)
    parser.add_argument("--server-per-class", type=int, default=DEFAULTS.server_per_class, help="the server's own")
    parser.add_argument("--size", type=int, default=DEFAULTS.size, help="scene side in pixels (e.g. 64 or 96)")
    parser.add_argument("--seed", type=int, default=DEFAULTS.seed)
    parser.add_argument("--backbone", choices=sorted(BACKBONE_SPECS), default=DEFAULTS.backbone)
    parser.add_argument("--data-dir", type=Path, help="the Fashion-MNIST folder (default: the installed dataset)")
    args = parser.parse_args()
    settings = FleetSettings(
        args.devices,
        parse_classes(args.classes),
        args.per_class,
        args.test_per_class,
        args.size,
        args.seed,
        args.server_per_class,
        args.backbone,
    )
    started = time.perf_counter()
    summary = build_fleet(args.out, settings, load_fashion_mnist(args.data_dir))
    written = sum(path.stat().st_size for path in args.out.rglob("*") if path.is_file())
    print(json.dumps({**summary, "bytes": written, "seconds": round(time.perf_counter() - started, 2)}))


if __name__ == "__main__":
    main()
