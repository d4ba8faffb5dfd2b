# The edge-agent command line: `run` serves a fleet's rounds; `score` and `predict` read a pool; `doctor` checks.
from __future__ import annotations

from collections.abc import Sequence

from edge_agent.loop.memory_budget import keep_large_frees_returnable
from protocol.commands import Command, CommandLine

EDGE_AGENT = CommandLine(
    "edge-agent",
    "Federated active-learning device agent.",
    (
        Command("run", "join a fleet and serve its rounds from a folder pool", "edge_agent.run_command"),
        Command(
            "score",
            "score a pool file or image folder with a model bundle and print one JSON line",
            "edge_agent.score_command",
        ),
        Command(
            "predict",
            "predict each image of a folder with a model bundle: class, probability, uncertainty (JSON lines or CSV)",
            "edge_agent.predict_command",
        ),
        Command(
            "doctor",
            "check that this board can serve: Python, onnxruntime, memory, state folder, clock, broker",
            "edge_agent.doctor_command",
        ),
    ),
)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the edge-agent console script (a board's memory: freed arrays go back to the system)."""
    keep_large_frees_returnable()
    return EDGE_AGENT.main(argv)
