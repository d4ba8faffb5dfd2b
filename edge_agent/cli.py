# The edge-agent command line: `edge-agent run` serves a fleet's rounds; `edge-agent score` scores a pool file or folder.
from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from edge_agent import run_command, score_command
from protocol.errors import UsageError
from protocol.logs import configure_logging
from protocol.mqtt import BrokerUnavailableError
from protocol.shutdown import Terminated

# Each command: its help line, the function adding its arguments, and the function running it (its exit code).
COMMANDS: dict[str, tuple[str, Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int]]] = {
    "run": (
        "join a fleet and serve its rounds from a folder pool",
        run_command.add_arguments,
        run_command.run,
    ),
    "score": (
        "score a pool file or image folder with a model bundle and print one JSON line",
        score_command.add_arguments,
        score_command.run,
    ),
}


def build_parser() -> argparse.ArgumentParser:
    """Arguments of every edge-agent command."""
    parser = argparse.ArgumentParser(prog="edge-agent", description="Federated active-learning device agent.")
    commands = parser.add_subparsers(dest="command", required=True)
    for name, (summary, add_arguments, _) in COMMANDS.items():
        add_arguments(commands.add_parser(name, help=summary))
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the edge-agent console script: a user's mistake (UsageError) or an unreachable broker is one
    line and exit 2; any other error is a bug and shows its traceback."""
    args = build_parser().parse_args(argv)
    configure_logging(args.log_level)
    try:
        return COMMANDS[args.command][2](args)
    except (UsageError, BrokerUnavailableError) as error:
        print(f"edge-agent: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except Terminated:
        return 0
