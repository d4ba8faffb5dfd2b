# The must-hold of the central labelling queue, with real processes: a person answers two devices' queries on the
# real page in headless chromium; each answer lands in its device's labelled store exactly once, also when the
# coordinator's desk is killed between storing an answer and the device's receipt, and when a device is killed
# between receiving an answer and storing it; a slip undone before delivery never reaches its device, and an answer
# corrected after delivery is replaced in the device's store.
from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np
from browser import ARTIFACTS, WebDriver, answers, free_port, headless_chromium, needs_chromium, wait_for
from test_folder_pool import write_png

from coordinator.fleet.broker import EmbeddedBroker
from edge_agent.data.fashion_mnist import load_fashion_mnist
from edge_agent.data.labelled_record import LABEL_SOURCES, LabelledRecord
from edge_agent.data.query_store import QueryStore
from edge_agent.field.folder_oracle import FolderOracle, QueryBook
from edge_agent.field.folder_pool import open_folder_data

FLEET = "yard"
TOKEN = "central-labelling-token"
DEVICES = ("cam-a", "cam-b")
IMAGES = 3
QUERIES = 2
UNDO_SECONDS = 2  # how long the page's answers wait for an undo before the desk sends them


def asked_queries(root: Path, device: str, first_image: int) -> Path:
    """A device's camera folder and state with QUERIES queries asked in an earlier round (as its oracle asks)."""
    images = load_fashion_mnist().test_images
    for i in range(IMAGES):
        write_png(root / device / "camera" / f"{i}.png", images[first_image + i], age_seconds=30 - i)
    state = root / device / "state"
    data = open_folder_data(state, root / device / "camera", pool_cap=10, settle_seconds=0)
    oracle = FolderOracle(QueryBook(state / "labelling"), data, wait_seconds=0)
    oracle.start_round(1)
    oracle.ask(np.arange(QUERIES))
    return state


def start(command: list[str], log: Path) -> subprocess.Popen:
    """A real process of this project, logging to `log`."""
    with open(log, "ab") as handle:
        return subprocess.Popen([sys.executable, "-m", *command], stdout=handle, stderr=handle, env=os.environ.copy())


def device(broker: EmbeddedBroker, root: Path, name: str) -> subprocess.Popen:
    """`edge-agent run --labelling central` over the device's folder."""
    arguments = ["--broker", f"mqtt://127.0.0.1:{broker.port}", "--fleet", FLEET, "--device-id", name]
    folders = ["--pool-dir", str(root / name / "camera"), "--state-dir", str(root / name / "state")]
    field = ["--labelling", "central", "--scan-interval", "0.3", "--settle-seconds", "0", "--log-level", "info"]
    return start(["edge_agent", "run", *arguments, *folders, *field], root / f"{name}.log")


def desk(broker: EmbeddedBroker, root: Path, port: int) -> subprocess.Popen:
    """`fl-coordinator labelling serve`: the queue's desk and its page."""
    arguments = ["--broker", f"mqtt://127.0.0.1:{broker.port}", "--fleet", FLEET, "--dashboard", str(port)]
    options = ["--dashboard-token", TOKEN, "--resend-seconds", "1", "--undo-seconds", str(UNDO_SECONDS)]
    options += ["--field-test-share", "0", "--log-level", "info"]
    return start(["coordinator", "labelling", "serve", str(root / "run"), *arguments, *options], root / "desk.log")


def page_up(url: str) -> bool:
    """Whether the page answers (the desk subscribes before it serves)."""
    return answers(url)


def open_count(url: str) -> int:
    """How many queries the queue holds open (0 while the desk is not answering)."""
    request = urllib.request.Request(url + "api/label/next?person=probe", headers={"Authorization": f"Bearer {TOKEN}"})
    try:
        with urllib.request.urlopen(request, timeout=2) as response:
            return int(json.loads(response.read())["open"])
    except OSError:
        return 0


def labelled(state: Path) -> dict[int, int]:
    """A device's labelled store as it is on disk: index -> label."""
    path = state / "labels.npz"
    if not path.exists():
        return {}
    record = LabelledRecord.load(path, IMAGES)
    assert len(set(record.indices.tolist())) == len(record.indices)
    return dict(zip(record.indices.tolist(), record.labels.tolist()))


def shown(page: WebDriver) -> tuple[str, str]:
    """(device, query id) of the query the page shows, once its image is on screen."""
    script = (
        "const image = document.getElementById('query-image');"
        "return image.complete && image.naturalWidth > 0 && document.body.dataset.query || null;"
    )
    device_id, query_id = wait_for(lambda: page.evaluate(script), 30, "a query on the page").split("/")
    return device_id, query_id


def answer_on_page(page: WebDriver, label: int, by_key: bool) -> tuple[str, str]:
    """Answers the shown query by clicking its class's button (or pressing its key); its (device, query id)."""
    query = shown(page)
    if by_key:
        page.evaluate(f"document.dispatchEvent(new KeyboardEvent('keydown', {{key: '{label + 1}'}})); return 1;")
    else:
        page.evaluate(f"document.querySelector('button.class-button[data-label=\"{label}\"]').click(); return 1;")
    wait_for(lambda: page.evaluate("return document.body.dataset.query") != "/".join(query), 30, "the next query")
    return query


def index_of(state: Path, query_id: str) -> int:
    return next(q.index for q in QueryBook(state / "labelling").queries() if q.query_id == query_id)


def undelivered(root: Path) -> int:
    """Answers and corrections the devices have not receipted yet."""
    with sqlite3.connect(root / "run" / "labelling" / "queue.sqlite") as db:
        answers = db.execute("SELECT COUNT(*) FROM queries WHERE label IS NOT NULL AND delivered_at IS NULL")
        corrections = db.execute("SELECT COUNT(*) FROM corrections WHERE delivered_at IS NULL")
        return answers.fetchone()[0] + corrections.fetchone()[0]


def held(root: Path) -> int:
    """Answers the desk still holds for an undo."""
    with sqlite3.connect(root / "run" / "labelling" / "queue.sqlite") as db:
        return db.execute("SELECT COUNT(*) FROM held").fetchone()[0]


def press(page: WebDriver, key: str) -> None:
    page.evaluate(f"document.dispatchEvent(new KeyboardEvent('keydown', {{key: '{key}'}})); return 1;")


@needs_chromium
def test_answers_from_the_page_land_once_in_each_device_also_across_kills(tmp_path: Path) -> None:
    states = {name: asked_queries(tmp_path, name, 100 * number) for number, name in enumerate(DEVICES)}
    port = free_port()
    url = f"http://127.0.0.1:{port}/"
    processes: list[subprocess.Popen] = []
    with EmbeddedBroker(tmp_path / "broker") as broker:
        try:
            processes.append(desk(broker, tmp_path, port))
            wait_for(lambda: page_up(url + "label"), 60, "the labelling page (its desk subscribed before it)")
            devices = {name: device(broker, tmp_path, name) for name in DEVICES}
            processes.extend(devices.values())
            wait_for(lambda: open_count(url) == len(DEVICES) * QUERIES, 60, "every device's queries in the queue")
            expected: dict[str, dict[int, int]] = {name: {} for name in DEVICES}
            with headless_chromium(tmp_path / "chromium") as page:
                page.open(url + f"label#token={TOKEN}")
                slipped = answer_on_page(page, 8, by_key=True)  # a slip, undone before the desk sends it
                press(page, "Backspace")
                wait_for(lambda: page.evaluate("return document.body.dataset.query") == "/".join(slipped), 30, "undo")
                for label, by_key in ((3, False), (4, True)):
                    device_id, query_id = answer_on_page(page, label, by_key)
                    expected[device_id][index_of(states[device_id], query_id)] = label
                wait_for(lambda: all(labelled(states[n]) == expected[n] for n in DEVICES), 30, "the answers stored")
                page.screenshot(ARTIFACTS / "labelling-page.png")

                # The desk killed after storing an answer, before its device's receipt (the device is held stopped).
                device_id, _ = shown(page)
                devices[device_id].send_signal(signal.SIGSTOP)
                _, query_id = answer_on_page(page, 7, by_key=False)
                expected[device_id][index_of(states[device_id], query_id)] = 7
                processes[0].kill()
                processes[0].wait(timeout=10)
                devices[device_id].send_signal(signal.SIGCONT)
                processes[0] = desk(broker, tmp_path, port)
                wait_for(lambda: open_count(url) == 1, 60, "the desk back")
                wait_for(
                    lambda: labelled(states[device_id]) == expected[device_id],
                    30,
                    "the answer stored after a desk kill",
                )

                # A device killed after its answer reached it, before it stored it (held stopped, then killed).
                page.open(url + f"label#token={TOKEN}")
                device_id, _ = shown(page)
                devices[device_id].send_signal(signal.SIGSTOP)
                _, query_id = answer_on_page(page, 1, by_key=True)
                expected[device_id][index_of(states[device_id], query_id)] = 1
                wait_for(lambda: held(tmp_path) == 0, 30, "the answer's undo window over")
                time.sleep(0.5)  # the desk sends it, the broker into the stopped device's socket
                devices[device_id].kill()
                devices[device_id].wait(timeout=10)
                assert labelled(states[device_id]) != expected[device_id], "the killed device had not stored it"
                processes.append(device(broker, tmp_path, device_id))
                wait_for(
                    lambda: labelled(states[device_id]) == expected[device_id],
                    30,
                    "the answer stored after a device kill",
                )
                wait_for(lambda: undelivered(tmp_path) == 0, 30, "every receipt back at the desk")

                # An answer corrected after its device stored it: from the page's history, one key.
                device_id, query_id = slipped
                given = f'#history button.given[data-query="{device_id}/{query_id}"]'
                page.evaluate(f"document.querySelector('{given}').click(); return 1;")
                wait_for(lambda: not page.evaluate("return document.getElementById('correcting').hidden"), 30, "fix")
                press(page, "6")
                index = index_of(states[device_id], query_id)
                expected[device_id][index] = 5
                wait_for(lambda: labelled(states[device_id]) == expected[device_id], 30, "the correction stored")
                page.screenshot(ARTIFACTS / "labelling-correction.png")
            wait_for(lambda: undelivered(tmp_path) == 0, 30, "every receipt back at the desk")
            for name in DEVICES:
                assert labelled(states[name]) == expected[name]
                stored = QueryStore(states[name] / "labelling" / "answers.sqlite").answers()
                assert len(stored) == QUERIES and {a.road for a in stored} == {"central"}
                assert all(a.answered_by == "anonymous" and a.label != 8 for a in stored), "the slip never arrived"
            record = LabelledRecord.load(states[device_id] / "labels.npz", IMAGES)
            kinds = dict(zip(record.indices.tolist(), record.sources.tolist()))
            assert kinds[index] == LABEL_SOURCES.index("correction") and len(record.indices) == QUERIES
        finally:
            for process in processes:
                if process.poll() is None:
                    process.send_signal(signal.SIGCONT)
                    process.kill()
                    process.wait(timeout=30)
