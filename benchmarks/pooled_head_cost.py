# What the pooled head costs: a device's statistics (time, bytes on the wire) and the coordinator's fit of N devices.
"""A device of the camera path (EfficientNet-Lite0's 1280 features, 10 classes) holding --labels human labels
computes its statistics (protocol.head_statistics) and encodes them as the update it sends (float32, the wire's
msgpack); beside it, the trained head FedAvg devices send today. The coordinator's side: --devices such updates
absorbed one by one by the round aggregator that runs pooled-head (streamed: each update's exact-grid sum, its copy
in the scratch file), then the fit (shrunk LDA). Prints one JSON object: seconds, bytes, MB, peak RSS from /proc.

Usage: python benchmarks/pooled_head_cost.py [--devices 1000] [--labels 100] [--classes 10] [--features 1280]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np

from coordinator.intake.round_aggregator import SuspectPolicy, make_aggregator
from coordinator.intake.scratch import TensorScratch
from coordinator.strategies.aggregate import ClientUpdate
from coordinator.strategies.pooled_head import PooledHead
from protocol import head_statistics, messages, wire
from protocol.head_statistics import HeadStatistics, calibration_sums


def peak_rss_mb() -> float:
    """This process's peak resident set (VmHWM) in MB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def update_bytes(tensors: dict[str, np.ndarray], labels: int) -> int:
    """The bytes of an update message carrying these tensors (float32), as the wire encodes it."""
    update = messages.Update("cam-0", 1, "0" * 32, "0" * 64, labels, [labels], labels, {}, tensors, b"\0" * 16)
    return len(wire.encode(update))


def device_side(rng: np.random.Generator, args: argparse.Namespace) -> tuple[dict[str, np.ndarray], dict[str, float]]:
    """One device's statistics from --labels rows (features as ReLU6 gives them) and the calibration of 10 new ones:
    the tensors and the seconds, beside the bytes of a trained head."""
    features = np.clip(rng.normal(0.5, 1.0, size=(args.labels, args.features)), 0.0, 6.0).astype(np.float32)
    labels = rng.integers(args.classes, size=args.labels)
    head = rng.normal(0, 0.01, size=(args.classes, args.features)).astype(np.float32)
    started = time.perf_counter()
    calibration = calibration_sums(features[-10:].astype(np.float64) @ head.T, labels[-10:])
    tensors = HeadStatistics.of_labels(features, labels, args.classes, calibration).tensors()
    seconds = time.perf_counter() - started
    trained = {"classifier_fc.weight": head, "classifier_fc.bias": np.zeros(args.classes, np.float32)}
    return tensors, {
        "statistics_seconds": round(seconds, 4),
        "statistics_update_bytes": update_bytes(tensors, args.labels),
        "trained_head_update_bytes": update_bytes(trained, args.labels),
    }


def coordinator_side(tensors: dict[str, np.ndarray], args: argparse.Namespace) -> dict[str, float]:
    """--devices updates (the one device's statistics, each scaled a little so no two are equal) through pooled-head's
    streamed round aggregator, then the fit; seconds of each, and the scratch file's size."""
    head = {
        "classifier_fc.weight": np.zeros((args.classes, args.features), np.float32),
        "classifier_fc.bias": np.zeros(args.classes, np.float32),
    }
    base = head_statistics.layout(args.classes, args.features)
    with tempfile.TemporaryDirectory() as folder:
        scratch = TensorScratch(Path(folder))
        aggregator = make_aggregator(PooledHead(), base, SuspectPolicy(), scratch, model=head, head=head)
        started = time.perf_counter()
        for device in range(args.devices):
            scale = np.float32(1.0 + 1e-3 * (device % 7))
            aggregator.absorb(ClientUpdate(f"cam-{device}", {n: a * scale for n, a in tensors.items()}, args.labels))
        absorbed = time.perf_counter() - started
        scratch_mb = scratch.size / 1e6
        started = time.perf_counter()
        aggregator.finish(None)
        fit = time.perf_counter() - started
        scratch.close()
    return {
        "devices": args.devices,
        "absorb_seconds": round(absorbed, 2),
        "absorb_ms_per_update": round(1000 * absorbed / args.devices, 2),
        "finish_and_fit_seconds": round(fit, 2),
        "scratch_mb": round(scratch_mb, 1),
    }


def main() -> None:
    """Both sides, one JSON object."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for flag, default in (("devices", 1000), ("labels", 100), ("classes", 10), ("features", 1280)):
        parser.add_argument(f"--{flag}", type=int, default=default)
    args = parser.parse_args()
    tensors, device = device_side(np.random.default_rng(0), args)
    coordinator = coordinator_side(tensors, args)
    print(json.dumps({"device": device, "coordinator": coordinator, "peak_rss_mb": round(peak_rss_mb(), 1)}))


if __name__ == "__main__":
    main()
