# Federated active learning of a head over frozen EfficientNet-Lite0 features on a camera fleet, per sampler and seed.
"""A camera fleet (camera_al_fleet: Fashion-MNIST's ten classes, or --classes NAME=SOURCE,..., rendered as RGB JPEG
scenes), its devices' pools and a separate balanced test set, embedded once by the zoo's EfficientNet-Lite0 with
ImageNet weights (pixels / 255, 1280 pooled features; on the GPU when torch sees one; cached under --work, keyed by
the fleet and the spec's hash). The pools are balanced, or with --imbalance R their class frequencies fall
geometrically from the commonest class to the rarest, R : 1, or with --long-tail ALPHA as a power law of the class's
rank (share ~ rank^-ALPHA) (the same pool size; the new scenes it needs are rendered and embedded once). With
--dirichlet ALPHA the same scenes are dealt to the devices non-IID: each class's scenes in Dirichlet(ALPHA) shares
over the devices (camera_al_fleet.redealt; pool sizes then differ). Each round
every device scores its pool with the round's global head (the devices' MC-dropout loop, mc_scorer, over cached
features), asks the sampler (SAMPLERS, through Sampler.choose: a sampler that needs the head draws uniformly until a
device holds --labels labels, the cold start; one whose first choice needs no model, TypiClust first, chooses from
the first label), trains the head from the global one on every label it holds (head_training.train_classifier, the
recipe's SGD, --epochs 20, and at least --min-steps SGD steps, a cold-start trial; kept-labels' logit adjustment
--logit-adjustment 1, the camera path's), and the coordinator's FedAvg averages the heads by labelled-sample count.
In the same run, per round: a centralised logistic regression (the same train_classifier, from zero, no dropout) on
the same pooled labels and features; per seed, the all-labels ceiling (every pool label pooled). A sampler may carry
recipe options after a colon (NAME:key=value,...), each spelling its own curve. Two spellings are the benchmark's own:
"fleet:NAME" runs NAME with the fleet's label counts per class (the sum over the devices, what the coordinator sees
in the updates) in place of the device's, scaled to the device's total, to measure fleet-level selection; and
"oracle-balanced", not a sampler (it reads the answers), gives each device the labels that level its class counts,
drawn uniformly within each class: the most that class balancing alone could buy. "semi:NAME" runs NAME with the
devices training under the pseudo-labels rule (edge_agent.learning.propagation: a teacher on the labels, its
predictions on the device's pool where label propagation over the cached rows agrees, the teacher trained on with
them; FedAvg still weighs by human labels), its options in the spelling beside the sampler's
(semi:NAME:pseudo_labels=500). "pooled:NAME": the devices send their labels' class statistics and pooled-head fits
the classifier; "pooled-em:NAME" the same, each acquisition's round followed by a round without acquisition in which
the devices send their pools' posterior sums too and pooled-head refines the class means with them (--pool-labels;
the curve's point is the refined head's). --jobs runs seeds and samplers in that many processes.

Reported per sampler (over the seeds; the summary of curves.py):
  aulc      area under the learning curve: the mean test accuracy over the rounds; each round adds the same
            number of labels, so it is the area under accuracy against labels divided by the label range
  labels_to_random_final   the first label count at which the sampler's mean curve reaches random's mean final
            accuracy, and that as a fraction of random's final label count (null where it never does)
  intervals per sampler, paired by seed with random (camera_al_stats): the AULC gain (points) and the share of
            random's labels needed to reach random's final accuracy, each with its 90% t-interval; the federated
            curve's gap to the centralised probe per round
  must_hold the camera default's checks (IID fleets; null with --dirichlet): the AULC gain's interval above +2
            points (imbalanced) or -0.5 (balanced), reach <= 50% of random's labels, and the federated curve within
            5 points of the probe
  final_class_recall   per class, the federated head's final test accuracy on that class's scenes (mean over seeds)
  ceiling_class_recall, ceiling_confusion   the same, and the confusion matrix, of the all-labels probe per seed
  selection_seconds    one acquisition of the camera default over 10000 cached rows (resampled from the pools),
            holding 0 labels (its TypiClust phase), 20 and 40 (its margin phase), MC-dropout passes included,
            the median of three tries
  table     the markdown rows docs/benchmarks/camera_al_sweep quotes (also table.md beside the figures)

Usage: python benchmarks/camera_al.py [--seeds 0 1 2 3 4] [--samplers random margin ...] [--devices 4]
       [--per-class 150] [--test-per-class 100] [--rounds 10] [--labels 10] [--epochs 20] [--min-steps 0]
       [--logit-adjustment 1] [--size 96] [--imbalance R | --long-tail ALPHA] [--dirichlet ALPHA]
       [--classes NAME=SOURCE,...]
       [--jobs N] [--work DIR] [--figures DIR] [--setting NAME] [--features-only]
       (JSON on stdout, progress on stderr; camera_al_sweep.sh runs the must-hold settings)
"""

from __future__ import annotations

import argparse
import json
import math
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
import torch
from camera_al_fleet import (
    TEN_CLASSES,
    ClassMix,
    FleetShape,
    extraction_ms,
    lite0_spec,
    mixed_features,
    progress,
    redealt,
)
from camera_al_stats import DEFAULT, ORACLE, TABLE_HEAD, figures, intervals, table
from curves import sampler_and_options, summarise

from bench.camera_scenes import parse_classes
from coordinator.strategies.aggregate import ClientUpdate
from coordinator.strategies.pooled_head import POOL_LABELS, PooledHead
from coordinator.strategies.registry import make_strategy
from edge_agent.learning.batch_samplers import PhasedSampler, TypicalitySampler
from edge_agent.learning.batch_selection import level_quotas
from edge_agent.learning.efficientnet import FEATURES, EfficientNetLite0
from edge_agent.learning.head_training import HeadSettings, softmax, train_classifier
from edge_agent.learning.heuristics import COLD_START, AcquisitionContext, Embeddings
from edge_agent.learning.local_rules import KeptLabels, PseudoLabelled
from edge_agent.learning.mc_scorer import DropoutSpec, mc_probabilities
from edge_agent.learning.ort_scorer import DEFAULT_BATCH, TAIL_ROWS
from edge_agent.learning.pretrained_backbone import initial_model
from edge_agent.learning.prior_shift import prior_weights, reweighted
from edge_agent.learning.sampling import make_sampler
from protocol import messages
from protocol.head_statistics import HeadStatistics, calibration_sums, pool_posterior_sums

CAMERA_DEFAULT = DEFAULT
FLEET_LEVEL = "fleet:"  # a spelling's prefix: its sampler reads the fleet's class counts (what the coordinator sees)
POOLED = "pooled:"  # a spelling's prefix: the devices send class statistics and pooled-head fits the classifier
POOLED_EM = "pooled-em:"  # the same, each acquisition's round followed by one refining the means from the pools
SEMI = "semi:"  # a spelling's prefix: the devices train with the pseudo-labels rule (pseudo-labels on their own pools)
SAMPLERS = ("random", "margin", CAMERA_DEFAULT, "typical-then-margin", "typiclust", "balanced-margin", "power-margin")
HEAD = ("classifier_fc.weight", "classifier_fc.bias")
RECIPE = messages.Recipe()
CENTRAL_EPOCHS = 60
DROPOUT = EfficientNetLite0.default_dropout[0]  # the head's one dropout, as devices score and train it
CEILING_EPOCHS = 30
HEAD_EPOCHS = (
    20  # local epochs: with 10-100 labels a device takes 1-4 SGD steps an epoch; 5 epochs leave the head unfit
)
SELECTION_ROWS = 10000
KEPT_LABELS = KeptLabels()
PSEUDO_LABELS = PseudoLabelled()


class Head:
    """A classifier (weight (C, 1280), bias (C,)): MC-dropout probabilities through the devices' numpy loop,
    deterministic accuracy, training from itself."""

    def __init__(self, weight: np.ndarray, bias: np.ndarray) -> None:
        self.weight, self.bias = weight.astype(np.float32), bias.astype(np.float32)

    @property
    def classes(self) -> int:
        """How many classes it tells apart."""
        return len(self.bias)

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
        return [round(float(np.mean(right[labels == c])), 4) for c in range(self.classes)]

    def confusion(self, features: np.ndarray, labels: np.ndarray) -> list[list[int]]:
        """Per true class (rows), how many of its samples the head (dropout off) calls each class (columns)."""
        predicted = np.argmax(features @ self.weight.T + self.bias, axis=1)
        return [np.bincount(predicted[labels == c], minlength=self.classes).tolist() for c in range(self.classes)]

    def trained(
        self, features: np.ndarray, labels: np.ndarray, settings: HeadSettings, logit_bias: np.ndarray | None = None
    ) -> Head:
        """A new head: train_classifier from this one (on the logit-adjusted loss when a logit_bias is given)."""
        weight, bias, _ = train_classifier(features, labels, self.weight, self.bias, settings, logit_bias)
        return Head(weight, bias)

    def weights_pair(self) -> tuple[np.ndarray, np.ndarray]:
        """(weight, bias), as the numpy trainers take them."""
        return self.weight, self.bias

    def weights(self) -> dict[str, np.ndarray]:
        """As an update carries them."""
        return dict(zip(HEAD, (self.weight, self.bias)))

    def posteriors(self, features: np.ndarray) -> np.ndarray:
        """Softmax probabilities with dropout off (what a device serves before its prior is adapted)."""
        return softmax(features.astype(np.float64) @ self.weight.T + self.bias)


def mix_accuracy(predicted: np.ndarray, truth: np.ndarray, mix: np.ndarray) -> float:
    """Accuracy on a test set dealt like a pool of class mix `mix`: the per-class recall on the (balanced) test set,
    weighted by the mix (the expected accuracy of a test split drawn with the pool's class shares)."""
    classes = len(mix)
    right = np.bincount(truth[predicted == truth], minlength=classes) / np.maximum(
        np.bincount(truth, minlength=classes), 1
    )
    return float(np.sum(right * mix))


def saerens_em(posteriors: np.ndarray, iterations: int = 200) -> np.ndarray:
    """The class weights of a pool by plain EM over the head's posteriors (Saerens, Latinne and Decaestecker 2002;
    the head fitted for equal priors): the estimate the issue names, measured beside the device's rule."""
    prior = np.full(posteriors.shape[1], 1.0 / posteriors.shape[1])
    for _ in range(iterations):
        following = np.mean(reweighted(posteriors, prior), axis=0)
        if np.max(np.abs(following - prior)) < 1e-6:
            break
        prior = following
    return prior * len(prior)


def served_accuracies(devices: list[Device], head: Head, test: tuple[np.ndarray, np.ndarray]) -> dict[str, float]:
    """Each device's accuracy on test images dealt like its pool (mix_accuracy), the mean over devices: of the global
    head, of the head its device serves (prior_shift: its labels against the fleet's), and of the head re-weighed by
    plain EM over its pool's posteriors."""
    test_posteriors = head.posteriors(test[0])
    counts = [np.bincount(device.truth[device.labelled], minlength=head.classes) for device in devices]
    fleet = np.sum(counts, axis=0)
    found: dict[str, list[float]] = {"global": [], "served": [], "em": []}
    for device, own in zip(devices, counts):
        mix = np.bincount(device.truth, minlength=head.classes) / len(device.truth)
        found["global"].append(mix_accuracy(np.argmax(test_posteriors, 1), test[1], mix))
        served = reweighted(test_posteriors, prior_weights(own, fleet))
        found["served"].append(mix_accuracy(np.argmax(served, 1), test[1], mix))
        em = reweighted(test_posteriors, saerens_em(head.posteriors(device.features[device.pool()])))
        found["em"].append(mix_accuracy(np.argmax(em, 1), test[1], mix))
    return {name: round(float(np.mean(values)), 4) for name, values in found.items()}


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


def starts_without_model(name: str) -> bool:
    """Whether the sampler's first choice needs no model output (TypiClust, or a phased sampler it starts), so the
    benchmark's cold start (a uniform first batch for samplers that read the head) does not apply to it."""
    kind = type(make_sampler(name))
    return issubclass(kind, TypicalitySampler) or (
        issubclass(kind, PhasedSampler) and issubclass(kind.first, TypicalitySampler)
    )


def recipe_options(spelling: str, budget: int) -> tuple[str, dict[str, float]]:
    """The sampler's name and the options its devices run with: the cold start (a uniform first batch of
    `budget` for a sampler that reads the head, none for one that starts without a model), then the spelling's."""
    name, options = sampler_and_options(spelling)
    return name, {COLD_START.key: 0.0 if starts_without_model(name) else float(budget), **options}


def context_of(
    device: Device,
    pool: np.ndarray,
    head: Head,
    options: dict[str, float],
    passes: int,
    step: int,
    counts: np.ndarray | None = None,
) -> AcquisitionContext:
    """What a device's sampler sees over `pool`: the head's MC-dropout probabilities, the cached features as the
    penultimate features and FAST's embeddings, the human labels' features as the labelled ones, and as class
    counts the device's own (or `counts`)."""
    features, human = device.features[pool], device.features[device.labelled]
    labels = device.truth[device.labelled]
    return AcquisitionContext(
        num_samples=len(pool),
        rng=np.random.default_rng(step),
        class_counts=np.bincount(labels, minlength=head.classes) if counts is None else counts,
        options=options,
        probabilities=cache(lambda: head.probabilities(features, passes, step)),
        own_logits=no_logits,
        global_logits=no_logits,
        embeddings=cache(lambda: Embeddings(features, human, labels)),
        features=lambda: features,
        labelled_features=lambda: human,
    )


def acquire(device: Device, spelling: str, head: Head, budget: int, passes: int, step: int, fleet: np.ndarray) -> None:
    """One acquisition as the device's acquirer makes it: the sampler's choice over the pool, the person's answers,
    and FAST's weak labels for the rest. `fleet` is the fleet's label counts per class, which a "fleet:" spelling's
    sampler reads in place of the device's own, scaled to the device's total (the fleet's class mix)."""
    pool, held = device.pool(), np.bincount(device.truth[device.labelled], minlength=head.classes)
    if spelling == ORACLE:
        device.labelled = np.concatenate([device.labelled, pool[oracle_batch(device.truth[pool], held, budget, step)]])
        return
    fleet_level, spelling = spelling.startswith(FLEET_LEVEL), spelling.removeprefix(FLEET_LEVEL)
    counts = fleet * held.sum() / max(fleet.sum(), 1) if fleet_level else None
    name, options = recipe_options(spelling, budget)
    sampler = make_sampler(name)
    context = context_of(device, pool, head, options, passes, step, counts)
    picked = pool[sampler.choose(context, budget)]
    weak = sampler.weak_labels(context) if len(device.labelled) else None
    device.labelled = np.concatenate([device.labelled, picked])
    if weak is not None:
        device.weak = (pool, weak)


def oracle_batch(truth: np.ndarray, held: np.ndarray, budget: int, seed: int) -> np.ndarray:
    """The oracle's batch (it reads the answers): quotas that level the device's label counts, none beyond what its
    pool still holds of a class, each quota drawn uniformly from that class's scenes: the most class-balanced labels a device
    could be given, an upper bound on what class balancing alone buys."""
    rng = np.random.default_rng(seed)
    quotas = level_quotas(held, budget, caps=np.bincount(truth, minlength=len(held)))
    return np.concatenate(
        [rng.choice(np.flatnonzero(truth == c), q, replace=False) for c, q in enumerate(quotas)]
    ).astype(np.int64)


def local_epochs(epochs: int, min_steps: int, rows: int, batch_size: int) -> int:
    """The epochs a device trains: --epochs, raised so that the round takes at least `min_steps` SGD steps over
    `rows` rows in batches of `batch_size` (a cold-start trial: one step an epoch on 10 labels)."""
    per_epoch = max(math.ceil(rows / batch_size), 1)
    return max(epochs, math.ceil(min_steps / per_epoch))


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


def federated_round(devices: list[Device], spelling: str, head: Head, args: argparse.Namespace, step: int) -> Head:
    """Every device acquires and trains from the global head on all it holds (kept-labels: the recipe's epochs, at
    least --min-steps SGD steps, the loss adjusted by --logit-adjustment; with the "semi:" prefix, the pseudo-labels
    rule's pseudo-labels on its pool too, the fleet's label shares at the round's start standing for the round
    announcement's); FedAvg by labelled-sample count (pseudo-labels never count)."""
    semi, sampler = spelling.startswith(SEMI), spelling.removeprefix(SEMI)
    sampler, recipe = rule_spelling(sampler, args.rule_recipe) if semi else (sampler, args.rule_recipe)
    updates = []
    fleet = np.sum([np.bincount(d.truth[d.labelled], minlength=head.classes) for d in devices], axis=0)
    for number, device in enumerate(devices):
        acquire(device, sampler, head, args.labels, args.passes, step + number, fleet)
        features, labels = device.training_set()
        logit_bias = KEPT_LABELS.logit_bias(labels, head.classes, recipe)
        epochs = local_epochs(args.epochs, args.min_steps, len(labels), RECIPE.batch_size)
        settings = head_settings(epochs, DROPOUT, step + number)
        if semi:
            pool = device.features[device.pool()]
            semi_problem = PSEUDO_LABELS.semi_supervised(pool, recipe, fleet / max(fleet.sum(), 1))
            trained = Head(*semi_problem.trained(features, labels, pool, head.weights_pair(), settings, logit_bias)[:2])
        else:
            trained = head.trained(features, labels, settings, logit_bias)
        updates.append(ClientUpdate(f"cam-{number}", trained.weights(), float(len(labels))))
    weights, _ = make_strategy("fedavg").aggregate(head.weights(), updates, None)
    return Head(*(weights[name] for name in HEAD))


def rule_spelling(spelling: str, recipe: messages.Recipe) -> tuple[str, messages.Recipe]:
    """A "semi:" spelling's sampler spelling without the pseudo-labels rule's options, and the rule's recipe with
    them (NAME:pseudo_labels=500,... sets the rule's pseudo_labels)."""
    name, options = sampler_and_options(spelling)
    declared = {option.key for option in PSEUDO_LABELS.options}
    rule = {key: value for key, value in options.items() if key in declared}
    rest = ",".join(f"{key}={value:g}" for key, value in options.items() if key not in declared)
    return name + (f":{rest}" if rest else ""), messages.Recipe(options={**recipe.options, **rule})


def pooled_round(
    devices: list[Device], sampler: str, head: Head, args: argparse.Namespace, step: int, fit: PooledHead
) -> Head:
    """Every device acquires, then sends its labels' class statistics (the class-statistics rule) with the calibration
    sums of this round's new labels under the global head; pooled-head fits the classifier from their mean weighted
    by label count, as the round aggregator's FedAvg gives it."""
    updates = []
    fleet = np.sum([np.bincount(d.truth[d.labelled], minlength=head.classes) for d in devices], axis=0)
    for number, device in enumerate(devices):
        held = len(device.labelled)
        acquire(device, sampler, head, args.labels, args.passes, step + number, fleet)
        new = device.labelled[held:]
        calibration = calibration_sums(
            device.features[new].astype(np.float64) @ head.weight.T + head.bias, device.truth[new]
        )
        statistics = HeadStatistics.of_labels(
            device.features[device.labelled], device.truth[device.labelled], head.classes, calibration
        )
        updates.append(ClientUpdate(f"cam-{number}", statistics.tensors(), float(len(device.labelled))))
    return fitted_head(updates, head, fit)


def fitted_head(updates: list[ClientUpdate], head: Head, fit: PooledHead) -> Head:
    """pooled-head's classifier from the devices' statistics, their mean weighted by label count as the round
    aggregator's FedAvg gives it."""
    mean, _ = make_strategy("fedavg").aggregate({}, updates, None)
    fitted, _ = fit.fitted(mean, head.weights(), sum(update.num_samples for update in updates))
    return Head(*(fitted[name] for name in HEAD))


def pool_round(devices: list[Device], head: Head, fit: PooledHead) -> Head:
    """A round without acquisition under class-statistics' pool_statistics: every device sends its labels'
    statistics and its unlabelled pool's posterior sums under the round's head; pooled-head refines the class means
    with them (one EM step; ALGORITHMS.md section 7.10)."""
    updates = []
    for number, device in enumerate(devices):
        rows = device.features[device.pool()]
        pool = pool_posterior_sums(rows, rows.astype(np.float64) @ head.weight.T + head.bias)
        labelled = device.labelled
        statistics = HeadStatistics.of_labels(
            device.features[labelled], device.truth[labelled], head.classes, None, pool
        )
        updates.append(ClientUpdate(f"cam-{number}", statistics.tensors(), float(len(labelled))))
    return fitted_head(updates, head, fit)


def pooled(devices: list[Device]) -> tuple[np.ndarray, np.ndarray]:
    """Every device's human-labelled features and labels together (what a central learner would hold)."""
    return (
        np.concatenate([device.features[device.labelled] for device in devices]),
        np.concatenate([device.truth[device.labelled] for device in devices]),
    )


def logistic_regression(features: np.ndarray, labels: np.ndarray, classes: int, epochs: int, seed: int) -> Head:
    """The centralised probe: train_classifier from a zero head, no dropout, the recipe's SGD."""
    zero = Head(np.zeros((classes, FEATURES), np.float32), np.zeros(classes, np.float32))
    return zero.trained(features, labels, head_settings(epochs, 0.0, seed))


def run(fleet: dict[str, np.ndarray], sampler: str, seed: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    """One sampler and seed from W0 (the pretrained spec's fresh head): the federated and the centralised curve."""
    devices = [Device(fleet[f"features_{n}"], fleet[f"labels_{n}"], np.zeros(0, np.int64)) for n in range(args.devices)]
    test = test_set(fleet, args.devices)
    classifier = initial_model(lite0_spec(args.size, args.classes), seed).classifier()
    head = Head(classifier.weight.detach().numpy(), classifier.bias.detach().numpy())
    labels, federated, central, served = [], [], [], []
    fit = PooledHead(pool_labels=args.pool_labels)
    for round_id in range(1, args.rounds + 1):
        step = (seed * 1000 + round_id) * 100
        if sampler.startswith(POOLED):
            head = pooled_round(devices, sampler.removeprefix(POOLED), head, args, step, fit)
        elif sampler.startswith(POOLED_EM):
            head = pooled_round(devices, sampler.removeprefix(POOLED_EM), head, args, step, fit)
            head = pool_round(devices, head, fit)
        else:
            head = federated_round(devices, sampler, head, args, step)
        served.append(served_accuracies(devices, head, test))
        features, truth = pooled(devices)
        labels.append(len(truth))
        federated.append(round(head.accuracy(*test), 4))
        probe = logistic_regression(features, truth, head.classes, CENTRAL_EPOCHS, seed)
        central.append(round(probe.accuracy(*test), 4))
    counts = np.bincount(pooled(devices)[1], minlength=head.classes)
    base = {"sampler": sampler, "seed": seed, "labels": labels, "final_class_counts": counts.tolist()}
    weak = [np.mean(d.truth[d.weak[0]] == d.weak[1]) for d in devices if d.weak is not None]
    fast = {"weak_label_accuracy": round(float(np.mean(weak)), 4)} if weak else {}
    recall = {"final_class_recall": head.class_recall(*test)}
    return [
        {**base, **fast, **recall, "partition": "federated", "accuracy": federated, "served": served},
        {**base, "partition": "centralised", "accuracy": central},
    ]


def ceiling(fleet: dict[str, np.ndarray], seed: int, args: argparse.Namespace) -> dict[str, Any]:
    """Test accuracy, per-class accuracy and confusion of the centralised probe on every pool label of every device."""
    features = np.concatenate([fleet[f"features_{n}"] for n in range(args.devices)])
    labels = np.concatenate([fleet[f"labels_{n}"] for n in range(args.devices)])
    probe = logistic_regression(features, labels, len(args.classes), CEILING_EPOCHS, seed)
    test = test_set(fleet, args.devices)
    return {
        "accuracy": round(probe.accuracy(*test), 4),
        "recall": probe.class_recall(*test),
        "confusion": probe.confusion(*test),
    }


def test_set(fleet: dict[str, np.ndarray], devices: int) -> tuple[np.ndarray, np.ndarray]:
    """The test scenes' features and labels (stored after the devices')."""
    return fleet[f"features_{devices}"], fleet[f"labels_{devices}"]


def must_hold(summary: dict[str, dict[str, Any]], found: dict[str, Any], balanced: bool) -> dict[str, Any] | None:
    """The issue's checks on the camera default's federated curves: the AULC gain's 90% interval above +2 points
    (imbalanced pools) or above -0.5 (balanced), the reach within 50% of random's labels (imbalanced; the mean
    curve's), the mean curve above random's over the first three rounds (balanced), and the federated curve within
    5 points of the probe on the same labels in every round (mean over seeds)."""
    curves = summary["federated"]
    if CAMERA_DEFAULT not in curves or "random" not in curves:
        return None
    stats, low = found[CAMERA_DEFAULT]["federated"], found[CAMERA_DEFAULT]["federated"]["aulc_gain_interval"]["low"]
    share = curves[CAMERA_DEFAULT]["fraction_of_random_labels"]
    gaps = found[CAMERA_DEFAULT]["gap_to_probe"]["mean_gap_points"]
    early = np.subtract(curves[CAMERA_DEFAULT]["mean"][:3], curves["random"]["mean"][:3])
    checks = {
        "aulc_interval_low": low,
        "aulc_holds": low is not None and low > (-0.5 if balanced else 2.0),
        "probe_gap_holds": min(gaps) >= -5.0,
    }
    if balanced:
        checks["early_rounds_above_random"] = bool(np.all(early > 0))
    else:
        checks["labels_hold"] = share is not None and share <= 0.5
        checks["aulc_gain_mean_at_least_5"] = stats["aulc_gain_interval"]["mean"] >= 5.0
    return {"sampler": CAMERA_DEFAULT, "fraction_of_random_labels": share, **checks}


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
    """The fleet's shape and mix, the rounds, the samplers and seeds, where the cache and figures go."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2, 3, 4])
    parser.add_argument("--samplers", nargs="+", default=list(SAMPLERS))
    sizes = (("devices", 4), ("per-class", 150), ("test-per-class", 100), ("rounds", 10), ("labels", 10))
    for flag, default in (*sizes, ("epochs", HEAD_EPOCHS), ("passes", RECIPE.mc_passes), ("size", 96)):
        parser.add_argument(f"--{flag}", type=int, default=default)
    parser.add_argument("--min-steps", type=int, default=0, help="local SGD steps a device takes at least a round")
    parser.add_argument(
        "--logit-adjustment", type=float, default=1.0, help="kept-labels' tau on the devices (the camera path's 1)"
    )
    mix = parser.add_mutually_exclusive_group()
    mix.add_argument("--imbalance", type=float, default=1.0, help="commonest : rarest class in a pool (1: balanced)")
    mix.add_argument("--long-tail", type=float, help="pools whose class of rank r holds a share ~ r^-ALPHA")
    parser.add_argument(
        "--dirichlet", type=float, help="deal each class over the devices in Dirichlet(ALPHA) shares (non-IID)"
    )
    parser.add_argument("--classes", type=parse_classes, default=TEN_CLASSES, help="NAME=SOURCE,... (default: ten)")
    parser.add_argument("--jobs", type=int, default=1, help="processes running the seeds and samplers")
    parser.add_argument(
        "--pool-labels", type=float, default=POOL_LABELS, help="pooled-em: how many labels the pools weigh as, together"
    )
    parser.add_argument("--work", type=Path, default=Path("runs") / "camera-al", help="the feature cache's folder")
    parser.add_argument("--figures", type=Path, help="write curves.png, default_vs_random.png and table.md here")
    parser.add_argument("--setting", help="the setting's name in the table (default: from the mix and size)")
    parser.add_argument(
        "--features-only", action="store_true", help="render and embed the fleet into --work, then stop"
    )
    args = parser.parse_args()
    if not args.imbalance >= 1:
        parser.error(f"--imbalance is the commonest class's count over the rarest's, at least 1; got {args.imbalance}")
    if args.long_tail is not None and not args.long_tail > 0:
        parser.error(f"--long-tail is the power law's exponent, above 0; got {args.long_tail}")
    if args.dirichlet is not None and not args.dirichlet > 0:
        parser.error(f"--dirichlet is the concentration, above 0; got {args.dirichlet}")
    args.rule_recipe = messages.Recipe(options={"logit_adjustment": args.logit_adjustment})
    for spelling in (spelling for spelling in args.samplers if spelling != ORACLE):
        try:
            semi = spelling.startswith(SEMI)
            plain, recipe = rule_spelling(spelling.removeprefix(SEMI), args.rule_recipe) if semi else (spelling, None)
            if recipe is not None:
                PSEUDO_LABELS.semi_supervised(np.zeros((0, FEATURES)), recipe)
            recipe_options(plain.removeprefix(POOLED_EM).removeprefix(POOLED).removeprefix(FLEET_LEVEL), args.labels)
        except (KeyError, ValueError) as error:
            parser.error(f"--samplers {spelling[:60]!r}: {str(error)[:200]}")
    return args


def mix_of(args: argparse.Namespace) -> ClassMix:
    """The pools' class mix the flags ask for."""
    return (
        ClassMix("long-tail", args.long_tail) if args.long_tail is not None else ClassMix("geometric", args.imbalance)
    )


FLEET: dict[str, np.ndarray] = {}
"""The fleet's arrays in a worker process (forked from the parent, which loaded them)."""


def task(job: tuple[str, int, argparse.Namespace]) -> tuple[str, int, Any]:
    """One job of the sweep in a worker: a seed's ceiling (sampler "") or one sampler's runs."""
    sampler, seed, args = job
    started = time.perf_counter()
    result = ceiling(FLEET, seed, args) if not sampler else run(FLEET, sampler, seed, args)
    if sampler:
        progress(f"seed {seed} {sampler}: {result[0]['accuracy']} ({time.perf_counter() - started:.0f} s)")
    return sampler, seed, result


def one_thread() -> None:
    """A worker's torch on one thread (the processes share the cores)."""
    torch.set_num_threads(1)


def sweep(fleet: dict[str, np.ndarray], args: argparse.Namespace) -> tuple[list[dict[str, Any]], dict[int, Any]]:
    """Every seed's all-labels ceiling and every sampler's runs under it, in --jobs processes, with progress."""
    jobs = [(sampler, seed, args) for seed in args.seeds for sampler in ("", *args.samplers)]
    FLEET.update(fleet)
    if args.jobs > 1:
        with ProcessPoolExecutor(args.jobs, initializer=one_thread) as pool:
            done = list(pool.map(task, jobs))
    else:
        done = [task(job) for job in jobs]
    runs = [run for sampler, _, result in done if sampler for run in result]
    return runs, {seed: result for sampler, seed, result in done if not sampler}


def selection_seconds(fleet: dict[str, np.ndarray], args: argparse.Namespace) -> dict[str, Any]:
    """One acquisition of 10 by the camera default over 10000 cached rows (drawn from the pools with replacement,
    float16 as the feature cache stores them, read as float32), with a fresh head's 10 MC-dropout passes: in its
    TypiClust phase (no labels yet) and in its margin phase (20 and 40 labels, first_labels being 10); three tries
    each, and their median."""
    rng = np.random.default_rng(0)
    rows = np.concatenate([fleet[f"features_{n}"] for n in range(args.devices)])
    truth = np.concatenate([fleet[f"labels_{n}"] for n in range(args.devices)])
    drawn = rng.integers(len(rows), size=SELECTION_ROWS + 40)
    cached = rows[drawn].astype(np.float16)
    classifier = initial_model(lite0_spec(args.size, args.classes), 0).classifier()
    head = Head(classifier.weight.detach().numpy(), classifier.bias.detach().numpy())
    seconds = {}
    _, options = recipe_options(CAMERA_DEFAULT, args.labels)
    for held in (0, 20, 40):
        device = Device(cached.astype(np.float32), truth[drawn], np.arange(SELECTION_ROWS, SELECTION_ROWS + held))
        tries = []
        for attempt in range(3):
            started = time.perf_counter()
            context = context_of(device, np.arange(SELECTION_ROWS), head, options, RECIPE.mc_passes, attempt)
            make_sampler(CAMERA_DEFAULT).choose(context, 10)
            tries.append(round(time.perf_counter() - started, 3))
        seconds[f"labels_held_{held}"] = {"median": float(np.median(tries)), "tries": tries}
    return {"sampler": CAMERA_DEFAULT, "rows": SELECTION_ROWS, "threads": torch.get_num_threads(), **seconds}


def setting_name(args: argparse.Namespace) -> str:
    """The setting as the table names it: the mix and the input size."""
    mix = mix_of(args)
    shown = (
        "balanced"
        if mix.balanced
        else (f"long tail {mix.value:g}" if mix.kind == "long-tail" else f"imbalanced {mix.value:g}:1")
    )
    dealt = "" if args.dirichlet is None else f", Dirichlet {args.dirichlet:g}"
    return args.setting or f"{shown}, {args.size} px{dealt}"


def main() -> None:
    """Features once (cached), every sampler and seed, the summary, intervals and must-holds as one JSON object."""
    args = parse_args()
    shape = FleetShape(args.devices, args.per_class, args.test_per_class, args.size, classes=args.classes)
    mix = mix_of(args)
    fleet, extraction = mixed_features(shape, mix, args.work)
    if args.features_only:
        print(json.dumps({"fleet": {**asdict(shape), "mix": asdict(mix)}, "extraction": extraction}))
        return
    if args.dirichlet is not None:
        fleet = redealt(fleet, args.devices, args.dirichlet, shape.seed)
    timing = {f"{size}px_ms_per_image": extraction_ms(size) for size in (96, 160)}
    selection = selection_seconds(fleet, args)
    progress(f"selection over {SELECTION_ROWS} cached rows: {selection}")
    runs, ceilings = sweep(fleet, args)
    summary, found = summarise(runs), intervals(runs)
    rows = table(setting_name(args), summary, found)
    if args.figures:
        args.figures.mkdir(parents=True, exist_ok=True)
        (args.figures / "table.md").write_text(f"{TABLE_HEAD}\n{rows}\n")
        names = [scene.name for scene in args.classes]
        figures(summary, args.figures, CAMERA_DEFAULT, class_recalls(runs), names)
    settings = {
        key: (str(value) if isinstance(value, Path) else value)
        for key, value in vars(args).items()
        if key != "rule_recipe"
    }
    result = {
        "fleet": {**asdict(shape), "mix": asdict(mix)},
        "settings": {**settings, "classes": [[scene.name, scene.source] for scene in args.classes]},
        "extraction": {**extraction, **timing, "threads": torch.get_num_threads()},
        "selection_seconds": selection,
        "ceiling_all_labels": {seed: found_ceiling["accuracy"] for seed, found_ceiling in ceilings.items()},
        "ceiling_class_recall": {seed: found_ceiling["recall"] for seed, found_ceiling in ceilings.items()},
        "ceiling_confusion": {seed: found_ceiling["confusion"] for seed, found_ceiling in ceilings.items()},
        "summary": summary,
        "intervals": found,
        "must_hold": must_hold(summary, found, mix.balanced) if args.dirichlet is None else None,  # asked of IID fleets
        "table": f"{TABLE_HEAD}\n{rows}",
        "final_class_recall": class_recalls(runs),
        "runs": runs,
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
