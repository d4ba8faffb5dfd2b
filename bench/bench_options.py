# How a simulated fleet's data is split: the bench's options, shared by `simulate` and `partition`.
from __future__ import annotations

import argparse
from pathlib import Path

from bench.simulate import BenchSettings


def add_bench_options(parser: argparse.ArgumentParser) -> None:
    """How a simulated fleet's data is split."""
    bench = parser.add_argument_group("bench")
    bench.add_argument("--devices", type=int, default=4)
    bench.add_argument("--partition", default="type1", help="type1, type2, iid, dirichlet:ALPHA or clusters:K")
    bench.add_argument("--pool-size", type=int, default=BenchSettings.pool_size, help="unlabelled pool per device")
    bench.add_argument("--agent-threads", type=int, default=1, help="torch threads per simulated agent")
    bench.add_argument(
        "--agent-profile", type=Path, help="device profile every simulated agent runs with (firmware_configs/*.toml)"
    )
    bench.add_argument(
        "--seed-per-class",
        type=int,
        default=BenchSettings.seed_per_class,
        help="labelled seeds per class from the server's W0 samples given to every device "
        "(its initial replay set; 0 for none)",
    )
    bench.add_argument("--slow-fraction", type=float, default=0.0, help="fraction of the devices made slow (seeded)")
    bench.add_argument("--slow-factor", type=float, default=1.0, help="how many times slower a slow device is")


def bench_settings(args: argparse.Namespace) -> BenchSettings:
    """BenchSettings from parsed arguments."""
    return BenchSettings(
        args.devices,
        args.partition,
        args.pool_size,
        args.agent_threads,
        args.seed,
        args.seed_per_class,
        args.agent_profile,
        getattr(args, "secure", False),
        getattr(args, "tls", False),
        process_per_device=getattr(args, "process_per_device", False),
        workers=getattr(args, "workers", None),
        slow_fraction=args.slow_fraction,
        slow_factor=args.slow_factor,
    )
