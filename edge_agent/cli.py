# The edge-agent command line: `edge-agent run` connects a device to its fleet and serves rounds.
from __future__ import annotations

import argparse
import logging
import signal
import sys
from pathlib import Path

from edge_agent import wire
from edge_agent.agent import Agent, AgentSettings
from edge_agent.data import load_shard, open_device_data
from edge_agent.logs import configure_logging
from edge_agent.mqtt import BrokerUnavailableError, MqttSession, parse_broker_url
from edge_agent.oracle import SimulatedOracle

log = logging.getLogger("edge_agent")


def build_parser() -> argparse.ArgumentParser:
    """Arguments of every edge-agent subcommand."""
    parser = argparse.ArgumentParser(prog="edge-agent", description="Federated active-learning device agent.")
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("run", help="join a fleet and serve its rounds")
    run.add_argument("--broker", required=True, help="mqtt://HOST:PORT or mqtts://HOST:PORT")
    run.add_argument("--fleet", required=True)
    run.add_argument("--device-id", required=True)
    run.add_argument("--data", required=True, type=Path,
                     help="pool shard (.npz: images, the simulated oracle's labels, optional seeds)")
    run.add_argument("--state-dir", type=Path, help="where labels and progress persist (default ./agent-state/ID)")
    run.add_argument("--torch-threads", type=int, default=1)
    run.add_argument("--inference-batch", type=int, default=256)
    run.add_argument("--exit-on-final", action="store_true", help="exit when the coordinator ends the run")
    run.add_argument("--log-level", default="info")
    return parser


def run_agent(args: argparse.Namespace) -> int:
    """Opens the device's data, connects, and serves rounds until the run ends or a signal arrives."""
    wire.check_identifier("device id", args.device_id)
    wire.check_identifier("fleet", args.fleet)
    shard = load_shard(args.data)
    data = open_device_data(args.state_dir or Path("agent-state") / args.device_id, shard)
    settings = AgentSettings(fleet=args.fleet, device_id=args.device_id, torch_threads=args.torch_threads,
                             inference_batch=args.inference_batch, exit_on_final=args.exit_on_final)
    session = MqttSession(parse_broker_url(args.broker), client_id=args.device_id,
                          last_will=Agent.last_will(settings), max_payload_bytes=settings.max_update_bytes)
    agent = Agent(settings, session, data, SimulatedOracle(shard.all_labels))
    signal.signal(signal.SIGTERM, lambda *_: agent.stop_event.set())
    session.connect()
    try:
        agent.run()
    finally:
        session.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of the edge-agent console script."""
    args = build_parser().parse_args(argv)
    configure_logging(args.log_level)
    try:
        return run_agent(args)
    except (ValueError, FileNotFoundError, BrokerUnavailableError) as error:
        print(f"edge-agent: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
