# `edge-agent run`: a field device joins its fleet and serves its rounds; a bench device reuses it with its own data.
from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from edge_agent.field.field_options import add_field_arguments
from edge_agent.loop.memory_budget import fit_to_budget
from edge_agent.loop.profile import DeviceProfile, load_profile
from protocol import wire
from protocol.chunks import given_packet_limit
from protocol.credentials import Credentials, DeviceIdentity, load_credentials
from protocol.errors import UsageError
from protocol.mqtt import DEFAULT_KEEPALIVE_SECONDS, BrokerAddress, MqttSession, parse_broker_url
from protocol.shutdown import raise_on_sigterm

if TYPE_CHECKING:  # the agent's parts load their runtimes; `edge-agent score` must not
    from edge_agent.data.device_data import DeviceData
    from edge_agent.data.oracle import Oracle
    from edge_agent.field.central import CentralLabelling
    from edge_agent.field.label_ui import LabelServer
    from edge_agent.loop.agent import Agent, BackgroundWork
    from edge_agent.loop.agent_settings import AgentSettings


def add_arguments(run: argparse.ArgumentParser) -> None:
    """`edge-agent run`: a field device's folder pool, and every option of a device (add_device_arguments)."""
    run.add_argument(
        "--pool-dir",
        required=True,
        type=Path,
        help="folder of JPEG/PNG images (a camera's); new files join the pool",
    )
    add_device_arguments(run)


def add_device_arguments(run: argparse.ArgumentParser) -> None:
    """Every option of a device but where its pool comes from: the broker and identity, the profile and its
    overrides, the folder oracle, the label page and stream acquisition (a bench device adds its shard)."""
    add_board_arguments(run)
    run.add_argument(
        "--max-message-bytes",
        type=int,
        help="largest MQTT packet the broker takes, for a broker that does not announce one (MQTT v5 CONNACK); "
        "larger messages travel in chunks",
    )
    run.add_argument("--fleet", help="fleet name (default: the credential file's)")
    run.add_argument("--device-id", help="this device's id (default: the credential file's)")
    run.add_argument("--torch-threads", type=int, help="torch threads (default: the profile's, else 1)")
    run.add_argument("--inference-batch", type=int, help="images per scoring batch (default: the profile's, else 256)")
    run.add_argument("--exit-on-final", action="store_true", help="exit when the coordinator ends the run")
    run.add_argument(
        "--share-pool-statistics",
        action="store_true",
        help="send the unlabelled images' per-class feature means when a round asks for them (the coordinator's "
        "--pool-statistics 1; docs/privacy.md says what they reveal); without it they are withheld (zeros)",
    )
    run.add_argument(
        "--slowdown",
        type=float,
        default=1.0,
        help="bench only: take K times each round's compute time before publishing, as a K times slower device",
    )
    run.add_argument("--log-level", default="info")
    add_field_arguments(run)


def add_board_arguments(parser: argparse.ArgumentParser) -> None:
    """What `run` and `doctor` share: the broker, the credential file, the state folder and the device profile."""
    parser.add_argument("--broker", required=True, help="mqtt://HOST:PORT or mqtts://HOST:PORT")
    parser.add_argument(
        "--credentials",
        type=Path,
        help="credential file from `fl-coordinator provision`: broker login, TLS files, signing key",
    )
    parser.add_argument(
        "--state-dir",
        type=Path,
        help="where labels and progress persist (default: the profile's storage_path, else ./agent-state/ID)",
    )
    parser.add_argument(
        "--profile", type=Path, help="device profile (firmware_configs/*.toml): back end, threads, batch, MC cap, MQTT"
    )


def device_identity(args: argparse.Namespace, credentials: Credentials | None) -> tuple[str, str]:
    """(device id, fleet) from the command line or the credential file; they must agree where both are given."""
    device_id = args.device_id or (credentials.device_id if credentials else None)
    fleet = args.fleet or (credentials.fleet if credentials else None)
    if not device_id or not fleet:
        raise UsageError("--device-id and --fleet are required without --credentials")
    if credentials is not None and (device_id, fleet) != (credentials.device_id, credentials.fleet):
        raise UsageError(
            f"{args.credentials} belongs to device {credentials.device_id!r} of fleet "
            f"{credentials.fleet!r}, not {device_id!r} of {fleet!r}"
        )
    return wire.given_identifier("device id", device_id), wire.given_identifier("fleet", fleet)


def agent_settings(
    args: argparse.Namespace, profile: DeviceProfile | None, credentials: Credentials | None = None
) -> AgentSettings:
    """The agent's settings: command-line values first, then the credential file's and the profile's, then the
    defaults. A credential file for another device or fleet than the command line names is a UsageError."""
    from edge_agent.loop.agent_settings import AgentSettings

    device_id, fleet = device_identity(args, credentials)
    common = {
        "fleet": fleet,
        "device_id": device_id,
        "exit_on_final": args.exit_on_final,
        "stream": args.stream,
        "signing_key": credentials.hmac_key if credentials else b"",
        "identity": credentials.identity if credentials else DeviceIdentity(),
        "slowdown": args.slowdown,
        "share_pool_statistics": args.share_pool_statistics,
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
    address = dataclasses.replace(parse_broker_url(url), max_packet_bytes=given_packet_limit(max_packet_bytes))
    if profile is not None and address.tls:
        address = dataclasses.replace(
            address, ca_file=profile.mqtt.tls_ca, cert_file=profile.mqtt.tls_cert, key_file=profile.mqtt.tls_key
        )
    return credentials.apply_to(address) if credentials is not None else address


def chosen_state_dir(given: Path | None, profile: DeviceProfile | None, device_id: str) -> Path:
    """The agent's state folder: --state-dir, else the profile's storage_path, else ./agent-state/ID."""
    if given is not None:
        return given
    return Path(profile.storage_path) if profile is not None else Path("agent-state") / device_id


def settings_lines(
    given: Path | None,
    state_dir: Path,
    profile: DeviceProfile | None,
    address: BrokerAddress,
    credentials: Credentials | None,
) -> list[str]:
    """One line for each profile setting the command line overrode or left unused, saying which setting won: the
    state folder (--state-dir over storage_path) and the TLS files (unused on plain mqtt://, replaced by a
    credential file's)."""
    if profile is None:
        return []
    lines = []
    if given is not None and Path(profile.storage_path) != given:
        lines.append(
            f"state folder {state_dir} from --state-dir (the profile's storage_path {profile.storage_path} is not used)"
        )
    tls_files = [name for name in ("tls_ca", "tls_cert", "tls_key") if getattr(profile.mqtt, name)]
    if tls_files and not address.tls:
        lines.append(
            f"broker {address.url} is plain TCP: the profile's {', '.join(tls_files)} apply to mqtts:// only "
            "and are not used"
        )
    elif tls_files and credentials is not None:
        lines.append(
            f"TLS files from the credential file of {credentials.device_id} (the profile's {', '.join(tls_files)} "
            "are not used)"
        )
    return lines


@dataclasses.dataclass
class DevicePool:
    """Where a device's samples and labels come from, as its agent runs with them: the settings fitted to the
    profile's memory budget for this pool, the data, the oracle, the work between rounds and the label page."""

    settings: AgentSettings
    data: DeviceData
    oracle: Oracle
    work: BackgroundWork | None = None
    label_server: LabelServer | None = None
    central: CentralLabelling | None = None


# Opens a device's pool from its parsed arguments, its state folder, its settings and its profile (if any).
OpenPool = Callable[[argparse.Namespace, Path, "AgentSettings", DeviceProfile | None], DevicePool]


def open_folder_pool(
    args: argparse.Namespace, state_dir: Path, settings: AgentSettings, profile: DeviceProfile | None
) -> DevicePool:
    """A field device's pool: the --pool-dir folder, the folder oracle, the scans (and stream) between rounds and the
    label page; the scoring batch fits the profile's budget for a full pool (its pool size cap)."""
    from edge_agent.field.field_options import field_settings
    from edge_agent.field.parts import open_field

    options = field_settings(args)
    if profile is not None:
        settings = fit_to_budget(settings, profile.memory_budget_mb, profile.pool_size_cap, options.spec())
    field = open_field(options, state_dir, settings, profile)
    return DevicePool(settings, field.data, field.oracle, field.work, field.label_server, field.central)


@dataclasses.dataclass
class OpenedDevice:
    """One device's agent with what it holds open: its MQTT session (not yet connected), its label page and its link
    to the fleet's labelling queue (`--labelling central`), whose thread reads the session's answers topic."""

    agent: Agent
    session: MqttSession
    label_server: LabelServer | None = None
    central: CentralLabelling | None = None

    def close(self) -> None:
        """Disconnects the sessions and stops the label page and the labelling link (if any)."""
        self.session.close()
        if self.central is not None:
            self.central.close()
        if self.label_server is not None:
            self.label_server.stop()


def open_device(args: argparse.Namespace, open_pool: OpenPool = open_folder_pool) -> OpenedDevice:
    """Builds one device's agent from `edge-agent run` arguments: its settings, session, and the pool `open_pool`
    opens (a field device's folder; a bench passes its own). Every host of an agent builds it here."""
    from edge_agent.loop.agent import Agent, last_will

    credentials = load_credentials(args.credentials) if args.credentials else None
    profile = load_profile(args.profile) if args.profile is not None else None
    settings = agent_settings(args, profile, credentials)
    address = broker_address(args.broker, profile, credentials, args.max_message_bytes)
    session = MqttSession(
        address,
        client_id=settings.device_id,
        last_will=last_will(settings),
        max_payload_bytes=settings.max_update_bytes,
        keepalive=profile.mqtt.keepalive if profile else DEFAULT_KEEPALIVE_SECONDS,
    )
    state_dir = chosen_state_dir(args.state_dir, profile, settings.device_id)
    for line in settings_lines(args.state_dir, state_dir, profile, address, credentials):
        print(f"edge-agent: {line}", flush=True)
    pool = open_pool(args, state_dir, settings, profile)
    agent = Agent(pool.settings, session, pool.data, pool.oracle, pool.work)
    pool.oracle.stop_with(agent.stop_event)  # a person's answers are awaited only while the agent runs
    if pool.central is not None:
        pool.central.open(session)
    return OpenedDevice(agent, session, pool.label_server, pool.central)


def serve(device: OpenedDevice) -> int:
    """Connects an opened device and serves rounds until the run ends or a signal arrives; closes it after."""
    raise_on_sigterm()
    try:
        device.session.connect()
        device.agent.run()
    finally:
        device.close()
    return 0


def run(args: argparse.Namespace) -> int:
    """`edge-agent run`: opens the field device and serves its rounds."""
    return serve(open_device(args))
