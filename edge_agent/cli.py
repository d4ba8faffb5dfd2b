# The edge-agent command line: `edge-agent run` serves a fleet's rounds; `edge-agent score` scores a pool file or folder.
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bench.oracle import SimulatedOracle
from bench.shard import load_shard, open_device_data
from edge_agent.field.field_options import add_field_arguments
from edge_agent.loop.memory_budget import fit_to_budget
from edge_agent.loop.profile import DeviceProfile, load_profile
from edge_agent.score_command import BACKENDS, score_pool
from protocol import messages, wire
from protocol.chunks import MIN_PACKET_BYTES
from protocol.credentials import Credentials, load_credentials
from protocol.logs import configure_logging
from protocol.mqtt import (
    DEFAULT_KEEPALIVE_SECONDS,
    BrokerAddress,
    BrokerUnavailableError,
    MqttSession,
    parse_broker_url,
)
from protocol.shutdown import Terminated, raise_on_sigterm

if TYPE_CHECKING:  # the agent imports torch; `edge-agent score` must not
    from edge_agent.field.label_ui import LabelServer
    from edge_agent.loop.agent import Agent
    from edge_agent.loop.agent_settings import AgentSettings

log = logging.getLogger("edge_agent")


def build_parser() -> argparse.ArgumentParser:
    """Arguments of every edge-agent subcommand."""
    parser = argparse.ArgumentParser(prog="edge-agent", description="Federated active-learning device agent.")
    commands = parser.add_subparsers(dest="command", required=True)
    add_run_arguments(commands.add_parser("run", help="join a fleet and serve its rounds"))
    add_host_arguments(commands.add_parser("host", help="serve many virtual devices in one process (a bench's worker)"))
    add_score_arguments(
        commands.add_parser(
            "score", help="score a pool file or image folder with a model bundle and print one JSON line"
        )
    )
    return parser


def add_run_arguments(run: argparse.ArgumentParser) -> None:
    """`edge-agent run`: the broker and identity, the data (a shard or a folder), the profile and its overrides."""
    run.add_argument("--broker", required=True, help="mqtt://HOST:PORT or mqtts://HOST:PORT")
    run.add_argument(
        "--max-message-bytes",
        type=int,
        help="largest MQTT packet the broker takes, for a broker that does not announce one (MQTT v5 CONNACK); "
        "larger messages travel in chunks",
    )
    run.add_argument("--fleet", help="fleet name (default: the credential file's)")
    run.add_argument("--device-id", help="this device's id (default: the credential file's)")
    run.add_argument(
        "--credentials",
        type=Path,
        help="credential file from `fl-coordinator provision`: broker login, TLS files, signing key",
    )
    run.add_argument(
        "--data",
        type=Path,
        help="pool shard (.npz: images, the simulated oracle's labels, optional seeds); or --pool-dir",
    )
    run.add_argument("--state-dir", type=Path, help="where labels and progress persist (default ./agent-state/ID)")
    run.add_argument(
        "--profile", type=Path, help="device profile (firmware_configs/*.toml): back end, threads, batch, MC cap, MQTT"
    )
    run.add_argument("--torch-threads", type=int, help="torch threads (default: the profile's, else 1)")
    run.add_argument("--inference-batch", type=int, help="images per scoring batch (default: the profile's, else 256)")
    run.add_argument("--exit-on-final", action="store_true", help="exit when the coordinator ends the run")
    run.add_argument(
        "--slowdown",
        type=float,
        default=1.0,
        help="bench only: take K times each round's compute time before publishing, as a K times slower device",
    )
    run.add_argument("--log-level", default="info")
    add_field_arguments(run)


def add_host_arguments(host: argparse.ArgumentParser) -> None:
    """`edge-agent host`: the devices file (each device's `run` arguments and log file) and where failures go."""
    host.add_argument(
        "--devices",
        required=True,
        type=Path,
        help='JSON {"devices": [{"device_id", "log_file", "argv": [`edge-agent run` arguments]}, ...]}',
    )
    host.add_argument("--exits", type=Path, help="file to append `DEVICE CODE` to for each device that fails")
    host.add_argument("--log-level", default="info")


def add_score_arguments(score: argparse.ArgumentParser) -> None:
    """`edge-agent score`: a bundle, a pool, the sampler and how to run it."""
    score.add_argument("--bundle", required=True, type=Path, help="a model bundle folder written by fl-export")
    score.add_argument(
        "--pool",
        required=True,
        type=Path,
        help="an IDX images file (.gz ok), a shard .npz, an .npy array, or a folder of JPEG/PNG images",
    )
    score.add_argument("--passes", type=int, default=20, help="MC-dropout passes (capped by --profile)")
    score.add_argument("--top", type=int, default=400, help="how many samples to select")
    score.add_argument("--sampler", default=messages.Recipe.sampler)
    score.add_argument("--backend", choices=BACKENDS, help="default: the profile's, else onnxruntime")
    score.add_argument("--precision", choices=("fp32", "int8"), default="fp32", help="onnxruntime graphs to run")
    score.add_argument(
        "--batch",
        type=int,
        help="images per inference batch (default: the profile's, else 64 for onnxruntime, 256 for torch)",
    )
    score.add_argument("--threads", type=int, help="intra-op threads (default: the profile's, else the runtime's)")
    score.add_argument("--limit", type=int, help="score only the first N pool images (capped by --profile)")
    score.add_argument("--profile", type=Path, help="a firmware_configs/*.toml device profile")
    score.add_argument("--seed", type=int, default=0, help="seed of the dropout masks")
    score.add_argument("--json", action="store_true", help="print the result as one JSON line (the only format)")
    score.add_argument("--log-level", default="warning")


def run_score(args: argparse.Namespace) -> int:
    """Scores a pool with a bundle, honouring a device profile's caps, and prints the JSON result."""
    passes, limit = args.passes, args.limit
    settings: dict[str, Any] = {
        "backend": "onnxruntime",
        "batch": None,
        "threads": 0,
        "providers": ("CPUExecutionProvider",),
    }
    if args.profile is not None:
        profile = load_profile(args.profile)
        settings = {
            "backend": profile.backend,
            "batch": profile.inference_batch,
            "threads": profile.threads,
            "providers": profile.execution_providers,
        }
        passes = min(passes, profile.mc_passes_cap)
        limit = min(limit or profile.pool_size_cap, profile.pool_size_cap)
    result = score_pool(
        args.bundle,
        args.pool,
        passes,
        args.top,
        args.sampler,
        backend=args.backend or settings["backend"],
        batch_size=args.batch or settings["batch"],
        limit=limit,
        seed=args.seed,
        threads=args.threads or settings["threads"],
        precision=args.precision,
        providers=settings["providers"],
    )
    print(json.dumps(result))
    return 0


def device_identity(args: argparse.Namespace, credentials: Credentials | None) -> tuple[str, str]:
    """(device id, fleet) from the command line or the credential file; they must agree where both are given."""
    device_id = args.device_id or (credentials.device_id if credentials else None)
    fleet = args.fleet or (credentials.fleet if credentials else None)
    if not device_id or not fleet:
        raise ValueError("--device-id and --fleet are required without --credentials")
    if credentials is not None and (device_id, fleet) != (credentials.device_id, credentials.fleet):
        raise ValueError(
            f"{args.credentials} belongs to device {credentials.device_id!r} of fleet "
            f"{credentials.fleet!r}, not {device_id!r} of {fleet!r}"
        )
    return device_id, fleet


def agent_settings(
    args: argparse.Namespace, profile: DeviceProfile | None, credentials: Credentials | None = None
) -> AgentSettings:
    """The agent's settings: command-line values first, then the credential file's and the profile's, then the
    bench defaults. A credential file for another device or fleet than the command line names is an error."""
    from edge_agent.loop.agent_settings import AgentSettings

    device_id, fleet = device_identity(args, credentials)
    common = {
        "fleet": wire.check_identifier("fleet", fleet),
        "device_id": wire.check_identifier("device id", device_id),
        "exit_on_final": args.exit_on_final,
        "stream": args.stream,
        "signing_key": credentials.hmac_key if credentials else b"",
        "slowdown": args.slowdown,
    }
    if profile is None:
        return AgentSettings(
            **common,
            torch_threads=args.torch_threads or 1,
            inference_batch=args.inference_batch or AgentSettings.inference_batch,
        )
    return AgentSettings(
        **common,
        profile=profile.name,
        backend=profile.backend,
        trainer=profile.trainer,
        torch_threads=args.torch_threads or profile.threads,
        inference_batch=args.inference_batch or profile.inference_batch,
        inference_threads=profile.threads,
        execution_providers=profile.execution_providers,
        mc_passes_cap=profile.mc_passes_cap,
        memory_budget_mb=profile.memory_budget_mb,
    )


def broker_address(
    url: str, profile: DeviceProfile | None, credentials: Credentials | None = None, max_packet_bytes: int | None = None
) -> BrokerAddress:
    """The broker URL with the profile's TLS files when it is mqtts://, the credential file's login and TLS files
    (which win) when one is given, and the broker's packet limit if known (--max-message-bytes)."""
    if max_packet_bytes is not None and max_packet_bytes < MIN_PACKET_BYTES:
        raise ValueError(f"--max-message-bytes must be at least {MIN_PACKET_BYTES}, got {max_packet_bytes}")
    address = dataclasses.replace(parse_broker_url(url), max_packet_bytes=max_packet_bytes)
    if profile is not None and address.tls:
        address = dataclasses.replace(
            address, ca_file=profile.mqtt.tls_ca, cert_file=profile.mqtt.tls_cert, key_file=profile.mqtt.tls_key
        )
    return credentials.apply_to(address) if credentials is not None else address


def check_data_source(args: argparse.Namespace) -> None:
    """Exactly one of a bench shard or a folder pool; the stream and the label page only with a folder pool."""
    if (args.data is None) == (args.pool_dir is None):
        raise ValueError("give exactly one of --data (a bench shard) or --pool-dir (a folder of images)")
    if args.pool_dir is None and (args.stream or args.label_ui):
        raise ValueError("--stream and --label-ui need --pool-dir (a folder pool with the folder oracle)")


@dataclasses.dataclass
class OpenedDevice:
    """One device's agent with what it holds open: its MQTT session (not yet connected) and its label page."""

    agent: Agent
    session: MqttSession
    label_server: LabelServer | None = None

    def close(self) -> None:
        """Disconnects the session and stops the label page (if any)."""
        self.session.close()
        if self.label_server is not None:
            self.label_server.stop()


def open_device(args: argparse.Namespace) -> OpenedDevice:
    """Builds one device's agent from `edge-agent run` arguments: its settings, data, oracle and session. Every
    host of an agent (its own process, or a worker hosting many virtual devices) builds it here."""
    from edge_agent.field.field_options import field_settings
    from edge_agent.field.parts import open_field
    from edge_agent.loop.agent import Agent, last_will

    check_data_source(args)
    credentials = load_credentials(args.credentials) if args.credentials else None
    profile = load_profile(args.profile) if args.profile is not None else None
    settings = agent_settings(args, profile, credentials)
    state_dir = args.state_dir or Path("agent-state") / settings.device_id
    session = MqttSession(
        broker_address(args.broker, profile, credentials, args.max_message_bytes),
        client_id=settings.device_id,
        last_will=last_will(settings),
        max_payload_bytes=settings.max_update_bytes,
        keepalive=profile.mqtt.keepalive if profile else DEFAULT_KEEPALIVE_SECONDS,
    )
    if args.pool_dir is not None:
        if profile is not None:
            settings = fit_to_budget(settings, profile.memory_budget_mb, profile.pool_size_cap)
        field = open_field(field_settings(args), state_dir, settings, profile)
        agent = Agent(settings, session, field.data, field.oracle, field.work)
        field.oracle.stop_event = agent.stop_event
        return OpenedDevice(agent, session, field.label_server)
    shard = load_shard(args.data)
    data = open_device_data(state_dir, shard)
    if profile is not None:
        settings = fit_to_budget(settings, profile.memory_budget_mb, data.num_samples)
    return OpenedDevice(Agent(settings, session, data, SimulatedOracle(shard.all_labels)), session)


def run_agent(args: argparse.Namespace) -> int:
    """Opens the device's data, connects, and serves rounds until the run ends or a signal arrives."""
    device = open_device(args)
    raise_on_sigterm()
    try:
        device.session.connect()
        device.agent.run()
    finally:
        device.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of the edge-agent console script."""
    args = build_parser().parse_args(argv)
    configure_logging(args.log_level)
    try:
        if args.command == "host":
            from bench.host import run_host

            return run_host(args)
        return run_score(args) if args.command == "score" else run_agent(args)
    except (ValueError, FileNotFoundError, BrokerUnavailableError) as error:
        print(f"edge-agent: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except Terminated:
        return 0
