# The fl-bench command line: the bench's commands by name (each in its own module) and `main`, which runs them the
# way fl-coordinator runs its own (a UsageError is one line and exit 2; anything else shows its traceback).
from __future__ import annotations

from bench import partition_command, simulate_command
from coordinator.cli import AddArguments, Run, build_parser, execute

# name -> (help, add_arguments, run)
COMMANDS: dict[str, tuple[str, AddArguments, Run]] = {
    "simulate": (simulate_command.HELP, simulate_command.add_arguments, simulate_command.run),
    "partition": (partition_command.HELP, partition_command.add_arguments, partition_command.run),
}


def main(argv: list[str] | None = None) -> int:
    """Entry point of the fl-bench console script."""
    parser = build_parser("fl-bench", "Simulated fleets on one machine.", COMMANDS)
    args = parser.parse_args(argv)
    return execute("fl-bench", COMMANDS[args.command][2], args)
