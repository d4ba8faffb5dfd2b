# One person labelling a fleet of 20 devices: the central page's HTTP API against visiting each device's own page.
"""Usage: python benchmarks/labelling_queue.py [--devices 20] [--answers 400] [--side 224]

A real broker, the coordinator's labelling desk and dashboard (in this process), and `devices` MQTT sessions that
publish their queries (camera-like JPEGs of `side` px, Fashion-MNIST items scaled up in colour) on their queries
topics through the desk, answer its receipts and store nothing else. A scripted person then answers `answers`
queries through the same endpoints the page's script calls: each click is one POST /api/label/answer (the answer
stored, then sent to its device at QoS 1; the reply names the next query) and one GET of the next query's image;
the click-to-next-image time is measured around both. The devices' receipts flow while the person clicks.

The baseline is the same person on each device's own label page (edge-agent run --label-ui): for each device, a page
load, then per answer one POST (303) and the page reloaded with its remaining queries' images. Both figures are the
system's time only: a person's own seconds per label come on top of either, and the device pages add 19 page
switches (and, off site, an SSH tunnel each). Prints JSON; the target is p95 under 100 ms on a 2-core machine.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import tempfile
import time
import urllib.request
from pathlib import Path

import numpy as np
from PIL import Image

from coordinator.dashboard.server import Dashboard, ListenAddress
from coordinator.fleet.broker import EmbeddedBroker
from coordinator.labelling.desk import LabellingDesk
from coordinator.labelling.queue import LabelQueue
from edge_agent.data.fashion_mnist import load_fashion_mnist
from edge_agent.field.central import query_image
from edge_agent.field.folder_oracle import FolderOracle, QueryBook
from edge_agent.field.folder_pool import open_folder_data
from edge_agent.field.label_ui import LabelServer
from protocol import label_messages, topics, wire
from protocol.model_spec import CLASS_NAMES
from protocol.mqtt import MqttSession

FLEET = "bench"
TOKEN = "labelling-benchmark-token"


def camera_jpeg(item: np.ndarray, side: int) -> bytes:
    """A Fashion-MNIST item as a camera would write it: colour, `side` px, JPEG quality 90."""
    buffer = io.BytesIO()
    Image.fromarray(item).resize((side, side), Image.Resampling.BILINEAR).convert("RGB").save(
        buffer, "JPEG", quality=90
    )
    return buffer.getvalue()


def request(url: str, body: dict | None = None, token: bool = True) -> bytes:
    """One HTTP request (a POST with a JSON body), its reply's bytes."""
    headers = {"Authorization": f"Bearer {TOKEN}"} if token else {}
    data = None
    if body is not None:
        headers["Content-Type"] = "application/json"
        data = json.dumps(body).encode()
    with urllib.request.urlopen(urllib.request.Request(url, data=data, headers=headers), timeout=30) as response:
        return response.read()


def percentile(values: list[float], share: float) -> float:
    """The nearest-rank percentile, in milliseconds."""
    ordered = sorted(values)
    return round(1000 * ordered[min(len(ordered) - 1, int(share * len(ordered)))], 2)


def fill_queue(broker: EmbeddedBroker, images: list[bytes], devices: int) -> list[MqttSession]:
    """Each device's session publishes its share of the queries (its guesses and scores random) on its topic."""
    rng = np.random.default_rng(0)
    sessions = []
    for number in range(devices):
        session = MqttSession(broker.address, client_id=f"cam-{number:02d}")
        session.connect()
        session.subscribe(topics.LABELLING_DOWN.build(fleet=FLEET, device=f"cam-{number:02d}"))
        sessions.append(session)
    for position, image in enumerate(images):
        device = f"cam-{position % devices:02d}"
        probabilities = rng.dirichlet(np.ones(len(CLASS_NAMES)))
        query = label_messages.LabelQuery(
            *(device, f"q{position:05d}", image, "image/jpeg", time.time()),
            *(int(probabilities.argmax()), float(probabilities.max()), float(rng.random()), float(rng.random())),
        )
        sessions[position % devices].publish(topics.LABEL_QUERIES.build(fleet=FLEET, device=device), wire.encode(query))
    return sessions


def receipts(sessions: list[MqttSession]) -> int:
    """Each device stores what comes and sends a receipt for every answer (as CentralLabelling does); how many."""
    sent = 0
    for number, session in enumerate(sessions):
        while (message := session.next_message(timeout=0)) is not None:
            received = wire.decode_any(message.payload, (label_messages.LabelAnswer, label_messages.QueryReceipt))
            if isinstance(received, label_messages.LabelAnswer):
                receipt = label_messages.AnswerReceipt(f"cam-{number:02d}", received.query_id)
                session.publish(
                    topics.LABELLING_UP.build(fleet=FLEET, device=f"cam-{number:02d}"), wire.encode(receipt)
                )
                sent += 1
    return sent


def central(work: Path, images: list[bytes], devices: int, answers: int) -> dict:
    """The central page's click-to-next-image times over `answers` answers."""
    with EmbeddedBroker(work / "broker") as broker:
        queue = LabelQueue(work / "run", tuple(CLASS_NAMES))
        desk_session = MqttSession(broker.address, client_id="labelling-bench", manual_ack=True)
        desk_session.connect()
        desk = LabellingDesk(FLEET, desk_session, queue).start()
        sessions = fill_queue(broker, images, devices)
        deadline = time.monotonic() + 120
        while sum(queue.depth().values()) < len(images) and time.monotonic() < deadline:
            time.sleep(0.1)
        queued = sum(queue.depth().values())
        with Dashboard(ListenAddress("127.0.0.1", 0), work / "run", None, TOKEN, desk) as dashboard:
            url = dashboard.url
            shown = json.loads(request(url + "api/label/next?person=ana"))["query"]
            request(url + shown["image"].lstrip("/"))
            latencies, image_bytes, receipted = [], [], 0
            started = time.perf_counter()
            for _ in range(answers):
                body = {
                    "device": shown["device"],
                    "query_id": shown["query_id"],
                    "label": shown["guess"],
                    "person": "ana",
                }
                clicked = time.perf_counter()
                shown = json.loads(request(url + "api/label/answer", body))["query"]
                image_bytes.append(len(request(url + shown["image"].lstrip("/"))))
                latencies.append(time.perf_counter() - clicked)
                receipted += receipts(sessions)
            elapsed = time.perf_counter() - started
        deadline = time.monotonic() + 30
        while queue.undelivered() and time.monotonic() < deadline:
            receipted += receipts(sessions)
            time.sleep(0.05)
        undelivered = len(queue.undelivered())
        desk.stop()
        for session in (*sessions, desk_session):
            session.close()
    return {
        "queued": queued,
        "answers": answers,
        "click_to_next_image_ms": {
            "p50": percentile(latencies, 0.5),
            "p95": percentile(latencies, 0.95),
            "max": percentile(latencies, 1.0),
            "mean": round(1000 * statistics.fmean(latencies), 2),
        },
        "answers_per_second": round(answers / elapsed, 1),
        "http_requests_per_answer": 2,
        "pages_visited": 1,
        "receipts_from_devices": receipted,
        "answers_not_yet_receipted": undelivered,
        "mean_image_bytes_served": round(statistics.fmean(image_bytes)),
    }


def device_pages(work: Path, images: list[bytes], devices: int, answers: int) -> dict:
    """The same answers on each device's own label page, one device after another."""
    items = load_fashion_mnist().test_images
    servers, per_device = [], answers // devices
    for number in range(devices):
        pool = work / f"cam-{number:02d}" / "camera"
        pool.mkdir(parents=True)
        for index in range(per_device):
            (pool / f"{index:03d}.jpg").write_bytes(images[number * per_device + index])
            stamp = time.time() - 60
            os.utime(pool / f"{index:03d}.jpg", (stamp, stamp))
        data = open_folder_data(work / f"cam-{number:02d}" / "state", pool, pool_cap=1000, settle_seconds=0)
        oracle = FolderOracle(QueryBook(work / f"cam-{number:02d}" / "labelling"), data, wait_seconds=0)
        oracle.ask(np.arange(per_device))
        servers.append(LabelServer(oracle.book).start())
    del items
    latencies, requests = [], 0
    started = time.perf_counter()
    for server in servers:
        page = request(server.url, token=False).decode()
        requests += 1
        for _ in range(per_device):
            name = page.split('name="query" value="', 1)[1].split('"', 1)[0]
            clicked = time.perf_counter()
            form = f"query={name}&label=1".encode()
            urllib.request.urlopen(urllib.request.Request(server.url + "label", data=form), timeout=30).read()
            page = request(server.url, token=False).decode()  # the 303 lands on the page again
            for source in page.split('<img src="')[1:]:
                request(server.url.rstrip("/") + source.split('"', 1)[0], token=False)
                requests += 1
            requests += 2
            latencies.append(time.perf_counter() - clicked)
    elapsed = time.perf_counter() - started
    for server in servers:
        server.stop()
    return {
        "answers": len(latencies),
        "click_to_next_image_ms": {"p50": percentile(latencies, 0.5), "p95": percentile(latencies, 0.95)},
        "answers_per_second": round(len(latencies) / elapsed, 1),
        "http_requests_per_answer": round(requests / len(latencies), 1),
        "pages_visited": devices,
    }


def main() -> None:
    """Runs both and prints one JSON object."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--devices", type=int, default=20)
    parser.add_argument("--answers", type=int, default=400)
    parser.add_argument("--side", type=int, default=224, help="the camera images' side in pixels")
    parser.add_argument("--downscaled-side", type=int, default=112, help="--query-image-side's figure")
    args = parser.parse_args()
    items = load_fashion_mnist().test_images
    images = [camera_jpeg(items[i], args.side) for i in range(args.answers + args.devices)]
    with tempfile.TemporaryDirectory() as folder:
        sample = Path(folder) / "sample.jpg"
        sample.write_bytes(images[0])
        downscaled = len(query_image(sample, args.downscaled_side)[0])
        result = {
            "benchmark": "labelling_queue",
            "cpus": os.cpu_count(),
            "devices": args.devices,
            "query_image_bytes": {
                "as_captured_jpeg_mean": round(statistics.fmean(len(image) for image in images)),
                "side": args.side,
                f"downscaled_png_{args.downscaled_side}": downscaled,
                "query_message_overhead": len(
                    wire.encode(label_messages.LabelQuery("cam-00", "q00000", b"", "image/jpeg", 0.0, 1, 0.5, 0.5, 0.5))
                ),
            },
            "central_page": central(Path(folder) / "central", images, args.devices, args.answers),
            "device_pages": device_pages(Path(folder) / "pages", images, args.devices, args.answers),
        }
    central_rate, page_rate = result["central_page"]["answers_per_second"], result["device_pages"]["answers_per_second"]
    result["central_over_device_pages_rate"] = round(central_rate / page_rate, 2)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
