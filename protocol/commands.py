# Every command line's frame: commands by name in a table, each in its own module, loaded only when it runs.
from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, cast

from protocol.errors import UsageError
from protocol.logs import configure_logging
from protocol.release import VERSION
from protocol.shutdown import Terminated, raise_on_sigterm


class CommandModule(Protocol):
    """What a command's module exposes: its arguments and its handler (the exit code)."""

    def add_arguments(self, parser: argparse.ArgumentParser) -> None: ...

    def run(self, args: argparse.Namespace) -> int: ...


@dataclass(frozen=True)
class Command:
    """One subcommand: its name, its help line, and the dotted name of the module that implements it (imported only
    when the command runs or shows its own help, so `edge-agent score` never loads torch for `run`'s sake)."""

    name: str
    help: str
    module: str
    sigterm_exit: int | None = None  # set: SIGTERM stops the command with this code; None: the command handles it

    def load(self) -> CommandModule:
        """The command's module."""
        return cast(CommandModule, importlib.import_module(self.module))


@dataclass(frozen=True)
class CommandLine:
    """A console script: its program name, description and commands."""

    prog: str
    description: str
    commands: tuple[Command, ...]

    def parser(self, chosen: str | None) -> argparse.ArgumentParser:
        """Every command listed (and `--version`, the release); only the chosen one's module loaded and its arguments
        added."""
        parser = argparse.ArgumentParser(prog=self.prog, description=self.description)
        add_version(parser)
        subparsers = parser.add_subparsers(dest="command", required=True)
        for command in self.commands:
            sub = subparsers.add_parser(command.name, help=command.help)
            if command.name == chosen:
                command.load().add_arguments(sub)
        return parser

    def main(self, argv: Sequence[str] | None = None) -> int:
        """Parses argv and runs the command: a UsageError is one line on stderr and exit 2, an interrupt 130, a
        SIGTERM the command's `sigterm_exit` (0 where it handles the signal itself); any other exception is a bug and
        escapes with its traceback."""
        words = list(sys.argv[1:] if argv is None else argv)
        chosen = next((c for c in self.commands if words and words[0] == c.name), None)
        args = self.parser(chosen.name if chosen else None).parse_args(words)
        assert chosen is not None  # argparse exits unless a listed command was named
        configure_logging(args.log_level)
        if chosen.sigterm_exit is not None:
            raise_on_sigterm()
        return reported(self.prog, lambda: chosen.load().run(args), chosen.sigterm_exit or 0)


def add_version(parser: argparse.ArgumentParser) -> None:
    """`--version`: prints the program and the release (protocol.release) and exits, so an operator can tell which
    release a board or a server runs before and after an upgrade."""
    parser.add_argument("--version", action="version", version=f"%(prog)s {VERSION}")


def reported(prog: str, action: Callable[[], int], sigterm_exit: int = 0) -> int:
    """Runs a command's action: a UsageError is one line on stderr and exit 2, an interrupt 130, a SIGTERM
    `sigterm_exit`; any other exception is a bug and escapes with its traceback."""
    try:
        return action()
    except UsageError as error:
        print(f"{prog}: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except Terminated:
        return sigterm_exit
