# The trained set: the tensors of a model its spec trains, which is all an update carries and a round aggregates.
from __future__ import annotations

from protocol.model_spec import ModelSpec, trainable_names
from protocol.tensors import Weights


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
