# Federated active learning of a head over frozen EfficientNet-Lite0 features on a 10-class camera fleet, per sampler.
"""A camera fleet (bench.camera_scenes: Fashion-MNIST's ten classes rendered as RGB JPEG scenes), its devices' pools
and a separate test set, embedded once by the zoo's EfficientNet-Lite0 with ImageNet weights (pixels / 255, 1280
pooled features; cached under --work, keyed by the fleet and the spec's hash). Each round every device scores its
pool with the round's global head (the devices' MC-dropout loop, mc_scorer, over cached features), asks the
sampler (SAMPLERS, through Sampler.choose: the cold start draws uniformly until a device holds --labels labels),
trains the head from the global one on every label it holds (head_training.train_classifier, the recipe's SGD,
--epochs 20: head epochs on cached features are cheap, and 5 leave a head on 10-100 labels unfit),
and the coordinator's FedAvg averages the heads by labelled-sample count. In the same run, per round: a
centralised logistic regression (the same train_classifier, from zero, no dropout) on the same pooled labels and
features; per seed, the all-labels ceiling (every pool label pooled).

Reported per sampler (over the seeds; label_efficiency's summary):
  aulc      area under the learning curve: the mean test accuracy over the rounds; each round adds the same
            number of labels, so it is the area under accuracy against labels divided by the label range
  labels_to_random_final   the first label count at which the sampler's mean curve reaches random's mean final
            accuracy, and that as a fraction of random's final label count (null where it never does)
  must_hold the default sampler's AULC >= random's + 0.02 and labels_to_random_final <= 50% of random's

Usage: python benchmarks/camera_al.py [--seeds 0 1 2] [--samplers random margin ...] [--devices 4]
       [--per-class 150] [--test-per-class 100] [--rounds 10] [--labels 10] [--epochs 20] [--size 96]
       [--work DIR] [--figures DIR]   (JSON on stdout, progress on stderr)
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from dataclasses import asdict, dataclass
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
import torch
from label_efficiency import plot, summarise

from bench.camera_scenes import SceneClass, pick_items, render_set
from coordinator.aggregation import ClientUpdate
from coordinator.strategies import make_strategy
from edge_agent.data.fashion_mnist import load_fashion_mnist
from edge_agent.data.image_arrays import model_input
from edge_agent.learning.efficientnet import FEATURES, EfficientNetLite0
from edge_agent.learning.head_training import HeadSettings, softmax, train_classifier
from edge_agent.learning.mc_scorer import DropoutSpec, mc_probabilities
from edge_agent.learning.ort_scorer import DEFAULT_BATCH, TAIL_ROWS
from edge_agent.learning.pretrained_backbone import initial_model
from edge_agent.learning.sampling import COLD_START, AcquisitionContext, Embeddings, make_sampler
from protocol import messages
from protocol.files import load_arrays, save_arrays
from protocol.model_spec import CLASS_NAMES, ModelSpec, spec_hash

TEN_CLASSES = tuple(SceneClass(name, source) for source, name in enumerate(CLASS_NAMES))
SAMPLERS = ("random", "margin", "entropy", "bald", "power-margin", "badge", "coreset", "fast")
HEAD = ("classifier_fc.weight", "classifier_fc.bias")
RECIPE = messages.Recipe()
CENTRAL_EPOCHS = 60
DROPOUT = EfficientNetLite0.default_dropout[0]  # the head's one dropout, as devices score and train it
CEILING_EPOCHS = 30
HEAD_EPOCHS = (
    20  # local epochs: with 10-100 labels a device takes 1-4 SGD steps an epoch; 5 epochs leave the head unfit
)


def progress(text: str) -> None:
    """One progress line on stderr."""
    print(f"[camera_al {time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)


def lite0_spec(size: int) -> ModelSpec:
    """The pretrained spec the fleet runs: EfficientNet-Lite0, ImageNet weights, head-only, ten classes."""
    return ModelSpec(
        architecture="efficientnet-lite0",
        channels=3,
        height=size,
        width=size,
        mean=[0.5] * 3,
        std=[0.5] * 3,
        class_names=[scene.name for scene in TEN_CLASSES],
        trainable="head",
        pretrained="imagenet",
    )


@dataclass(frozen=True)
class FleetShape:
    """The camera fleet: devices, scenes per class on each device and in the test set, input size, fleet seed."""

    devices: int
    per_class: int
    test_per_class: int
    size: int
    seed: int = 0


def render_fleet(shape: FleetShape) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """(images, labels) per device, then the test set last: scenes of distinct Fashion-MNIST items (training split
    for the pools, test split for the test set), each class dealt evenly over the devices."""
    dataset, rng = load_fashion_mnist(), np.random.default_rng([shape.seed, 0])
    indices, labels = pick_items(dataset.train_labels, TEN_CLASSES, shape.per_class * shape.devices, rng)
    shares = [
        np.concatenate([np.flatnonzero(labels == c)[d :: shape.devices] for c in range(10)])
        for d in range(shape.devices)
    ]
    sets = [
        render_set(dataset.train_images[indices[share]], labels[share], shape.size, shape.seed, number + 1)
        for number, share in enumerate(shares)
    ]
    test_indices, test_labels = pick_items(dataset.test_labels, TEN_CLASSES, shape.test_per_class, rng)
    sets.append(render_set(dataset.test_images[test_indices], test_labels, shape.size, shape.seed, shape.devices + 1))
    return [scenes.arrays() for scenes in sets], [scenes.labels for scenes in sets]


def extract(model: torch.nn.Module, images: np.ndarray, what: str, batch: int = 64) -> np.ndarray:
    """The backbone's pooled features (float32 (N, 1280)) of raw uint8 images, a batch at a time, with progress."""
    out = np.empty((len(images), FEATURES), dtype=np.float32)
    with torch.no_grad():
        for start in range(0, len(images), batch):
            out[start : start + batch] = model.prefix(torch.from_numpy(model_input(images[start : start + batch])))
            if start % (batch * 8) == 0:
                progress(f"features {what}: {start + batch}/{len(images)}")
    return out


def fleet_features(shape: FleetShape, work: Path) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """{"features_N", "labels_N"} per device N and the test set (N = devices), from the cache when it holds this
    fleet under this backbone, else rendered and embedded (and cached); with the extraction's timing."""
    spec = lite0_spec(shape.size)
    key = hashlib.sha256(json.dumps([asdict(shape), spec_hash(spec)]).encode()).hexdigest()[:16]
    path = work / f"features-{key}.npz"
    if path.is_file():
        progress(f"features from the cache {path}")
        return load_arrays(path), {"cache": str(path), "cached": True}
    images, labels = render_fleet(shape)
    model, arrays = initial_model(spec, 0).eval(), {}
    started = time.perf_counter()
    for number, (stack, truth) in enumerate(zip(images, labels)):
        arrays[f"features_{number}"], arrays[f"labels_{number}"] = extract(model, stack, f"set {number}"), truth
    seconds = time.perf_counter() - started
    work.mkdir(parents=True, exist_ok=True)
    save_arrays(path, arrays)
    count = sum(len(stack) for stack in images)
    return arrays, {"cache": str(path), "cached": False, "images": count, "ms_per_image": 1000 * seconds / count}


def extraction_ms(size: int, count: int = 64) -> float:
    """Milliseconds per image of the backbone in torch fp32 on this machine (random pixels, after a warm-up)."""
    model = initial_model(lite0_spec(size), 0).eval()
    images = torch.rand(count, 3, size, size)
    with torch.no_grad():
        model.prefix(images[:8])
        started = time.perf_counter()
        model.prefix(images)
    return round(1000 * (time.perf_counter() - started) / count, 2)


class Head:
    """A classifier (weight (C, 1280), bias (C,)): MC-dropout probabilities through the devices' numpy loop,
    deterministic accuracy, training from itself."""

    def __init__(self, weight: np.ndarray, bias: np.ndarray) -> None:
        self.weight, self.bias = weight.astype(np.float32), bias.astype(np.float32)

    def probabilities(self, features: np.ndarray, passes: int, seed: int) -> np.ndarray:
        """(passes, N, C): the prefix is the cache (features as (N, 1280, 1, 1) inputs), the tail one dropout and
        the classifier, masks from batch_masks as every back end draws them."""
        spec = DropoutSpec((DROPOUT,), ((FEATURES,),))
        inputs = features[:, :, None, None]
        return mc_probabilities(
            lambda x: x.reshape(len(x), -1),
            lambda h, masks: softmax((h * masks[0]) @ self.weight.T + self.bias),
            spec,
            inputs,
            passes,
            seed,
            DEFAULT_BATCH,
            TAIL_ROWS,
        )

    def accuracy(self, features: np.ndarray, labels: np.ndarray) -> float:
        """Top-1 accuracy with dropout off."""
        return float(np.mean(np.argmax(features @ self.weight.T + self.bias, axis=1) == labels))

    def trained(self, features: np.ndarray, labels: np.ndarray, settings: HeadSettings) -> Head:
        """A new head: train_classifier from this one."""
        weight, bias, _ = train_classifier(features, labels, self.weight, self.bias, settings)
        return Head(weight, bias)

    def weights(self) -> dict[str, np.ndarray]:
        """As an update carries them."""
        return dict(zip(HEAD, (self.weight, self.bias)))


def no_logits() -> np.ndarray:
    """What a head-only device answers for whole-model logits (KSAS is not measured here)."""
    raise ValueError("whole-model logits need torch; a head-only device has none")


@dataclass
class Device:
    """One camera's cached features, the answers its person would give, and the labels it holds so far."""

    features: np.ndarray
    truth: np.ndarray
    labelled: np.ndarray
    weak: tuple[np.ndarray, np.ndarray] | None = None

    def pool(self) -> np.ndarray:
        """Positions without a human label."""
        return np.setdiff1d(np.arange(len(self.truth)), self.labelled)

    def training_set(self) -> tuple[np.ndarray, np.ndarray]:
        """Features and labels of every label it holds: human, then FAST's weak labels on the rest (kept-labels)."""
        indices, labels = self.labelled, self.truth[self.labelled]
        if self.weak is not None:
            unlabelled = ~np.isin(self.weak[0], self.labelled)
            indices = np.concatenate([indices, self.weak[0][unlabelled]])
            labels = np.concatenate([labels, self.weak[1][unlabelled]])
        return self.features[indices], labels


def acquire(device: Device, sampler_name: str, head: Head, budget: int, passes: int, step: int) -> None:
    """One acquisition as the device's acquirer makes it: the sampler's choice over the pool (a uniform draw while
    the device holds fewer than `budget` labels), the person's answers, and FAST's weak labels for the rest."""
    pool, sampler = device.pool(), make_sampler(sampler_name)
    features, human = device.features[pool], device.features[device.labelled]
    labels = device.truth[device.labelled]
    context = AcquisitionContext(
        num_samples=len(pool),
        rng=np.random.default_rng(step),
        class_counts=np.bincount(labels, minlength=len(TEN_CLASSES)),
        options={COLD_START.key: float(budget)},
        probabilities=cache(lambda: head.probabilities(features, passes, step)),
        own_logits=no_logits,
        global_logits=no_logits,
        embeddings=cache(lambda: Embeddings(features, human, labels)),
        features=lambda: features,
        labelled_features=lambda: human,
    )
    picked = pool[sampler.choose(context, budget)]
    weak = sampler.weak_labels(context) if len(labels) else None
    device.labelled = np.concatenate([device.labelled, picked])
    if weak is not None:
        device.weak = (pool, weak)


def head_settings(epochs: int, dropout: float, seed: int) -> HeadSettings:
    """The recipe's SGD (batch size, learning rate, momentum, weight decay, schedule) for `epochs`."""
    return HeadSettings(
        epochs,
        RECIPE.batch_size,
        RECIPE.learning_rate,
        RECIPE.momentum,
        RECIPE.weight_decay,
        dropout,
        seed,
        RECIPE.lr_schedule,
    )


def federated_round(devices: list[Device], sampler: str, head: Head, args: argparse.Namespace, step: int) -> Head:
    """Every device acquires and trains from the global head on all it holds; FedAvg by labelled-sample count."""
    updates = []
    for number, device in enumerate(devices):
        acquire(device, sampler, head, args.labels, args.passes, step + number)
        features, labels = device.training_set()
        trained = head.trained(features, labels, head_settings(args.epochs, DROPOUT, step + number))
        updates.append(ClientUpdate(f"cam-{number}", trained.weights(), float(len(labels))))
    weights, _ = make_strategy("fedavg").aggregate(head.weights(), updates, None)
    return Head(*(weights[name] for name in HEAD))


def pooled(devices: list[Device]) -> tuple[np.ndarray, np.ndarray]:
    """Every device's human-labelled features and labels together (what a central learner would hold)."""
    return (
        np.concatenate([device.features[device.labelled] for device in devices]),
        np.concatenate([device.truth[device.labelled] for device in devices]),
    )


def logistic_regression(features: np.ndarray, labels: np.ndarray, epochs: int, seed: int) -> Head:
    """The centralised probe: train_classifier from a zero head, no dropout, the recipe's SGD."""
    zero = Head(np.zeros((len(TEN_CLASSES), FEATURES), np.float32), np.zeros(len(TEN_CLASSES), np.float32))
    return zero.trained(features, labels, head_settings(epochs, 0.0, seed))


def run(fleet: dict[str, np.ndarray], sampler: str, seed: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    """One sampler and seed from W0 (the pretrained spec's fresh head): the federated and the centralised curve."""
    devices = [Device(fleet[f"features_{n}"], fleet[f"labels_{n}"], np.zeros(0, np.int64)) for n in range(args.devices)]
    test = test_set(fleet, args.devices)
    classifier = initial_model(lite0_spec(args.size), seed).classifier()
    head = Head(classifier.weight.detach().numpy(), classifier.bias.detach().numpy())
    labels, federated, central = [], [], []
    for round_id in range(1, args.rounds + 1):
        head = federated_round(devices, sampler, head, args, (seed * 1000 + round_id) * 100)
        features, truth = pooled(devices)
        labels.append(len(truth))
        federated.append(round(head.accuracy(*test), 4))
        central.append(round(logistic_regression(features, truth, CENTRAL_EPOCHS, seed).accuracy(*test), 4))
    counts = np.bincount(pooled(devices)[1], minlength=len(TEN_CLASSES))
    base = {"sampler": sampler, "seed": seed, "labels": labels, "final_class_counts": counts.tolist()}
    weak = [np.mean(d.truth[d.weak[0]] == d.weak[1]) for d in devices if d.weak is not None]
    fast = {"weak_label_accuracy": round(float(np.mean(weak)), 4)} if weak else {}
    return [
        {**base, **fast, "partition": "federated", "accuracy": federated},
        {**base, "partition": "centralised", "accuracy": central},
    ]


def ceiling(fleet: dict[str, np.ndarray], seed: int, devices: int) -> float:
    """Test accuracy of the centralised probe on every pool label of every device."""
    features = np.concatenate([fleet[f"features_{n}"] for n in range(devices)])
    labels = np.concatenate([fleet[f"labels_{n}"] for n in range(devices)])
    return round(logistic_regression(features, labels, CEILING_EPOCHS, seed).accuracy(*test_set(fleet, devices)), 4)


def test_set(fleet: dict[str, np.ndarray], devices: int) -> tuple[np.ndarray, np.ndarray]:
    """The test scenes' features and labels (stored after the devices')."""
    return fleet[f"features_{devices}"], fleet[f"labels_{devices}"]


def must_hold(summary: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The issue's check on the federated curves: the default sampler's AULC gain over random (>= 0.02) and the
    share of random's labels it needed to reach random's final accuracy (<= 0.5)."""
    curve = summary["federated"][RECIPE.sampler]
    gain, share = curve["aulc_gain_over_random"], curve["fraction_of_random_labels"]
    return {
        "sampler": RECIPE.sampler,
        "aulc_gain_over_random": gain,
        "fraction_of_random_labels": share,
        "aulc_holds": gain >= 0.02,
        "labels_hold": share is not None and share <= 0.5,
    }


def parse_args() -> argparse.Namespace:
    """The fleet's shape, the rounds, the samplers and seeds, where the cache and figures go."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--samplers", nargs="+", default=list(SAMPLERS))
    sizes = (("devices", 4), ("per-class", 150), ("test-per-class", 100), ("rounds", 10), ("labels", 10))
    for flag, default in (*sizes, ("epochs", HEAD_EPOCHS), ("passes", RECIPE.mc_passes), ("size", 96)):
        parser.add_argument(f"--{flag}", type=int, default=default)
    parser.add_argument("--work", type=Path, default=Path("runs") / "camera-al", help="the feature cache's folder")
    parser.add_argument("--figures", type=Path, help="write curves.png and default_vs_random.png here")
    return parser.parse_args()


def main() -> None:
    """Features once (cached), every sampler and seed, the summary and the must-hold check as one JSON object."""
    args = parse_args()
    shape = FleetShape(args.devices, args.per_class, args.test_per_class, args.size)
    timing = {f"{size}px_ms_per_image": extraction_ms(size) for size in (96, 160)}
    fleet, extraction = fleet_features(shape, args.work)
    runs: list[dict[str, Any]] = []
    ceilings = {}
    for seed in args.seeds:
        ceilings[seed] = ceiling(fleet, seed, args.devices)
        for sampler in args.samplers:
            started = time.perf_counter()
            runs.extend(run(fleet, sampler, seed, args))
            seconds = time.perf_counter() - started
            progress(f"seed {seed} {sampler}: {runs[-2]['accuracy']} ({seconds:.0f} s)")
    summary = summarise(runs)
    if args.figures:
        args.figures.mkdir(parents=True, exist_ok=True)
        plot(summary, args.figures / "curves.png")
        focus = {key: summary["federated"][key] for key in ("random", RECIPE.sampler) if key in summary["federated"]}
        plot({"federated: the default sampler and random": focus}, args.figures / "default_vs_random.png")
    result = {
        "fleet": asdict(shape),
        "settings": {key: (str(value) if isinstance(value, Path) else value) for key, value in vars(args).items()},
        "extraction": {**extraction, **timing, "threads": torch.get_num_threads()},
        "ceiling_all_labels": ceilings,
        "summary": summary,
        "must_hold": must_hold(summary) if "random" in summary["federated"] else None,
        "runs": runs,
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
