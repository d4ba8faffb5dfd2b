# The fl-bench command line: the bench's commands by name, each in its own module (loaded only when it runs, so a
# bench device scoring without torch never loads the simulator).
from __future__ import annotations

from collections.abc import Sequence

from coordinator.cli import STOPS
from protocol.commands import Command, CommandLine

FL_BENCH = CommandLine(
    "fl-bench",
    "Simulated fleets on one machine.",
    (
        Command(
            "simulate",
            "N real agents on this machine against an embedded broker and the coordinator",
            "bench.simulate_command",
            STOPS,
        ),
        Command(
            "partition", "write per-device pool shards for agents started by hand", "bench.partition_command", STOPS
        ),
        Command(
            "device",
            "one bench device: `edge-agent run` over a shard with the simulated oracle",
            "bench.device_command",
        ),
        Command(
            "host", "serve many virtual devices in one process (the worker `simulate` spawns)", "bench.host_command"
        ),
    ),
)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the fl-bench console script."""
    return FL_BENCH.main(argv)
