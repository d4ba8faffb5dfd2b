# The trained set: the tensors of a model its spec trains, which is all an update carries and a round aggregates.
from __future__ import annotations

from protocol import head_statistics
from protocol.errors import UsageError
from protocol.model_spec import ModelSpec, trainable_names
from protocol.tensors import Weights

STATISTICS_RULE = "class-statistics"  # the local rule whose updates carry head statistics instead of trained tensors
POOL_STATISTICS = "pool_statistics"  # its option: the updates carry the pool's posterior sums too


def trained_set(spec: ModelSpec, weights: Weights) -> Weights:
    """The tensors of a whole model (or of its update) that the spec trains, in the model's order: what a device's
    update carries, what validation expects and what a round aggregates (and what masks and clipping work on); the
    rest (a frozen backbone) never travels and stays as the round's model has it."""
    return {name: weights[name] for name in trainable_names(spec, weights)}


def with_trained(model: Weights, trained: Weights) -> Weights:
    """The whole model with its trained tensors replaced, in the model's order: the frozen rest are the model's own
    arrays, untouched by construction. ValueError for a tensor the model lacks."""
    stray = sorted(set(trained) - set(model))
    if stray:
        raise ValueError(f"{len(stray)} trained tensor(s) the model lacks, e.g. {stray[0][:64]!r}")
    return {name: trained.get(name, array) for name, array in model.items()}


def head_shape(trained: Weights) -> tuple[int, int]:
    """(classes, features) of a trained set that is one linear classifier (a weight and a bias); UsageError else."""
    weights = [array for array in trained.values() if array.ndim == 2]
    biases = [array for array in trained.values() if array.ndim == 1]
    if len(trained) != 2 or len(weights) != 1 or len(biases) != 1 or weights[0].shape[0] != biases[0].shape[0]:
        raise UsageError(f"{STATISTICS_RULE} needs a spec that trains the classifier alone (one weight, one bias)")
    classes, features = weights[0].shape
    return int(classes), int(features)


def update_base(spec: ModelSpec, model: Weights, local_rule: str) -> Weights:
    """What a round's updates carry, at no change: the model's trained set, or zero head statistics when the round's
    local rule sends statistics (the layout validation expects, masks cover, clipping bounds and a round sums)."""
    trained = trained_set(spec, model)
    if local_rule != STATISTICS_RULE:
        return trained
    return head_statistics.layout(*head_shape(trained))
