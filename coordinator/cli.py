# The fl-coordinator command line: its commands by name, each in its own module (loaded only when it runs).
from __future__ import annotations

from collections.abc import Sequence

from protocol.commands import Command, CommandLine

STOPS = 143  # SIGTERM: every `finally` ran, the run can resume

FL_COORDINATOR = CommandLine(
    "fl-coordinator",
    "Federated active-learning coordinator.",
    (
        Command("run", "coordinate a fleet of field devices", "coordinator.commands.run", STOPS),
        Command(
            "relay",
            "coordinate a site's devices and answer the central fleet as one device",
            "coordinator.commands.relay",
            STOPS,
        ),
        Command(
            "ha-bridge",
            "republish the fleet's predictions as Home Assistant sensors (MQTT discovery, JSON states)",
            "coordinator.commands.ha_bridge",
            STOPS,
        ),
        Command(
            "provision",
            "write a fleet's broker passwords, ACL, device credentials, HMAC keys (and TLS files)",
            "coordinator.commands.provision",
            STOPS,
        ),
        Command("report", "write a run's self-contained HTML report", "coordinator.commands.report", STOPS),
        Command(
            "methods",
            "list the samplers, local rules and strategies with their options",
            "coordinator.commands.methods",
            STOPS,
        ),
        Command(
            "export",
            "write a device bundle (ONNX, MC dropout kept) of a run's checkpoint",
            "coordinator.commands.export",
            STOPS,
        ),
        Command(
            "labelling",
            "serve the fleet's labelling queue and page; export or import it as Label Studio tasks",
            "coordinator.commands.labelling",
            STOPS,
        ),
        Command(
            "promote",
            "make a committed round's model the serving version (a running coordinator publishes it)",
            "coordinator.commands.promote",
            STOPS,
        ),
        Command(
            "rollback",
            "make the version that served before the current one serve again",
            "coordinator.commands.rollback",
            STOPS,
        ),
        Command(
            "dataset",
            "build the server's labelled images (--dataset's .npz) from photo folders or a CSV, with a report",
            "coordinator.commands.dataset",
            STOPS,
        ),
        Command(
            "encoder",
            "fit FAST's frozen encoder (PCA) on unlabelled images and write its ONNX",
            "coordinator.commands.encoder",
            STOPS,
        ),
    ),
)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the fl-coordinator console script."""
    return FL_COORDINATOR.main(argv)
