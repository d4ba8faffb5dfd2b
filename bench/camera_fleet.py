# Camera fleets for the field bench: per-device folders of rendered scenes, their answer keys, a test set, the classes.
from __future__ import annotations

import csv
import hashlib
import io
import json
import os
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from bench.camera_scenes import DEFAULT_CLASSES, SceneClass, SceneSet, pick_items, render_set
from edge_agent.data.image_arrays import DATASET_KEYS, ImageDataset
from edge_agent.field.folder_oracle import LABELS_HEADER, QueryBook, parse_label
from protocol.files import atomic_write_bytes, save_arrays
from protocol.model_spec import CLASS_NAMES

POOL_DIR = "pool"
ANSWERS_FILE = "answers.csv"
CLASSES_FILE = "classes.json"
SERVER_FILE = "server.npz"
SPEC_FILE = "model_spec.toml"
AGE_SECONDS = 3600.0  # written files are dated this long ago, so a field agent takes them at once


@dataclass(frozen=True)
class FleetSettings:
    """A camera fleet: devices, classes, scenes per class on each device, in the server's own labelled set (W0 and
    the selection split) and in the test set, size, seed, and the backbone its model spec names (EfficientNet-Lite0
    with ImageNet weights, head-only; or the from-scratch MobileNet, the baseline)."""

    devices: int = 4
    classes: tuple[SceneClass, ...] = DEFAULT_CLASSES
    per_class: int = 50
    test_per_class: int = 100
    size: int = 96
    seed: int = 0
    server_per_class: int = 40
    backbone: str = "efficientnet-lite0"


def device_dir(out: Path, number: int) -> Path:
    """The folder of device `number` in a fleet folder."""
    return out / f"device-{number:02d}"


def write_pool(folder: Path, scenes: SceneSet, prefix: str) -> list[str]:
    """Writes the scenes as PREFIX-00000.jpg, ... into a flat folder of unlabelled images, dated a second apart in
    that order, the newest an hour ago (a field agent takes them at once, oldest first; a pool of more than 3600
    files no longer has its last ones dated in the future); returns the file names."""
    folder.mkdir(parents=True, exist_ok=True)
    names = [f"{prefix}-{number:05d}.jpg" for number in range(len(scenes.jpegs))]
    start = time.time() - AGE_SECONDS - len(names)
    for number, (name, jpeg) in enumerate(zip(names, scenes.jpegs)):
        atomic_write_bytes(folder / name, jpeg)
        os.utime(folder / name, (start + number, start + number))
    return names


def write_answer_key(path: Path, names: list[str], labels: np.ndarray, classes: tuple[SceneClass, ...]) -> None:
    """`file,label` rows (a pool file's name, its class name): what a person looking at that folder would answer."""
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(LABELS_HEADER)
    writer.writerows((name, classes[int(label)].name) for name, label in zip(names, labels))
    atomic_write_bytes(path, buffer.getvalue().encode())


def read_answer_key(path: Path, class_names: tuple[str, ...]) -> dict[str, int]:
    """A pool file's name -> its class number, from an answer key; ValueError naming the file and line."""
    rows = list(csv.reader(io.StringIO(path.read_text())))
    key = {}
    for number, row in enumerate(rows[1:], start=2):
        if len(row) != 2:
            raise ValueError(f"{path}: line {number} has {len(row)} columns, expected file,label")
        try:
            key[row[0]] = parse_label(row[1], class_names)
        # parse_label's ValueError: a line of the answer key, named
        except ValueError as error:
            raise ValueError(f"{path}: line {number}: {error}") from None
    return key


def answer_queries(book: QueryBook, key: Mapping[str, int]) -> int:
    """The bench's person at a folder oracle: answers each pending query whose source file is in the answer key,
    into the device's query store as its label page would; returns how many were answered."""
    answered = 0
    for query in book.pending():
        if query.source in key:
            book.record_answer(query.name, key[query.source])
            answered += 1
    return answered


def _deal(
    labels: np.ndarray, devices: int, server_per_class: int, rng: np.random.Generator
) -> tuple[np.ndarray, list[np.ndarray]]:
    """Positions into the picked items: the server's (the first server_per_class of every class), then each device's
    (every class's other items split evenly over the devices), each shuffled."""
    by_class = np.argsort(labels, kind="stable").reshape(int(labels.max()) + 1, -1)
    server = rng.permutation(by_class[:, :server_per_class].ravel())
    rest = by_class[:, server_per_class:].reshape(len(by_class), devices, -1)
    return server, [rng.permutation(rest[:, device].ravel()) for device in range(devices)]


def build_fleet(out: Path, settings: FleetSettings, dataset: ImageDataset) -> dict[str, Any]:
    """Writes a fleet folder: device-NN/pool/ (unlabelled JPEGs from the training split), device-NN/answers.csv,
    server.npz (the coordinator's --dataset: its own labelled scenes and the test scenes, uint8 (N, size, size, 3)),
    model_spec.toml (the --model-spec both sides run with) and classes.json; returns a summary."""
    if min(settings.devices, settings.per_class, settings.test_per_class, settings.server_per_class) < 1:
        raise ValueError("a fleet needs at least 1 device, and 1 scene per class on each device, the server and test")
    rng = np.random.default_rng([settings.seed, 0])
    per_class = settings.per_class * settings.devices + settings.server_per_class
    indices, labels = pick_items(dataset.train_labels, settings.classes, per_class, rng)
    server, shares = _deal(labels, settings.devices, settings.server_per_class, rng)
    summary: dict[str, Any] = {"out": str(out), "class_names": [c.name for c in settings.classes], "devices": []}
    for number, positions in enumerate(shares):
        scenes = render_set(
            dataset.train_images[indices[positions]], labels[positions], settings.size, settings.seed, number + 1
        )
        names = write_pool(device_dir(out, number) / POOL_DIR, scenes, f"cam{number:02d}")
        write_answer_key(device_dir(out, number) / ANSWERS_FILE, names, scenes.labels, settings.classes)
        summary["devices"].append({"folder": str(device_dir(out, number)), "images": len(names)})
    own = render_set(dataset.train_images[indices[server]], labels[server], settings.size, settings.seed, 0)
    test_indices, test_labels = pick_items(dataset.test_labels, settings.classes, settings.test_per_class, rng)
    test = render_set(
        dataset.test_images[test_indices], test_labels, settings.size, settings.seed, settings.devices + 1
    )
    arrays = (own.arrays(), own.labels, test.arrays(), test.labels)
    save_arrays(out / SERVER_FILE, dict(zip(DATASET_KEYS, arrays)))
    atomic_write_bytes(out / SPEC_FILE, spec_toml(settings).encode())
    atomic_write_bytes(out / CLASSES_FILE, json.dumps(_classes_record(settings), indent=2).encode())
    return {**summary, "server_images": len(own.labels), "test_images": len(test.labels)}


BACKBONE_SPECS = {
    "efficientnet-lite0": (
        '[model]\narchitecture = "efficientnet-lite0"\npretrained = "imagenet"\ntrainable = "head"\n',
        "std = [0.5, 0.5, 0.5]",
    ),
    "mobilenet": ('[model]\narchitecture = "mobilenet"\nwidth_multiplier = 0.25\n', "std = [0.25, 0.25, 0.25]"),
}
"""The [model] table and input std of each backbone a bench fleet can run: the pretrained edge backbone with a
head-only update, or the from-scratch quarter-width MobileNet (the baseline row)."""


def spec_toml(settings: FleetSettings) -> str:
    """The fleet's model spec: its backbone on RGB scenes of the fleet's size, with the fleet's class names."""
    names = ", ".join(json.dumps(c.name) for c in settings.classes)
    model, std = BACKBONE_SPECS[settings.backbone]
    return (
        f"{model}\n[input]\nchannels = 3\nheight = {settings.size}\nwidth = {settings.size}\n"
        f"mean = [0.5, 0.5, 0.5]\n{std}\n\n[classes]\nnames = [{names}]\n"
    )


def _classes_record(settings: FleetSettings) -> dict[str, Any]:
    """classes.json: the fleet's class names (what a model spec lists), their Fashion-MNIST sources, size, seed."""
    return {
        "class_names": [c.name for c in settings.classes],
        "fashion_mnist_sources": [CLASS_NAMES[c.source] for c in settings.classes],
        "size": settings.size,
        "seed": settings.seed,
        "per_class": settings.per_class,
        "devices": settings.devices,
    }


def camera_agent_command(
    broker_url: str, fleet: str, fleet_dir: Path, number: int, state_dir: Path, profile: Path | None = None
) -> list[str]:
    """The `edge-agent run` of device NN of a fleet folder: its camera folder, the fleet's model spec, a folder
    oracle under its state directory, exit when the run ends; with a device profile when given."""
    return [
        *(sys.executable, "-m", "edge_agent", "run", "--broker", broker_url, "--fleet", fleet),
        *("--device-id", f"cam-{number}", "--pool-dir", str(device_dir(fleet_dir, number) / POOL_DIR)),
        *("--state-dir", str(state_dir), "--model-spec", str(fleet_dir / SPEC_FILE), "--settle-seconds", "0"),
        *("--scan-interval", "0.5", "--answer-wait", "120", "--exit-on-final", "--log-level", "info"),
        *(("--profile", str(profile)) if profile else ()),
    ]


class BenchPeople(threading.Thread):
    """The bench's people: every `period` seconds until stopped, they answer what is asked of them (`answer`)."""

    def __init__(self, period: float = 0.3) -> None:
        super().__init__(daemon=True)
        self.period = period
        self.stopped = threading.Event()
        self.answered = 0

    def answer(self) -> int:
        """Answers what is asked now; how many."""
        raise NotImplementedError

    def run(self) -> None:
        """Answers until stopped."""
        while not self.stopped.wait(self.period):
            self.answered += self.answer()


class PeopleAtTheOracles(BenchPeople):
    """Each device's person answers its pending queries from its answer key, by class name, in its folder oracle."""

    def __init__(self, fleet_dir: Path, states: list[Path], class_names: tuple[str, ...], period: float = 0.3):
        super().__init__(period)
        keys = [read_answer_key(device_dir(fleet_dir, n) / ANSWERS_FILE, class_names) for n in range(len(states))]
        self.books = [(QueryBook(state / "labelling", class_names), key) for state, key in zip(states, keys)]

    def answer(self) -> int:
        """Every device's pending queries its key knows."""
        return sum(answer_queries(book, key) for book, key in self.books)


def scene_key(fleet_dir: Path, devices: int, class_names: tuple[str, ...]) -> dict[str, int]:
    """sha256 (hex) of each pool file's bytes -> its class: how the bench's person knows a scene by sight (a query's
    image is the file as the camera wrote it)."""
    key = {}
    for number in range(devices):
        pool = device_dir(fleet_dir, number) / POOL_DIR
        for name, label in read_answer_key(device_dir(fleet_dir, number) / ANSWERS_FILE, class_names).items():
            key[hashlib.sha256((pool / name).read_bytes()).hexdigest()] = label
    return key


class PeopleAtThePage(BenchPeople):
    """One person at the fleet's labelling page (the coordinator's dashboard at `url`, `/label`): through the page's
    own HTTP API and with the dashboard's token, as the page's script in a browser calls it, they take the next
    query, look at its image, answer its scene's class (or skip an image they do not know), until none is open.
    Each poll also keeps the coordinator's device table (`/api/devices`: the predictions devices published) and
    every device state it showed, and the last refusal it met (for a run that went wrong: a wrong token's 401 would
    otherwise only show as no labels)."""

    def __init__(self, fleet_dir: Path, devices: int, class_names: tuple[str, ...], url: str, token: str):
        super().__init__()
        self.key = scene_key(fleet_dir, devices, class_names)
        self.url, self.token = url.rstrip("/"), token
        self.person = "bench-person"
        self.devices: list[dict[str, Any]] = []
        self.states: set[str] = set()
        self.last_refusal = ""

    def call(self, path: str, body: dict[str, Any] | None = None) -> bytes:
        """One request to the dashboard with the token (a POST with a JSON body); its reply's bytes. urllib's
        errors (refused before the page serves or after the run, an HTTP error status) are OSErrors."""
        headers = {"Authorization": f"Bearer {self.token}"}
        data = None if body is None else json.dumps(body).encode()
        if data is not None:
            headers["Content-Type"] = "application/json"
        request = urllib.request.Request(self.url + path, data=data, headers=headers)
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.read()

    def answer(self) -> int:
        """The open queries, one after another as the page shows them; how many were answered. A refused request
        (the coordinator not yet or no longer serving, a query answered meanwhile: 409) ends this pass."""
        answered = 0
        try:
            self.devices = json.loads(self.call("/api/devices"))["devices"]
            self.states |= {row["state"] for row in self.devices}
            shown = json.loads(self.call(f"/api/label/next?person={self.person}"))["query"]
            while shown is not None and not self.stopped.is_set():
                label = self.key.get(hashlib.sha256(self.call(shown["image"])).hexdigest())
                form = {"device": shown["device"], "query_id": shown["query_id"], "person": self.person}
                path = "/api/label/skip" if label is None else "/api/label/answer"
                shown = json.loads(self.call(path, form if label is None else {**form, "label": label}))["query"]
                answered += 0 if label is None else 1
        # urllib.error.URLError and HTTPError are OSErrors: the page refused or is not there; the next pass asks again
        except OSError as refused:
            self.last_refusal = str(refused)[:200]
        return answered


def stop_site(people: BenchPeople, processes: list[subprocess.Popen]) -> None:
    """Stops the bench's people and kills whatever of the site's processes still runs (a run's last step, also when
    it failed)."""
    people.stopped.set()
    for process in processes:
        if process.poll() is None:
            process.kill()
            process.wait()
