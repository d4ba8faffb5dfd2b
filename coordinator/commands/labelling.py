# `fl-coordinator labelling`: serve the fleet's labelling queue (its desk and page), export it as Label Studio tasks,
# import Label Studio's annotations back as answers.
from __future__ import annotations

import argparse
import contextlib
import json
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from protocol.errors import UsageError
from protocol.http_edge import HOST_HELP
from protocol.model_spec import load_model_spec
from protocol.shutdown import Terminated, raise_on_sigterm
from protocol.supervision import Health

if TYPE_CHECKING:  # the queue loads PIL and sqlite only when an action runs
    from coordinator.dashboard.server import Dashboard
    from coordinator.labelling.desk import LabellingDesk
    from coordinator.labelling.queue import LabelQueue
    from coordinator.setup.settings import ServerSettings
    from protocol.mqtt import BrokerAddress

MIB = 1024 * 1024
DEFAULT_FIELD_TEST_SHARE = 0.1
LABELLING_CREDENTIALS = "labelling.json"  # the desk's login in a provisioned folder


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """`serve`, `export` and `import`, each over a run directory's queue."""
    commands = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    serve = commands.add_parser("serve", help="take the devices' queries and serve the labelling page")
    serve.add_argument("run_dir", type=Path, metavar="RUN_DIR")
    serve.add_argument("--broker", required=True, help="mqtt://[user:pass@]HOST:PORT of the fleet's broker")
    serve.add_argument("--fleet", default="default")
    serve.add_argument(
        "--credentials",
        type=Path,
        metavar="FILE",
        help="a secured fleet's labelling.json (from `provision`): the desk's own login, TLS files",
    )
    serve.add_argument("--model-spec", type=Path, help="the fleet's TOML model spec (its class names)")
    serve.add_argument("--dashboard", required=True, metavar="[HOST:]PORT", help="where the labelling page listens")
    serve.add_argument("--dashboard-token", help="the page's bearer token (default: generated off loopback)")
    serve.add_argument("--dashboard-host", action="append", metavar="NAME", help=HOST_HELP)
    serve.add_argument("--answers-per-query", type=int, default=1, help="people per query; a majority decides")
    serve.add_argument("--max-queries-per-device", type=int, default=500, help="open queries kept per device")
    serve.add_argument("--max-queries", type=int, default=10000, help="open queries kept in all")
    serve.add_argument("--max-image-mb", type=float, default=2.0, help="the largest query image accepted")
    serve.add_argument("--resend-seconds", type=float, default=30.0, help="first wait before an answer is resent")
    serve.add_argument(
        "--undo-seconds", type=float, default=30.0, help="how long a page's answer waits for an undo before it is sent"
    )
    serve.add_argument(
        "--undo-answers", type=int, default=10, help="how many of a person's latest answers wait for an undo at most"
    )
    add_field_test_share(serve)
    export = commands.add_parser("export", help="write the queue as Label Studio JSON tasks")
    export.add_argument("run_dir", type=Path, metavar="RUN_DIR")
    export.add_argument("--out", type=Path, required=True, help="a folder: tasks.json, config.xml and images/")
    export.add_argument("--model-spec", type=Path, help="the fleet's TOML model spec (its class names)")
    export.add_argument("--image-url-prefix", default="", help="put before each image's path in the tasks")
    export.add_argument("--open-only", action="store_true", help="only the queries nobody has answered")
    imported = commands.add_parser("import", help="read Label Studio's annotated tasks back as answers")
    imported.add_argument("run_dir", type=Path, metavar="RUN_DIR")
    imported.add_argument("tasks", type=Path, metavar="TASKS_JSON")
    imported.add_argument("--model-spec", type=Path, help="the fleet's TOML model spec (its class names)")
    imported.add_argument("--answers-per-query", type=int, default=1, help="people per query; a majority decides")
    for sub in (serve, export, imported):
        sub.add_argument("--log-level", default="info")
    parser.set_defaults(log_level="info")


def add_field_test_share(parser: argparse.ArgumentParser) -> None:
    """--field-test-share: the share of queries whose answers become the field's test set."""
    parser.add_argument(
        "--field-test-share",
        type=float,
        default=DEFAULT_FIELD_TEST_SHARE,
        metavar="SHARE",
        help="the share of queries marked, when queued, as field test queries: their answers judge each round's "
        "model (the field set) and never reach a device as labels (0: none)",
    )


def checked_share(share: float) -> float:
    """--field-test-share, a UsageError when it is outside [0, 1)."""
    if not 0.0 <= share < 1.0:
        raise UsageError(f"--field-test-share must lie in [0, 1), got {share}")
    return share


def class_names(spec: Path | None) -> tuple[str, ...]:
    """The class names of the fleet's model spec (the default spec's without one)."""
    from protocol.model_spec import DEFAULT_SPEC

    return tuple((load_model_spec(spec).spec if spec else DEFAULT_SPEC).class_names)


def open_queue(args: argparse.Namespace, voters: int = 1) -> LabelQueue:
    """The run directory's queue with the command's limits."""
    from coordinator.labelling.queue import LabelQueue
    from coordinator.labelling.queue_records import QueueLimits, UndoWindow

    if voters < 1:
        raise UsageError(f"--answers-per-query must be at least 1, got {voters}")
    limits, undo, share = QueueLimits(), UndoWindow(), 0.0
    if args.action == "serve":
        share = checked_share(args.field_test_share)
        if min(args.max_queries_per_device, args.max_queries) < 1 or not 0 < args.max_image_mb <= 64:
            raise UsageError("--max-queries(-per-device) must be positive and --max-image-mb in (0, 64]")
        if not 0 <= args.undo_seconds <= 3600 or not 0 <= args.undo_answers <= 100:
            raise UsageError("--undo-seconds must be in [0, 3600] and --undo-answers in [0, 100]")
        limits = QueueLimits(args.max_queries_per_device, args.max_queries, int(args.max_image_mb * MIB))
        undo = UndoWindow(args.undo_seconds, args.undo_answers)
    return LabelQueue(args.run_dir, class_names(args.model_spec), limits, voters, undo, share)


@contextlib.contextmanager
def desk_running(
    fleet: str,
    broker: BrokerAddress,
    queue: LabelQueue,
    health: Health,
    keys: dict[str, bytes] | None,
    resend_seconds: float = 30.0,
) -> Iterator[LabellingDesk]:
    """The desk on its own session (client `labelling-<fleet>`, manual acks, transfers bounded by the queue's image
    bound) for the duration of a with-block, its health in `health` (the page's), signing with a secured fleet's
    `keys`; the queue is closed after."""
    from coordinator.labelling.desk import LabellingDesk
    from protocol.mqtt import MqttSession
    from protocol.reassembly import ChunkLimits

    largest = queue.limits.image_bytes + 64 * 1024
    session = MqttSession(
        broker,
        client_id=f"labelling-{fleet}",
        manual_ack=True,
        chunk_limits=ChunkLimits(max_message_bytes=largest, sender_bytes=2 * largest, total_bytes=64 * MIB),
    )
    try:
        session.connect()
        desk = LabellingDesk(fleet, session, queue, resend_seconds, health, keys).start()
        try:
            yield desk
        finally:
            desk.stop()
    finally:
        session.close()
        queue.close()


def with_labelling(
    serve: Callable[[BrokerAddress], object], settings: ServerSettings, dashboard: Dashboard, field_test_share: float
) -> Callable[[BrokerAddress], None]:
    """`fl-coordinator run --labelling`: the run's rounds with the desk beside them on the same broker (a secured
    fleet's desk logs in with the provisioned labelling.json), marking `field_test_share` of the queries as field
    test queries, and the labelling page on the run's dashboard."""
    from coordinator.fleet.provision import labelling_keys
    from coordinator.labelling.queue import LabelQueue

    def serving(address: BrokerAddress) -> None:
        secure = settings.secure_dir
        login = desk_login(address, None if secure is None else secure / LABELLING_CREDENTIALS, settings.fleet)
        queue = LabelQueue(settings.run_dir, tuple(settings.spec.class_names), field_test_share=field_test_share)
        keys = None if secure is None else labelling_keys(secure)
        with desk_running(settings.fleet, login, queue, dashboard.server.parts_health, keys) as desk:
            dashboard.server.labelling = desk
            print(f"labelling page at {dashboard.url}label (the dashboard's token)", file=sys.stderr, flush=True)
            try:
                serve(address)
            finally:  # the page lets go of the desk before its queue closes (a late request met a closed database)
                dashboard.server.labelling = None

    return serving


def desk_login(broker: BrokerAddress, credentials_file: Path | None, fleet: str) -> BrokerAddress:
    """The broker address with the desk's own login from a provisioned labelling.json (as is without one)."""
    from protocol.credentials import load_credentials

    if credentials_file is None:
        return broker
    credentials = load_credentials(credentials_file)
    if credentials.fleet != fleet:
        raise UsageError(f"{credentials_file} is for fleet {credentials.fleet!r}, not {fleet!r}")
    return credentials.apply_to(broker)


def serve(args: argparse.Namespace) -> int:
    """Runs the desk and the labelling page until SIGTERM or Ctrl-C."""
    from coordinator.dashboard.server import Dashboard, dashboard_token, parse_listen_address, served_names
    from coordinator.fleet.provision import labelling_keys
    from protocol.mqtt import parse_broker_url

    if args.resend_seconds <= 0:
        raise UsageError(f"--resend-seconds must be positive, got {args.resend_seconds}")
    address = parse_listen_address(args.dashboard)
    hosts = served_names(args.dashboard_host)
    queue = open_queue(args, args.answers_per_query)
    broker = desk_login(parse_broker_url(args.broker), args.credentials, args.fleet)
    token = dashboard_token(address, args.dashboard_token, args.run_dir)
    keys = None if args.credentials is None else labelling_keys(args.credentials.parent)
    health = Health()
    raise_on_sigterm()
    try:
        with (
            desk_running(args.fleet, broker, queue, health, keys, args.resend_seconds) as desk,
            Dashboard(address, args.run_dir, None, token, desk, hosts, health=health) as dashboard,
        ):
            shown = f"#token={token}" if token and args.dashboard_token is None else ""
            print(f"labelling page at {dashboard.url}label{shown}", file=sys.stderr, flush=True)
            threading.Event().wait()
    except (KeyboardInterrupt, Terminated):
        pass
    return 0


def export(args: argparse.Namespace) -> int:
    """Writes tasks.json (Label Studio tasks), config.xml (the labelling config) and the images."""
    from coordinator.labelling.label_studio import export_tasks, labelling_config
    from protocol.files import atomic_write_bytes

    queue = open_queue(args)
    tasks = export_tasks(queue, args.out, args.image_url_prefix, args.open_only)
    atomic_write_bytes(args.out / "tasks.json", json.dumps(tasks, indent=1).encode())
    atomic_write_bytes(args.out / "config.xml", labelling_config(queue.class_names).encode())
    print(f"{len(tasks)} tasks written to {args.out / 'tasks.json'}")
    return 0


def import_answers(args: argparse.Namespace) -> int:
    """Records Label Studio's annotations as answers and corrections (sent to the devices by the next `serve`)."""
    from coordinator.labelling.label_studio import import_tasks

    try:
        tasks = json.loads(args.tasks.read_text())
    # an unreadable or non-JSON file is the person's to fix
    except (OSError, ValueError) as error:
        raise UsageError(f"{args.tasks}: not a JSON file of tasks ({str(error)[:200]})") from None
    if not isinstance(tasks, list):
        raise UsageError(f"{args.tasks}: expected a JSON list of Label Studio tasks")
    queue = open_queue(args, args.answers_per_query)
    try:
        counts = import_tasks(queue, tasks)
    # a task of the wrong shape refuses the whole file before any vote is recorded
    except UsageError as error:
        raise UsageError(f"{args.tasks}: {error}; nothing imported") from None
    kept = sum(decided.field_test for decided in counts.decided)  # field test answers: never sent to a device
    print(
        f"{len(counts.decided) - kept} answers decided, {kept} field test answers kept, {len(counts.corrections)} "
        f"corrected, {counts.votes} votes waiting for others, {counts.unanswered} tasks unanswered, "
        f"{counts.unchanged} unchanged, {counts.refused} refused"
    )
    return 0


def run(args: argparse.Namespace) -> int:
    """Runs the chosen action."""
    actions = {"serve": serve, "export": export, "import": import_answers}
    return actions[args.action](args)
