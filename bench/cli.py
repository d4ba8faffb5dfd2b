# The fl-bench command line: the bench's own commands, which a device never runs (`python -m bench COMMAND`).
from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from bench import device_command, host_command
from protocol.errors import UsageError
from protocol.logs import configure_logging
from protocol.mqtt import BrokerUnavailableError
from protocol.shutdown import Terminated

# Each command: its help line, the function adding its arguments, and the function running it (its exit code).
COMMANDS: dict[str, tuple[str, Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int]]] = {
    "device": (
        "one bench device: `edge-agent run` over a shard with the simulated oracle",
        device_command.add_arguments,
        device_command.run,
    ),
    "host": (
        "serve many virtual devices in one process (the worker `simulate` spawns)",
        host_command.add_arguments,
        host_command.run,
    ),
}


def build_parser() -> argparse.ArgumentParser:
    """Arguments of every fl-bench command."""
    parser = argparse.ArgumentParser(prog="fl-bench", description="The bench: simulated devices and fleets.")
    commands = parser.add_subparsers(dest="command", required=True)
    for name, (summary, add_arguments, _) in COMMANDS.items():
        add_arguments(commands.add_parser(name, help=summary))
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the fl-bench console script: a user's mistake (UsageError) or an unreachable broker is one
    line and exit 2; any other error is a bug and shows its traceback."""
    args = build_parser().parse_args(argv)
    configure_logging(args.log_level)
    try:
        return COMMANDS[args.command][2](args)
    except (UsageError, BrokerUnavailableError) as error:
        print(f"fl-bench: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except Terminated:
        return 0
