# `edge-agent doctor`: whether this board can serve, one line per check; the systemd unit runs it before the agent.
from __future__ import annotations

import argparse
import time
from pathlib import Path

from edge_agent.loop.board_checks import (
    Verdict,
    broker_check,
    clock_check,
    runtime_check,
    state_check,
    this_board_memory,
    this_python,
)
from edge_agent.loop.profile import load_profile
from edge_agent.run_command import add_board_arguments, broker_address
from protocol.credentials import load_credentials


def add_arguments(doctor: argparse.ArgumentParser) -> None:
    """`edge-agent doctor`: the broker, credentials, state folder and profile the agent will run with."""
    add_board_arguments(doctor)
    doctor.add_argument("--log-level", default="warning")


def board_verdicts(args: argparse.Namespace) -> list[Verdict]:
    """Every check, in the order a person fixes them: interpreter, runtime, memory, state folder, clock, broker."""
    profile = load_profile(args.profile) if args.profile is not None else None
    credentials = load_credentials(args.credentials) if args.credentials is not None else None
    state_dir = args.state_dir or Path(profile.storage_path if profile else "agent-state")
    python = this_python()
    if not python.ok:
        return [python]  # nothing else can run on this interpreter
    return [
        python,
        runtime_check(),
        this_board_memory(profile.memory_budget_mb if profile else None),
        state_check(state_dir),
        clock_check(time.time()),
        broker_check(broker_address(args.broker, profile, credentials)),
    ]


def run(args: argparse.Namespace) -> int:
    """Prints one line per check and a verdict; exit 0 only when every check passes (the board can serve), else 1."""
    verdicts = board_verdicts(args)
    for verdict in verdicts:
        print(verdict, flush=True)
    failed = [verdict.name for verdict in verdicts if not verdict.ok]
    print(f"not ready: {', '.join(failed)} failed" if failed else "ready: this board can serve its fleet")
    return 1 if failed else 0
