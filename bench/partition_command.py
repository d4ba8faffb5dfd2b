# `fl-bench partition`: the bench's per-device pool shards written to a folder, for agents started by hand.
from __future__ import annotations

import argparse
from pathlib import Path

from bench.bench_options import add_bench_options, bench_settings
from bench.simulate import write_shards
from coordinator.setup.server_data import load_server_data
from coordinator.setup.settings import InitSettings, ServerSettings


def add_arguments(partition: argparse.ArgumentParser) -> None:
    """The bench's split written as shard files."""
    add_bench_options(partition)
    partition.add_argument("--out", type=Path, required=True)
    partition.add_argument("--data-dir", type=Path)
    partition.add_argument("--init-samples", type=int, default=InitSettings.samples)
    partition.add_argument("--validation-samples", type=int, default=1000)
    partition.add_argument("--seed", type=int, default=0)
    partition.add_argument("--log-level", default="warning")


def run(args: argparse.Namespace) -> int:
    """Writes the bench's per-device shards to a folder, for agents started by hand."""
    settings = ServerSettings(
        run_dir=args.out,
        init=InitSettings(samples=args.init_samples, seed=args.seed),
        validation_samples=args.validation_samples,
        data_dir=args.data_dir,
    )
    bench = bench_settings(args)
    for launch in write_shards(load_server_data(settings), bench, args.out):
        print(f"{launch.device_id} {launch.shard}")
    return 0
