# A Pi Zero 2 W device with serving on: the per-image cost of a prediction and the peak RSS of rounds, against off.
"""Prints one JSON object. The model: EfficientNet-Lite0 at 96 px, head-only (`trainable = "head"`), 5 classes, as
the camera fleet's Pi Zero 2 W devices run it (random weights: cost does not depend on their values). The pool:
`--images` random-scene JPEGs.

`prediction`: in this process, with the profile's compute (onnxruntime, 2 threads, 4 images a backbone pass, 10 MC
passes): the feature cache is filled once (the field scan does that for every new image), then `PoolPredictions`
predicts the pool from the cached rows (the tail's 10 passes alone, the log written, the ledger noted): ms per
image, against the same predictions through the backbone (no cache) in the same run.

`rounds`: the real agent process (`edge-agent run --pool-dir --profile raspberry-pi-zero-2w.toml`) against a real
mosquitto, played a coordinator's round 1 (model, bundle, announcement; a person answers its 20 queries through
labels.csv) and, once the pool is predicted (serving on), round 2. The agent's overall peak RSS (its status:
/proc VmHWM per phase), the highest of its VmRSS sampled every 5 ms from outside (the agent's phases reset VmHWM,
so background work just before a phase shows only there) and its per-round footprint lines, serving on
(the latest model serves) against serving off (`PoolPredictions.tick` replaced by a no-op in the benchmark's
launcher, which starts both runs the same way). The profile's budget: 200 MB.

Usage: python benchmarks/serving_footprint.py [--images 500] [--skip-rounds] [--out DIR]
"""

from __future__ import annotations

import argparse
import io
import json
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from agent_footprint import footprint_lines, idle_after  # noqa: E402

from coordinator.fleet.broker import EmbeddedBroker  # noqa: E402
from edge_agent.data.image_files import InputSpec  # noqa: E402
from edge_agent.data.predictions_log import PREDICTIONS_FOLDER, PredictionLog  # noqa: E402
from edge_agent.field.folder_oracle import QueryBook  # noqa: E402
from edge_agent.field.folder_pool import folder_pool_of, open_folder_data  # noqa: E402
from edge_agent.field.predicting import PoolPredictions  # noqa: E402
from edge_agent.learning.bundle import Bundle, load_bundle  # noqa: E402
from edge_agent.learning.learner import bundle_scorer  # noqa: E402
from edge_agent.learning.models import build_model, get_weights  # noqa: E402
from edge_agent.loop.agent_settings import AgentSettings  # noqa: E402
from edge_agent.loop.profile import load_profile  # noqa: E402
from export.bundle_writer import ensure_bundle_files  # noqa: E402
from protocol import messages, topics, wire  # noqa: E402
from protocol.model_spec import ModelSpec, load_model_spec  # noqa: E402
from protocol.mqtt import BrokerAddress, MqttSession  # noqa: E402
from protocol.tensors import Weights  # noqa: E402

FLEET, DEVICE = "serving", "cam-0"
PROFILE = ROOT / "firmware_configs" / "raspberry-pi-zero-2w.toml"
CLASSES = ("empty", "person", "vehicle", "animal", "package")
SPEC_TOML = (
    '[model]\narchitecture = "efficientnet-lite0"\ntrainable = "head"\n\n[input]\nchannels = 3\nheight = 96\n'
    'width = 96\nmean = [0.5, 0.5, 0.5]\nstd = [0.5, 0.5, 0.5]\n\n[classes]\nnames = ["' + '", "'.join(CLASSES) + '"]\n'
)
LAUNCHER = (  # both runs start the same way, so they differ only in the predictions
    "import sys; import edge_agent.field.predicting as p; {off}from edge_agent.cli import main; "
    "sys.exit(main(sys.argv[1:]))"
)
NO_PREDICTIONS = "p.PoolPredictions.tick = lambda *arguments: None; "
RECIPE = messages.Recipe(labels_per_acquisition=20, epochs=5, batch_size=32, mc_passes=10, sampler="margin")


def write_pool(folder: Path, count: int, seed: int = 0) -> None:
    """`count` random 128 px scenes (smooth colour fields with noise) as JPEGs dated a minute ago."""
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True)
    for number in range(count):
        base = rng.integers(0, 256, (4, 4, 3), dtype=np.uint8)
        scene = np.asarray(Image.fromarray(base).resize((128, 128), Image.Resampling.BILINEAR), dtype=np.int16)
        noisy = np.clip(scene + rng.integers(-20, 21, scene.shape), 0, 255).astype(np.uint8)
        buffer = io.BytesIO()
        Image.fromarray(noisy).save(buffer, format="JPEG", quality=90)
        (folder / f"scene-{number:05d}.jpg").write_bytes(buffer.getvalue())


def pi_zero_settings() -> AgentSettings:
    """The Pi Zero 2 W profile's compute as a device's settings."""
    profile = load_profile(PROFILE)
    return AgentSettings(
        FLEET,
        DEVICE,
        backend=profile.backend,
        trainer=profile.trainer,
        inference_batch=profile.inference_batch,
        inference_threads=profile.threads,
        mc_passes_cap=profile.mc_passes_cap,
    )


class Serving:
    """The serving version the in-process measurement predicts with."""

    def __init__(self, bundle: Bundle) -> None:
        self.version, self.model_hash, self.bundle = 0, bundle.manifest.weights_hash, bundle


def prediction_cost(work: Path, pool: Path, bundle: Bundle, spec: ModelSpec) -> dict[str, Any]:
    """Per-image ms of predictions from cached rows (after the scan's fill), and through the backbone."""
    settings = pi_zero_settings()
    images = InputSpec(spec.channels, spec.height, spec.width)
    data = open_folder_data(work / "state", pool, 10**6, images, 0.0, num_classes=spec.num_classes)
    predictions = PoolPredictions(
        data,
        folder_pool_of(data),
        settings,
        PredictionLog(work / "state" / PREDICTIONS_FOLDER, 16 << 20),
        tuple(spec.class_names),
    )
    serving = Serving(bundle)
    scoring = predictions.scorer(serving)
    assert scoring.prefix is not None, "a head-only spec's prefix is frozen"
    started = time.perf_counter()
    scoring.prefix.fill(data.samples(np.arange(data.num_samples)))
    fill = time.perf_counter() - started
    started, predicted = time.perf_counter(), 0
    while (batch := predictions.tick(serving, messages.Recipe().mc_passes)) is not None:
        predicted += len(batch)
    cached = time.perf_counter() - started
    uncached_images = min(100, data.num_samples)
    scorer = bundle_scorer(settings.compute, bundle, None)
    started = time.perf_counter()
    scorer.probabilities(data.images(np.arange(uncached_images)), settings.mc_passes_cap or 10, 0)
    uncached = time.perf_counter() - started
    return {
        "images": predicted,
        "passes": settings.mc_passes_cap,
        "cached_ms_per_image": round(1000 * cached / predicted, 3),
        "uncached_ms_per_image": round(1000 * uncached / uncached_images, 3),
        "feature_fill_ms_per_image": round(1000 * fill / data.num_samples, 3),
        "log_bytes_per_prediction": round(
            sum(path.stat().st_size for path in predictions.log.segments()) / max(predicted, 1), 1
        ),
    }


class Coordinator:
    """Plays the coordinator: the retained model, bundle and announcements; hears the device's status."""

    def __init__(self, address: BrokerAddress, weights: Weights, spec: ModelSpec, bundle: Bundle) -> None:
        self.session = MqttSession(address, client_id="serving-coordinator", session_expiry=0)
        self.session.connect(timeout=10)
        self.session.subscribe(topics.STATUS.filter(fleet=FLEET))
        self.model_hash = bundle.manifest.weights_hash
        model = wire.encode(messages.ModelMessage(self.model_hash, spec, weights))
        self.session.publish(topics.MODEL.build(fleet=FLEET, hash=self.model_hash), model, retain=True, wait=30)
        files = {path.name: path.read_bytes() for path in bundle.path.iterdir() if path.is_file()}
        message = wire.encode(messages.BundleMessage(self.model_hash, files))
        self.session.publish(topics.BUNDLE.build(fleet=FLEET, hash=self.model_hash), message, retain=True, wait=30)

    def announce(self, round_id: int) -> None:
        """Retains round `round_id`'s announcement (the device is a participant)."""
        announcement = messages.RoundAnnouncement("serving", round_id, self.model_hash, RECIPE, time.time() + 3600)
        self.session.publish(topics.ROUND.build(fleet=FLEET), wire.encode(announcement), retain=True, wait=10)

    def idle_after(self, round_id: int, timeout: float) -> messages.Status:
        """The device's status once it reports round `round_id` done."""
        return idle_after(self.session, round_id, timeout)

    def clear(self) -> None:
        """Removes the retained announcement (the next agent starts from nothing)."""
        self.session.publish(topics.ROUND.build(fleet=FLEET), b"", retain=True, wait=10)
        self.session.close()


def answer_queries(book: QueryBook, stop: threading.Event) -> None:
    """A person: answers every pending query with the first class until stopped."""
    while not stop.wait(0.3):
        for query in book.pending():
            book.record_answer(query.name, 0)


class RssSampler(threading.Thread):
    """The agent process's resident set sampled from /proc every 5 ms: its highest value. The agent's own peaks
    reset at each phase's start, so the background work just before a phase (the scan's features, the predictions)
    is only in this sampled peak."""

    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        self.path, self.peak_kb, self.stopped = Path(f"/proc/{pid}/status"), 0, threading.Event()

    def run(self) -> None:
        """Samples until stopped or the process is gone."""
        while not self.stopped.wait(0.005):
            try:
                lines = self.path.read_text().splitlines()
            except OSError:
                return
            rss = [int(line.split()[1]) for line in lines if line.startswith("VmRSS:")]
            self.peak_kb = max([self.peak_kb, *rss])


def logged_predictions(state: Path) -> int:
    """Lines in the agent's predictions log."""
    segments = PredictionLog(state / PREDICTIONS_FOLDER, 1).segments()
    return sum(path.read_bytes().count(b"\n") for path in segments)


def rounds(
    work: Path, pool: Path, broker: EmbeddedBroker, coordinator_parts: tuple, serving: bool, images: int
) -> dict:
    """Two rounds of the real agent process, serving on or off; its peaks."""
    name = "on" if serving else "off"  # a device id of its own: no persistent session carries over
    state, log_file, device = work / f"state-{name}", work / f"agent-{name}.log", f"cam-{name}"
    command = [
        *(sys.executable, "-c", LAUNCHER.format(off="" if serving else NO_PREDICTIONS)),
        *("run", "--broker", broker.address.url, "--fleet", FLEET, "--device-id", device, "--pool-dir", str(pool)),
        *("--state-dir", str(state), "--profile", str(PROFILE), "--model-spec", str(work / "spec.toml")),
        *("--settle-seconds", "0", "--scan-interval", "0.5", "--answer-wait", "300", "--log-level", "info"),
    ]
    coordinator = Coordinator(broker.address, *coordinator_parts)
    stop = threading.Event()
    person = threading.Thread(target=answer_queries, args=(QueryBook(state / "labelling", CLASSES), stop), daemon=True)
    with open(log_file, "wb") as log:
        agent = subprocess.Popen(command, stdout=log, stderr=log)
    sampler = RssSampler(agent.pid)
    sampler.start()
    started = time.monotonic()
    try:
        person.start()
        coordinator.announce(1)
        coordinator.idle_after(1, 1200)
        deadline = time.monotonic() + 600
        while serving and logged_predictions(state) < images and time.monotonic() < deadline:
            time.sleep(0.5)
        predicted = logged_predictions(state)
        coordinator.announce(2)
        final = coordinator.idle_after(2, 1200)
    finally:
        stop.set()
        sampler.stopped.set()
        agent.terminate()
        agent.wait(timeout=60)
        coordinator.clear()
    return {
        "serving": serving,
        "predicted": predicted,
        "overall_peak_mb": final.peak_rss_mb,
        "sampled_peak_mb": round(sampler.peak_kb / 1024, 1),
        "rounds": footprint_lines(log_file),
        "seconds": round(time.monotonic() - started, 1),
    }


def main() -> None:
    """Measures and prints the JSON."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=int, default=500)
    parser.add_argument("--skip-rounds", action="store_true", help="only the per-image cost")
    parser.add_argument("--out", type=Path, help="keep the work folder (agent logs, state folders) here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        work = Path(folder) if args.out is None else args.out
        work.mkdir(parents=True, exist_ok=True)
        (work / "spec.toml").write_text(SPEC_TOML)
        spec = load_model_spec(work / "spec.toml").spec
        weights = get_weights(build_model(spec, seed=0))
        ensure_bundle_files(weights, work / "bundle", spec)
        bundle = load_bundle(work / "bundle")
        write_pool(work / "pool", args.images)
        result: dict[str, Any] = {"profile": PROFILE.name, "model": "efficientnet-lite0 96 px head-only, 5 classes"}
        result["prediction"] = prediction_cost(work / "cost", work / "pool", bundle, spec)
        print(json.dumps(result["prediction"]), file=sys.stderr, flush=True)
        if not args.skip_rounds:
            with EmbeddedBroker(work / "broker") as broker:
                parts = (weights, spec, bundle)
                result["rounds"] = [rounds(work, work / "pool", broker, parts, on, args.images) for on in (False, True)]
            result["budget_mb"] = load_profile(PROFILE).memory_budget_mb
        print(json.dumps(result))


if __name__ == "__main__":
    main()
