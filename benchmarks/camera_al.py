# Federated active learning of a head over frozen EfficientNet-Lite0 features on a 10-class camera fleet, per sampler.
"""A camera fleet (camera_al_fleet: Fashion-MNIST's ten classes rendered as RGB JPEG scenes), its devices' pools
and a separate balanced test set, embedded once by the zoo's EfficientNet-Lite0 with ImageNet weights (pixels / 255,
1280 pooled features; cached under --work, keyed by the fleet and the spec's hash). The pools are balanced, or with
--imbalance R their class frequencies fall geometrically from the commonest class to the rarest, R : 1 (the same
pool size; the new scenes it needs are rendered and embedded once). Each round every device scores its
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
  final_class_recall   per class, the federated head's final test accuracy on that class's scenes (mean over seeds)
  ceiling_class_recall, ceiling_confusion   the same, and the confusion matrix, of the all-labels probe per seed

Usage: python benchmarks/camera_al.py [--seeds 0 1 2] [--samplers random margin ...] [--devices 4]
       [--per-class 150] [--test-per-class 100] [--rounds 10] [--labels 10] [--epochs 20] [--size 96]
       [--imbalance 1] [--work DIR] [--figures DIR]   (JSON on stdout, progress on stderr)
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
import torch
from camera_al_fleet import (
    TEN_CLASSES,
    FleetShape,
    extraction_ms,
    fleet_features,
    imbalanced_features,
    lite0_spec,
    progress,
)
from label_efficiency import plot, summarise

from coordinator.strategies.aggregate import ClientUpdate
from coordinator.strategies.registry import make_strategy
from edge_agent.learning.efficientnet import FEATURES, EfficientNetLite0
from edge_agent.learning.head_training import HeadSettings, softmax, train_classifier
from edge_agent.learning.mc_scorer import DropoutSpec, mc_probabilities
from edge_agent.learning.ort_scorer import DEFAULT_BATCH, TAIL_ROWS
from edge_agent.learning.pretrained_backbone import initial_model
from edge_agent.learning.sampling import COLD_START, AcquisitionContext, Embeddings, make_sampler
from protocol import messages

SAMPLERS = ("random", "margin", "entropy", "bald", "power-margin", "badge", "coreset", "fast")
HEAD = ("classifier_fc.weight", "classifier_fc.bias")
RECIPE = messages.Recipe()
CENTRAL_EPOCHS = 60
DROPOUT = EfficientNetLite0.default_dropout[0]  # the head's one dropout, as devices score and train it
CEILING_EPOCHS = 30
HEAD_EPOCHS = (
    20  # local epochs: with 10-100 labels a device takes 1-4 SGD steps an epoch; 5 epochs leave the head unfit
)


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

    def class_recall(self, features: np.ndarray, labels: np.ndarray) -> list[float]:
        """Per class, the accuracy on that class's samples with dropout off."""
        right = np.argmax(features @ self.weight.T + self.bias, axis=1) == labels
        return [round(float(np.mean(right[labels == c])), 4) for c in range(len(TEN_CLASSES))]

    def confusion(self, features: np.ndarray, labels: np.ndarray) -> list[list[int]]:
        """Per true class (rows), how many of its samples the head (dropout off) calls each class (columns)."""
        predicted = np.argmax(features @ self.weight.T + self.bias, axis=1)
        return [
            np.bincount(predicted[labels == c], minlength=len(TEN_CLASSES)).tolist() for c in range(len(TEN_CLASSES))
        ]

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
    recall = {"final_class_recall": head.class_recall(*test)}
    return [
        {**base, **fast, **recall, "partition": "federated", "accuracy": federated},
        {**base, "partition": "centralised", "accuracy": central},
    ]


def ceiling(fleet: dict[str, np.ndarray], seed: int, devices: int) -> tuple[float, list[float], list[list[int]]]:
    """Test accuracy, per-class accuracy and confusion of the centralised probe on every pool label of every device."""
    features = np.concatenate([fleet[f"features_{n}"] for n in range(devices)])
    labels = np.concatenate([fleet[f"labels_{n}"] for n in range(devices)])
    probe, test = logistic_regression(features, labels, CEILING_EPOCHS, seed), test_set(fleet, devices)
    return round(probe.accuracy(*test), 4), probe.class_recall(*test), probe.confusion(*test)


def test_set(fleet: dict[str, np.ndarray], devices: int) -> tuple[np.ndarray, np.ndarray]:
    """The test scenes' features and labels (stored after the devices')."""
    return fleet[f"features_{devices}"], fleet[f"labels_{devices}"]


def paired_gains(runs: list[dict[str, Any]], sampler: str) -> list[float]:
    """Per seed (the same W0, cold start and fleet), the sampler's federated AULC minus random's."""
    aulc = {
        (run["sampler"], run["seed"]): float(np.mean(run["accuracy"]))
        for run in runs
        if run["partition"] == "federated"
    }
    seeds = sorted(seed for name, seed in aulc if name == sampler and ("random", seed) in aulc)
    return [round(aulc[sampler, seed] - aulc["random", seed], 4) for seed in seeds]


def must_hold(summary: dict[str, dict[str, Any]], runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The issue's check on the federated curves: the default sampler's AULC gain over random (>= 0.02; also per
    seed) and the share of random's labels it needed to reach random's final accuracy (<= 0.5)."""
    curve = summary["federated"][RECIPE.sampler]
    gain, share = curve["aulc_gain_over_random"], curve["fraction_of_random_labels"]
    return {
        "sampler": RECIPE.sampler,
        "aulc_gain_over_random": gain,
        "aulc_gain_per_seed": paired_gains(runs, RECIPE.sampler),
        "fraction_of_random_labels": share,
        "aulc_holds": gain >= 0.02,
        "labels_hold": share is not None and share <= 0.5,
    }


def class_recalls(runs: list[dict[str, Any]]) -> dict[str, list[float]]:
    """Per sampler, the federated head's final per-class test accuracy, the mean over seeds."""
    federated = [run for run in runs if run["partition"] == "federated"]
    return {
        sampler: np.mean([run["final_class_recall"] for run in federated if run["sampler"] == sampler], 0)
        .round(4)
        .tolist()
        for sampler in dict.fromkeys(run["sampler"] for run in federated)
    }


def parse_args() -> argparse.Namespace:
    """The fleet's shape, the rounds, the samplers and seeds, where the cache and figures go."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--samplers", nargs="+", default=list(SAMPLERS))
    sizes = (("devices", 4), ("per-class", 150), ("test-per-class", 100), ("rounds", 10), ("labels", 10))
    for flag, default in (*sizes, ("epochs", HEAD_EPOCHS), ("passes", RECIPE.mc_passes), ("size", 96)):
        parser.add_argument(f"--{flag}", type=int, default=default)
    parser.add_argument("--imbalance", type=float, default=1.0, help="commonest : rarest class in a pool (1: balanced)")
    parser.add_argument("--work", type=Path, default=Path("runs") / "camera-al", help="the feature cache's folder")
    parser.add_argument("--figures", type=Path, help="write curves.png and default_vs_random.png here")
    args = parser.parse_args()
    if not args.imbalance >= 1:
        parser.error(f"--imbalance is the commonest class's count over the rarest's, at least 1; got {args.imbalance}")
    return args


def sweep(
    fleet: dict[str, np.ndarray], args: argparse.Namespace
) -> tuple[list[dict[str, Any]], dict[int, tuple[float, list[float], list[list[int]]]]]:
    """Every seed's all-labels ceiling and every sampler's runs under it, with progress."""
    runs: list[dict[str, Any]] = []
    ceilings = {}
    for seed in args.seeds:
        ceilings[seed] = ceiling(fleet, seed, args.devices)
        for sampler in args.samplers:
            started = time.perf_counter()
            runs.extend(run(fleet, sampler, seed, args))
            seconds = time.perf_counter() - started
            progress(f"seed {seed} {sampler}: {runs[-2]['accuracy']} ({seconds:.0f} s)")
    return runs, ceilings


def main() -> None:
    """Features once (cached), every sampler and seed, the summary and the must-hold check as one JSON object."""
    args = parse_args()
    shape = FleetShape(args.devices, args.per_class, args.test_per_class, args.size)
    timing = {f"{size}px_ms_per_image": extraction_ms(size) for size in (96, 160)}
    fleet, extraction = (
        imbalanced_features(shape, args.imbalance, args.work)
        if args.imbalance > 1
        else fleet_features(shape, args.work)
    )
    runs, ceilings = sweep(fleet, args)
    summary = summarise(runs)
    if args.figures:
        args.figures.mkdir(parents=True, exist_ok=True)
        plot(summary, args.figures / "curves.png")
        focus = {key: summary["federated"][key] for key in ("random", RECIPE.sampler) if key in summary["federated"]}
        plot({"federated: the default sampler and random": focus}, args.figures / "default_vs_random.png")
    result = {
        "fleet": {**asdict(shape), "imbalance": args.imbalance},
        "settings": {key: (str(value) if isinstance(value, Path) else value) for key, value in vars(args).items()},
        "extraction": {**extraction, **timing, "threads": torch.get_num_threads()},
        "ceiling_all_labels": {seed: accuracy for seed, (accuracy, _, _) in ceilings.items()},
        "ceiling_class_recall": {seed: recall for seed, (_, recall, _) in ceilings.items()},
        "ceiling_confusion": {seed: confusion for seed, (_, _, confusion) in ceilings.items()},
        "summary": summary,
        "must_hold": must_hold(summary, runs) if {"random", RECIPE.sampler} <= summary["federated"].keys() else None,
        "final_class_recall": class_recalls(runs),
        "runs": runs,
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
