# The server's data: its labelled images split into W0's samples, the selection split and the rest; W0; the field's
# test set; the evaluator.
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from coordinator.labelling.field_set import read_field_set
from coordinator.rounds.closing import RoundEvaluator
from coordinator.rounds.evaluation import Evaluator, LabelledSplit
from coordinator.rounds.holdout import server_holdout, split_sizes
from coordinator.rounds.serving import W0_ACCURACY, W0_CLASS_ACCURACY
from coordinator.setup.settings import ServerSettings
from coordinator.setup.site_images import DEFAULT_SEED, DEFAULT_TEST_SHARE, build_site_dataset, is_image_source
from coordinator.setup.site_report import headline
from coordinator.storage.pretrained import merge_initial_weights, read_weight_file
from coordinator.storage.store import RunStore
from coordinator.strategies.registry import STRATEGIES, make_strategy
from edge_agent.data.fashion_mnist import load_fashion_mnist
from edge_agent.data.image_arrays import ImageDataset, as_model_input, load_npz_dataset
from edge_agent.data.image_files import InputSpec, UnreadableImageError, decode_image
from edge_agent.learning.mc_dropout import predict_features
from edge_agent.learning.models import get_weights, set_weights
from edge_agent.learning.pretrained_backbone import initial_model
from edge_agent.learning.training import TrainSettings, train_supervised
from protocol.errors import UsageError
from protocol.head_statistics import HeadStatistics
from protocol.model_spec import CLASS_NAMES, ModelSpec
from protocol.tensors import Weights

log = logging.getLogger(__name__)

FEATURE_BATCH = 64  # server images through the backbone at once, for their head statistics


@dataclass(frozen=True)
class ServerData:
    """The dataset and the server's share of it: W0 samples, the selection split, and what is left for devices."""

    dataset: ImageDataset
    init_indices: np.ndarray
    validation_indices: np.ndarray
    device_indices: np.ndarray


def load_server_data(settings: ServerSettings) -> ServerData:
    """Loads the data set (a fleet's own .npz, else Fashion-MNIST) and reserves the server's init and validation
    samples from its training split."""
    spec = settings.spec
    if settings.dataset is not None and is_image_source(settings.dataset):
        dataset = photos_dataset(settings.dataset, spec)
    elif settings.dataset is not None:
        dataset = load_npz_dataset(settings.dataset, spec.image_shape, spec.num_classes)
    elif spec.image_shape != (28, 28) or spec.num_classes != len(CLASS_NAMES):
        raise UsageError(
            "a model spec other than 28x28 grey with 10 classes needs --dataset (an .npz, a photo folder or a CSV)"
        )
    else:
        dataset = load_fashion_mnist(settings.data_dir)
    selects = make_strategy(settings.strategy, **settings.strategy_options).needs_evaluation
    sizes = split_sizes(
        len(dataset.train_labels),
        settings.init.samples,
        settings.validation_samples,
        selects,
        settings.dataset is not None,
    )
    rng = np.random.default_rng(settings.init.seed)
    init, validation, rest = server_holdout(dataset.train_labels, sizes.init, sizes.validation, rng, spec.num_classes)
    return ServerData(dataset, init, validation, rest)


def photos_dataset(source: Path, spec: ModelSpec) -> ImageDataset:
    """A folder tree or CSV given as --dataset, built in memory as `fl-coordinator dataset` builds it with its
    default split; what was left out is logged (that command writes the per-file report)."""
    site = build_site_dataset(source, spec, "the model spec", DEFAULT_TEST_SHARE, DEFAULT_SEED)
    log.info("dataset built source=%s %s", source, headline(site))
    left_out = site.left_out()
    if left_out:
        log.warning(
            "dataset files left out source=%s count=%d first=%s reason=%s (fl-coordinator dataset reports each)",
            source,
            len(left_out),
            left_out[0].file[:80],
            left_out[0].reason,
        )
    return site.dataset


def split_line(settings: ServerSettings, data: ServerData) -> str:
    """The start-up line saying how the server's labelled images were split, and why."""
    source = settings.dataset.name if settings.dataset is not None else "Fashion-MNIST"
    train, selection = len(data.init_indices), len(data.validation_indices)
    selects = make_strategy(settings.strategy, **settings.strategy_options).needs_evaluation
    kept = selection_words(settings.strategy, selects, selection)
    rest = f"; {len(data.device_indices)} left for simulated devices" if len(data.device_indices) else ""
    return (
        f"server data: W0 trains on {train} of {source}'s {len(data.dataset.train_labels)} labelled images, {kept}"
        f"{rest}; accuracy is measured on {evaluated_count(settings, data)} test images "
        "(--init-samples, --validation-samples override)"
    )


def evaluation_line(settings: ServerSettings, data: ServerData) -> str:
    """The start-up line saying what the coordinator measures after each round, and what --no-device-eval changes
    (nothing under a statistics strategy, whose devices send no model)."""
    tested = f"after each round the global model is measured on {evaluated_count(settings, data)} test images"
    if STRATEGIES.get(settings.strategy).statistics:
        return f"{tested}; devices send class statistics, no model of their own to measure"
    if settings.evaluate_devices:
        return f"{tested}, and so is each device's model (one more pass a device; --no-device-eval skips them)"
    return f"{tested}; devices' own models are not (--no-device-eval)"


def selection_words(strategy: str, selects: bool, count: int) -> str:
    """What the split line says of the selection split: kept for a strategy that picks its model on it, else
    set aside unused (a flag asked for it) or none."""
    if selects:
        return f"{count} kept as the selection split {strategy} picks its model on"
    if count:
        return f"{count} set aside as a selection split {strategy} does not use"
    return f"none kept for selection ({strategy} picks no model on one)"


def evaluated_count(settings: ServerSettings, data: ServerData) -> int:
    """How many test images every accuracy is measured on (the first --test-samples, else all)."""
    return min(settings.test_samples or len(data.dataset.test_labels), len(data.dataset.test_labels))


def initial_weights(settings: ServerSettings, data: ServerData) -> Weights:
    """W0: a seeded model (its pretrained backbone and the spec's initial weights file, if any) trained on the balanced init samples
    (no training when there are none)."""
    model = initial_model(settings.spec, seed=settings.init.seed)
    if settings.initial_weights is not None:
        found = read_weight_file(settings.initial_weights)
        set_weights(
            model,
            merge_initial_weights(get_weights(model), found, model.classifier_layer, str(settings.initial_weights)),
        )
    if len(data.init_indices):
        init = settings.init
        train_supervised(
            model,
            data.dataset.train_images[data.init_indices],
            data.dataset.train_labels[data.init_indices],
            TrainSettings(
                init.epochs, init.batch_size, init.learning_rate, 0.0, init.weight_decay, init.seed, init.optimizer
            ),
        )
    return get_weights(model)


def server_label_statistics(settings: ServerSettings, data: ServerData, weights: Weights) -> HeadStatistics | None:
    """The head statistics of the server's labelled images (W0's), summed as a device's class-statistics rule sums
    its labels: the classifier's input features under `weights` (the run's model: its frozen backbone is the
    devices'); None when the server holds none. A statistics strategy folds them into every fit."""
    if not len(data.init_indices):
        return None
    model = initial_model(settings.spec, seed=settings.init.seed)
    set_weights(model, weights)
    inputs = as_model_input(data.dataset.train_images[data.init_indices])
    features = predict_features(model, inputs, FEATURE_BATCH)
    labels = data.dataset.train_labels[data.init_indices]
    return HeadStatistics.of_labels(features, labels, settings.spec.num_classes)


class FieldSet:
    """The field's test set of a run's labelling queue (RUN_DIR/labelling), read as it stands at each call: each
    image decoded as the server's own images are (`decode_image` at the spec's input) once, and kept by its key for
    as long as it stays in the set. An image that cannot be read (its query pruned meanwhile) is left out. With
    `window` N > 0 the set is the newest N answers (by when they were answered)."""

    def __init__(self, run_dir: Path, spec: InputSpec, window: int = 0) -> None:
        self.run_dir = Path(run_dir)
        self.spec = spec
        self.window = window
        self.images: dict[str, np.ndarray] = {}

    def __call__(self) -> tuple[list[str], np.ndarray, np.ndarray]:
        """(keys, uint8 images at the spec's input, labels) of the field set now, oldest answer first."""
        answers = read_field_set(self.run_dir)
        answers = answers[-self.window :] if self.window else answers
        kept: dict[str, np.ndarray] = {}
        labels: list[int] = []
        for answer in answers:
            image = self.images.get(answer.key)
            if image is None:
                try:
                    image = decode_image(answer.path, self.spec)
                except UnreadableImageError as error:
                    log.debug("field image left out key=%s reason=%s", answer.key[:120], error)
                    continue
            kept[answer.key] = image
            labels.append(answer.label)
        self.images = kept
        stacked = np.stack(list(kept.values())) if kept else np.zeros((0, *self.spec.record_shape), dtype=np.uint8)
        return list(kept), stacked, np.array(labels, dtype=np.int64)


def build_evaluator(settings: ServerSettings, data: ServerData) -> Evaluator:
    """Test split (all of it unless test_samples says otherwise), the BNN selection split, and the field set of the
    run's labelling queue (empty while the run keeps none)."""
    test_count = evaluated_count(settings, data)
    test = LabelledSplit.from_uint8(data.dataset.test_images[:test_count], data.dataset.test_labels[:test_count])
    selection = LabelledSplit.from_uint8(
        data.dataset.train_images[data.validation_indices], data.dataset.train_labels[data.validation_indices]
    )
    spec = settings.spec
    field = FieldSet(
        settings.run_dir, InputSpec(spec.channels, spec.height, spec.width), settings.promotion.field_window
    )
    return Evaluator(spec, test, selection, settings.selection_passes, settings.init.seed, field)


def w0_accuracy(store: RunStore, evaluator: RoundEvaluator, weights: Weights, first_round: int) -> float | None:
    """W0's test accuracy: measured (with each class's) and kept in the run's config before round 1, read back when a run resumes (None for a run stored before it was kept)."""
    config = store.config() or {}
    if W0_ACCURACY not in config and first_round == 1:
        scores = evaluator.test_scores(weights)
        config[W0_ACCURACY], config[W0_CLASS_ACCURACY] = scores.accuracy, scores.per_class
        store.set_config(config)
    return config.get(W0_ACCURACY)


def w0_line(accuracy: float | None, labels: int) -> str:
    """The start-up line of W0's test accuracy and the labels it was trained on."""
    measured = "not measured in this run's store" if accuracy is None else f"{accuracy:.4f}"
    return f"W0 test accuracy {measured} (trained on the server's {labels} labelled images)"
