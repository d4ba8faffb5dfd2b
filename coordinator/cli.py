# The fl-coordinator command line: its commands by name (each in its own module) and `main`, which shows a user's
# mistake (UsageError) as one line and exit 2, and anything else with its traceback.
from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from coordinator import (
    export_command,
    methods_command,
    provision_command,
    relay_command,
    report_command,
    run_command,
)
from coordinator.encoder_command import add_encoder_command, command_encoder
from protocol.errors import UsageError
from protocol.logs import configure_logging
from protocol.mqtt import BrokerUnavailableError
from protocol.shutdown import Terminated, raise_on_sigterm

AddArguments = Callable[[argparse.ArgumentParser], None]
Run = Callable[[argparse.Namespace], int]

# name -> (help, add_arguments, run)
COMMANDS: dict[str, tuple[str, AddArguments, Run]] = {
    "run": (run_command.HELP, run_command.add_arguments, run_command.run),
    "relay": (relay_command.HELP, relay_command.add_arguments, relay_command.run),
    "provision": (provision_command.HELP, provision_command.add_arguments, provision_command.run),
    "report": (report_command.HELP, report_command.add_arguments, report_command.run),
    "methods": (methods_command.HELP, methods_command.add_arguments, methods_command.run),
    "export": (export_command.HELP, export_command.add_arguments, export_command.run),
    "encoder": (
        "fit FAST's frozen encoder (PCA) on unlabelled images and write its ONNX",
        add_encoder_command,
        command_encoder,
    ),
}


def build_parser(
    prog: str, description: str, commands: dict[str, tuple[str, AddArguments, Run]]
) -> argparse.ArgumentParser:
    """A parser with one subcommand per table entry (each command's flags read the registries as they are now)."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    subparsers = parser.add_subparsers(dest="command", required=True)
    for name, (help_text, add_arguments, _) in commands.items():
        add_arguments(subparsers.add_parser(name, help=help_text))
    return parser


def execute(prog: str, run: Run, args: argparse.Namespace) -> int:
    """Runs a parsed command: a UsageError (or an unreachable broker) is one line on stderr and exit 2, an
    interrupt 130, SIGTERM 143; any other exception is a bug and escapes with its traceback."""
    configure_logging(args.log_level)
    raise_on_sigterm()
    try:
        return run(args)
    except (UsageError, BrokerUnavailableError) as error:
        print(f"{prog}: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except Terminated:
        return 143


def main(argv: list[str] | None = None) -> int:
    """Entry point of the fl-coordinator console script."""
    parser = build_parser("fl-coordinator", "Federated active-learning coordinator.", COMMANDS)
    args = parser.parse_args(argv)
    return execute("fl-coordinator", COMMANDS[args.command][2], args)
