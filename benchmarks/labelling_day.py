# A labeller's day: a scripted person in headless chromium labels a fleet's queries one image at a time and in grids.
"""Usage: python benchmarks/labelling_day.py [--devices 20] [--queries 400] [--right 0.8] [--screenshots DIR]

For each mode (one image at a time, then grids of one guessed class), a fresh fleet: a real mosquitto on a free
port, the coordinator's labelling desk and dashboard (this process), and `devices` simulated devices, each a real
camera folder of camera-like JPEGs with the device's own store, folder oracle and central labelling link on its own
MQTT session (the parts `edge-agent run --labelling central` runs; a thread does the agent loop's tick), all in one
process of their own at nice 10 (on a fleet they are other machines). Each device asks for all of its images; the
model's guess is right for a seeded `right` share of them. Both modes run `--runs` times, interleaved, since the
machine's other load moves.

A scripted person (benchmarks/labelling_person.js, run inside the real page in headless chromium) knows each image's
class and acts only through the page: one image at a time it presses Enter when the guess is right and the class's
key when not; in grid mode it marks the thumbnails whose class is not the grid's, accepts the rest with Enter and
answers the exceptions one by one. On purpose it slips (a wrong key undone at once with Backspace, while the answer is
still held) and makes mistakes it corrects later from its history once the device holds the wrong label (a
correction message to the device). Each action that asks the server for the next view is a timed click (from the key
to the next view on screen); marking a thumbnail is a click that asks nothing. Answers per minute are the page's
busy time only: the scripted person has no thinking time, so these are the system's rates, and clicks per answer is
what a person's own time scales with.

After each mode every device's labelled store (labels.npz) and query store must hold exactly the person's final
answers: every query once, with its true class, corrected ones tagged `correction`. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path

import numpy as np
from PIL import Image

from bench.browser import WebDriver, headless_chromium, wait_until
from bench.camera_scenes import render_scene
from coordinator.dashboard.labelling_api import GRID_SIZE
from coordinator.dashboard.server import Dashboard, ListenAddress
from coordinator.fleet.broker import EmbeddedBroker
from coordinator.labelling.desk import LabellingDesk
from coordinator.labelling.queue import LabelQueue
from coordinator.labelling.queue_records import UndoWindow
from edge_agent.data.fashion_mnist import load_fashion_mnist
from edge_agent.data.labelled_record import LABEL_SOURCES, LabelledRecord
from edge_agent.data.oracle import Guess
from edge_agent.field.central import CentralLabelling
from edge_agent.field.folder_oracle import FolderOracle, QueryBook
from edge_agent.field.folder_pool import open_folder_data
from protocol.model_spec import CLASS_NAMES
from protocol.mqtt import BrokerAddress, MqttSession, parse_broker_url

FLEET = "day"
TOKEN = "labelling-day-token"
PERSON = "ana"
PERSON_SCRIPT = Path(__file__).with_name("labelling_person.js")
SINGLE_STEPS = 50  # answers per call into the page (between calls: a screenshot at most)
MODES = ("single", "grid")
TICK_SECONDS = 0.5  # an agent's loop turn, which moves stored answers into the labelled store
SHOT_PAGE = 3  # the docs' grid is a page after the first two (the history beside it filled)


@dataclass
class SimulatedDevice:
    """One device's labelling parts over its own session: its store, folder oracle and central link."""

    name: str
    oracle: FolderOracle
    central: CentralLabelling
    session: MqttSession
    truth: dict[int, int]  # pool index -> true class

    def close(self) -> None:
        """Stops the link and closes the session."""
        self.central.close()
        self.session.close()


def guess_of(truth: int, right: bool, rng: np.random.Generator) -> Guess:
    """The model's guess of an image: its class when right, another one otherwise."""
    label = truth if right else int((truth + rng.integers(1, len(CLASS_NAMES))) % len(CLASS_NAMES))
    return Guess(label, float(rng.uniform(0.4, 0.95)), float(rng.uniform(0.1, 0.9)), float(rng.random()))


def simulated_device(
    root: Path, name: str, items: np.ndarray, labels: np.ndarray, right: float, broker: BrokerAddress, seed: int
) -> SimulatedDevice:
    """A device whose camera folder holds these items as 224 px scenes, each asked for with the model's guess."""
    rng = np.random.default_rng(seed)
    camera = root / name / "camera"
    camera.mkdir(parents=True)
    stamp = time.time() - 60
    for number, item in enumerate(items):
        path = camera / f"{number:03d}.jpg"
        path.write_bytes(render_scene(item, 224, rng))
        os.utime(path, (stamp, stamp))
    data = open_folder_data(root / name / "state", camera, pool_cap=len(items), settle_seconds=0)
    oracle = FolderOracle(QueryBook(root / name / "state" / "labelling"), data, wait_seconds=0)
    central = CentralLabelling(FLEET, name, oracle, None, resend_seconds=5.0)
    indices = data.pool_indices()
    truth = {int(index): int(labels[int(Path(oracle.pool.item(int(index)).path).stem)]) for index in indices}
    oracle.note_guesses(indices, [guess_of(truth[int(i)], bool(rng.random() < right), rng) for i in indices])
    oracle.start_round(1)
    oracle.ask(indices)
    session = MqttSession(broker, client_id=name)
    central.open(session)
    session.connect()
    return SimulatedDevice(name, oracle, central, session, truth)


@contextmanager
def ticking(devices: list[SimulatedDevice]) -> Iterator[None]:
    """The agents' loops: each device's link moves stored answers and corrections into its labelled store."""
    stop = threading.Event()

    def loop() -> None:
        while not stop.wait(TICK_SECONDS):
            for device in devices:
                device.central.tick()

    thread = threading.Thread(target=loop, name="device-ticks", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(timeout=30)


def store_check(device: SimulatedDevice) -> dict[str, int]:
    """How a device's labelled store on disk and its query store compare with the person's final answers (each
    query once, with its true class; the corrected ones tagged `correction`)."""
    data = device.oracle.data
    fixed = device.oracle.book.store.corrected()
    corrected = {query.index for query in device.oracle.book.queries() if query.query_id in fixed}
    record = LabelledRecord.load(data.state_dir / "labels.npz", data.num_samples)
    held = dict(zip(record.indices.tolist(), record.labels.tolist()))
    sources = dict(zip(record.indices.tolist(), record.sources.tolist()))
    book = device.oracle.book
    current = book.store.labels()
    by_index = {query.index: current.get(query.query_id) for query in book.queries()}
    return {
        "lost": sum(index not in held for index in device.truth),
        "doubled": len(record.indices) - len(set(record.indices.tolist())),
        "stale": sum(held.get(index, label) != label for index, label in device.truth.items()),
        "extra": len(set(held) - set(device.truth)),
        "book_differs": sum(by_index.get(index) != label for index, label in device.truth.items()),
        "untagged_corrections": sum(sources.get(index) != LABEL_SOURCES.index("correction") for index in corrected),
        "corrected": len(corrected),
    }


def device_fleet(work: Path, broker_url: str, args: argparse.Namespace, pipe: Connection) -> None:
    """The simulated devices' own process (as a fleet's devices are other machines than the desk's): builds them,
    sends the queries' true classes, runs the agents' ticks until the parent asks for the check, then sends each
    device's store check. It runs at nice 10: on a real fleet the devices' work (storing a grid's answers at once)
    takes no CPU from the desk's machine or the person's browser."""
    os.nice(10)
    fashion = load_fashion_mnist()
    per_device = args.queries // args.devices
    fleet = [
        simulated_device(
            work,
            f"cam-{number:02d}",
            fashion.test_images[number * per_device : (number + 1) * per_device],
            fashion.test_labels[number * per_device : (number + 1) * per_device],
            args.right,
            parse_broker_url(broker_url),
            args.seed + number,
        )
        for number in range(args.devices)
    ]
    try:
        pipe.send({f"{d.name}/{q.query_id}": d.truth[q.index] for d in fleet for q in d.oracle.book.queries()})
        with ticking(fleet):
            pipe.recv()
            time.sleep(2 * TICK_SECONDS)  # every device's tick after the last receipt
        pipe.send({device.name: store_check(device) for device in fleet})
    finally:
        for device in fleet:
            device.close()


def percentile(values: list[float], share: float) -> float:
    """The nearest-rank percentile of milliseconds, rounded."""
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(share * len(ordered)))], 1)


def palette_png(path: Path) -> None:
    """A screenshot rewritten with a palette of its 256 most used colours (the camera scenes' noise makes a full-colour
    one near 1 MB; the page itself keeps its colours), the empty page below its content cut off."""
    with Image.open(path) as shot:
        pixels = np.asarray(shot.convert("RGB"))
    busy = np.flatnonzero((pixels != pixels[-1:, :1]).any(axis=(1, 2)))
    height = min(len(pixels), int(busy[-1]) + 17) if busy.size else len(pixels)
    reduced = Image.fromarray(pixels[:height]).quantize(256, Image.Quantize.MEDIANCUT, dither=Image.Dither.NONE)
    reduced.save(path, optimize=True)


def person_runs(page: WebDriver, mode: str, screenshots: Path | None) -> dict:
    """The scripted person's whole labelling in one mode (and the screenshots the docs show); its report."""
    if mode == "single":
        if screenshots is not None:
            palette_png(page.screenshot(screenshots / "labelling-page.png"))
        first_undo = True
        while True:
            step = page.evaluate(
                f"return labellingPerson.single({SINGLE_STEPS}, {json.dumps(first_undo)})", timeout=600
            )
            if step["paused"] and screenshots is not None:
                palette_png(page.screenshot(screenshots / "labelling-undo.png"))
                first_undo = False
            if not step["more"]:
                break
    else:
        page.evaluate("return labellingPerson.toGrid()", timeout=60)
        pages = 0
        while page.evaluate("return labellingPerson.markGrid()"):
            marked = page.evaluate("return document.querySelectorAll('.thumb.exception').length")
            pages += 1
            if screenshots is not None and pages >= SHOT_PAGE and marked >= 2:
                palette_png(page.screenshot(screenshots / "labelling-grid.png"))
                screenshots = None
            if not page.evaluate("return labellingPerson.acceptGrid()", timeout=600):
                break
    left = page.evaluate("return labellingPerson.finish(90000)", timeout=120)
    report = page.evaluate("return labellingPerson.report()")
    if left:
        raise RuntimeError(f"{left} of the person's mistakes were never delivered to correct: {report['pending']}")
    return report


def labelling_mode(work: Path, mode: str, args: argparse.Namespace, screenshots: Path | None) -> dict:
    """One mode over a fresh fleet: the person's figures and the stores' check."""
    spawn = multiprocessing.get_context("spawn")
    with EmbeddedBroker(work / "broker") as broker:
        queue = LabelQueue(work / "run", tuple(CLASS_NAMES), undo=UndoWindow(args.undo_seconds, args.undo_answers))
        desk_session = MqttSession(broker.address, client_id="labelling-day", manual_ack=True)
        desk_session.connect()
        desk = LabellingDesk(FLEET, desk_session, queue).start()
        pipe, their_end = spawn.Pipe()
        fleet = spawn.Process(target=device_fleet, args=(work, broker.address.url, args, their_end), daemon=True)
        fleet.start()
        try:
            if not pipe.poll(300):
                raise RuntimeError("the simulated devices did not start within 300 s")
            truth: dict[str, int] = pipe.recv()
            wait_until(lambda: len(queue.all()) == len(truth), 120, "every device's queries in the queue")
            with (
                Dashboard(ListenAddress("127.0.0.1", 0), work / "run", None, TOKEN, desk) as dashboard,
                headless_chromium(work / "chromium", ["--window-size=1100,1150"]) as page,
            ):
                page.open(dashboard.url + f"label#token={TOKEN}")
                wait_until(lambda: page.evaluate("return document.body.dataset.shown"), 30, "the page")
                page.evaluate(f"localStorage.setItem('edge-fal-person', '{PERSON}'); location.reload(); return 1;")
                wait_until(lambda: page.evaluate("return document.body.dataset.shown"), 30, "the page again")
                page.evaluate(PERSON_SCRIPT.read_text() + "\nreturn labellingPerson.start(arguments[0]);", [truth])
                report = person_runs(page, mode, screenshots)
            wait_until(
                lambda: (
                    not queue.status(time.time()).held
                    and not queue.undelivered()
                    and not queue.undelivered_corrections()
                ),
                args.undo_seconds + 60,
                "every answer and correction receipted by its device",
            )
            corrections = queue.status(time.time()).corrections
            queue_differs = sum(query.label != truth[f"{query.device}/{query.query_id}"] for query in queue.all())
            pipe.send("check")
            if not pipe.poll(120):
                raise RuntimeError("the simulated devices did not check their stores within 120 s")
            checks: dict[str, dict[str, int]] = pipe.recv()
        finally:
            fleet.join(timeout=60)
            desk.stop()
            desk_session.close()
            queue.close()
    totals = {kind: sum(check[kind] for check in checks.values()) for kind in next(iter(checks.values()))}
    corrected = totals.pop("corrected")
    minutes = report["busy_ms"] / 60000
    latencies = report["latencies"]
    return {
        "answers": report["answered"],
        "answers_per_minute": round(report["answered"] / minutes, 1),
        "busy_seconds": round(report["busy_ms"] / 1000, 2),
        "clicks": report["clicks"],
        "clicks_per_answer": round(report["clicks"] / report["answered"], 3),
        "thumbnails_marked": report["marks"],
        "grid_pages": report["pages"],
        "exceptions_answered_one_by_one": report["exceptions"],
        "per_click_ms": {
            "timed_clicks": len(latencies),
            "p50": percentile(latencies, 0.5),
            "p95": percentile(latencies, 0.95),
            "max": percentile(latencies, 1.0),
            "mean": round(statistics.fmean(latencies), 1),
        },
        "per_click_ms_by_kind": {
            kind: {"clicks": len(times), "p50": percentile(times, 0.5), "p95": percentile(times, 0.95)}
            for kind, times in sorted(report["kinds"].items())
        },
        "undos_before_delivery": report["undos"],
        "corrections_after_delivery": report["corrections"],
        "queue_corrections": corrections,
        "device_labels_corrected": corrected,
        "queue_labels_differing_from_final_answers": queue_differs,
        "device_stores": totals,
        "stores_match_final_answers": not any(totals.values()) and queue_differs == 0,
    }


def median_run(results: list[dict]) -> dict:
    """The run of the median rate (the middle one of an odd count, the lower middle of an even one)."""
    return sorted(results, key=lambda result: result["answers_per_minute"])[(len(results) - 1) // 2]


def main() -> None:
    """Runs both modes `--runs` times, interleaved (the machine's load moves), and prints one JSON object: each run's
    rates, each mode's median run in full, and the median and lowest paired ratio."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--devices", type=int, default=20)
    parser.add_argument("--queries", type=int, default=400, help="in all, shared evenly among the devices")
    parser.add_argument("--right", type=float, default=0.8, help="the share of queries whose guess is right")
    parser.add_argument("--undo-seconds", type=float, default=30.0, help="the desk's undo window (its default)")
    parser.add_argument("--undo-answers", type=int, default=10, help="answers held per person (the default)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--screenshots", type=Path, help="write the docs' page, grid and undo screenshots here")
    parser.add_argument("--work", type=Path, help="keep the fleets' folders here (default: a temporary folder)")
    parser.add_argument("--runs", type=int, default=3, help="pairs of runs, one image then grids each time")
    args = parser.parse_args()
    runs: list[dict[str, dict]] = []
    with tempfile.TemporaryDirectory() as folder:
        work = args.work or Path(folder)
        for number in range(args.runs):
            shots = args.screenshots if number == 0 else None
            runs.append({mode: labelling_mode(work / f"{mode}-{number}", mode, args, shots) for mode in MODES})
    ratios = [run["grid"]["answers_per_minute"] / run["single"]["answers_per_minute"] for run in runs]
    result = {
        "benchmark": "labelling_day",
        "cpus": os.cpu_count(),
        "devices": args.devices,
        "queries": args.queries,
        "model_right": args.right,
        "grid_size": GRID_SIZE,
        "undo_window": {"seconds": args.undo_seconds, "answers": args.undo_answers},
        "runs": [
            {f"{mode}_answers_per_minute": run[mode]["answers_per_minute"] for mode in MODES}
            | {"grid_over_single_rate": round(ratio, 2)}
            for run, ratio in zip(runs, ratios)
        ],
        **{mode: median_run([run[mode] for run in runs]) for mode in MODES},
        "grid_over_single_rate": round(statistics.median(ratios), 2),
        "grid_over_single_rate_lowest": round(min(ratios), 2),
        "grid_over_single_clicks_per_answer": round(
            statistics.median(run["grid"]["clicks_per_answer"] / run["single"]["clicks_per_answer"] for run in runs), 3
        ),
        "stores_match_final_answers": all(run[mode]["stores_match_final_answers"] for run in runs for mode in MODES),
    }
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
