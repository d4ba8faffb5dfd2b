# `fl-bench device`: one bench device, `edge-agent run` with a shard's pool and the simulated oracle for its folder.
from __future__ import annotations

import argparse
from pathlib import Path

from bench.oracle import SimulatedOracle
from bench.shard import load_shard, open_device_data
from edge_agent import run_command
from edge_agent.loop.agent_settings import AgentSettings
from edge_agent.loop.memory_budget import fit_to_budget
from edge_agent.loop.profile import DeviceProfile
from protocol.errors import UsageError


def add_arguments(device: argparse.ArgumentParser) -> None:
    """A bench shard (--data) and every option of `edge-agent run` but its folder pool."""
    device.add_argument(
        "--data",
        required=True,
        type=Path,
        help="pool shard (.npz: images, the simulated oracle's labels, optional seeds)",
    )
    run_command.add_device_arguments(device)


def open_shard_pool(
    args: argparse.Namespace, state_dir: Path, settings: AgentSettings, profile: DeviceProfile | None
) -> run_command.DevicePool:
    """A bench device's pool: the shard's images (its seeds labelled once) with the oracle that knows their labels;
    the scoring batch fits the profile's budget for the shard's size."""
    if args.stream or args.label_ui or args.labelling != "device":
        raise UsageError(
            "--stream, --label-ui and --labelling central need a folder pool (`edge-agent run --pool-dir`)"
        )
    if not args.data.is_file():
        raise UsageError(f"{args.data}: no such shard file")
    shard = load_shard(args.data)
    data = open_device_data(state_dir, shard)
    if profile is not None:
        settings = fit_to_budget(settings, profile.memory_budget_mb, data.num_samples)
    return run_command.DevicePool(settings, data, SimulatedOracle(shard.all_labels))


def open_bench_device(args: argparse.Namespace) -> run_command.OpenedDevice:
    """One bench device's agent, built as a field device's is but over its shard."""
    return run_command.open_device(args, open_shard_pool)


def run(args: argparse.Namespace) -> int:
    """Opens the bench device and serves its rounds until the run ends or a signal arrives."""
    return run_command.serve(open_bench_device(args))
