# The local learning-rate schedule: its factors, the torch loop and the numpy head trainer following it, the wire.
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from torch import nn

from edge_agent.data.image_arrays import model_input
from edge_agent.learning.head_training import HeadSettings, train_classifier
from edge_agent.learning.lr_schedules import lr_factor, schedule_problem
from edge_agent.learning.training import TrainSettings, run_epochs
from protocol import messages, wire


def test_constant_is_one_and_cosine_falls_from_one_through_a_half_to_zero() -> None:
    assert [lr_factor("constant", step, 8) for step in range(9)] == [1.0] * 9
    cosine = [lr_factor("cosine", step, 8) for step in range(9)]
    assert cosine[0] == 1.0 and cosine[4] == pytest.approx(0.5) and cosine[8] == pytest.approx(0.0)
    assert cosine[2] == pytest.approx(0.5 * (1 + np.cos(np.pi / 4)))
    assert all(later < earlier for earlier, later in zip(cosine, cosine[1:]))


def test_an_unknown_schedule_is_refused_by_name_in_a_bounded_message() -> None:
    assert schedule_problem("cosine") is None
    problem = schedule_problem("step" * 10_000)
    assert problem is not None and problem.endswith("known: constant, cosine") and len(problem) < 120
    with pytest.raises(ValueError, match="unknown learning-rate schedule 'linear'"):
        TrainSettings(epochs=1, batch_size=4, learning_rate=0.1, lr_schedule="linear")


def reference_sgd(model: nn.Module, images: np.ndarray, labels: np.ndarray, seed: int, rates: list[float]) -> None:
    """Plain SGD with momentum over the loop's shuffled batches, the learning rate set by hand before each step."""
    inputs, targets = torch.from_numpy(model_input(images)), torch.from_numpy(labels)
    optimizer = torch.optim.SGD(model.parameters(), lr=rates[0], momentum=0.9)
    generator, step = torch.Generator().manual_seed(seed), 0
    for _ in range(2):
        order = torch.randperm(len(inputs), generator=generator)
        for start in range(0, len(order), 4):
            batch = order[start : start + 4]
            for group in optimizer.param_groups:
                group["lr"] = rates[step]
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(inputs[batch]), targets[batch]).backward()
            optimizer.step()
            step += 1


@pytest.mark.parametrize("schedule", ["constant", "cosine"])
def test_the_torch_loop_steps_the_learning_rate_per_mini_batch_as_the_schedule_says(schedule: str) -> None:
    rng = np.random.default_rng(0)
    images, labels = rng.integers(0, 256, (10, 28, 28), dtype=np.uint8), rng.integers(0, 3, 10)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(784, 3))
    reference, at_constant_rate = (nn.Sequential(nn.Flatten(), nn.Linear(784, 3)) for _ in range(2))
    reference.load_state_dict(model.state_dict())
    at_constant_rate.load_state_dict(model.state_dict())
    settings = TrainSettings(epochs=2, batch_size=4, learning_rate=0.5, momentum=0.9, seed=7, lr_schedule=schedule)
    run_epochs([model], images, labels, settings, lambda x, y: nn.functional.cross_entropy(model(x), y))
    steps = 2 * 3  # batches of 4, 4 and 2 in each of two epochs
    reference_sgd(reference, images, labels, 7, [0.5 * lr_factor(schedule, step, steps) for step in range(steps)])
    for ours, theirs in zip(model.parameters(), reference.parameters()):
        assert torch.allclose(ours, theirs, atol=1e-6)
    reference_sgd(at_constant_rate, images, labels, 7, [0.5] * steps)
    assert (schedule == "constant") == torch.allclose(model[1].weight, at_constant_rate[1].weight, atol=1e-6)


def test_the_numpy_head_trainer_follows_the_cosine_schedule_as_torch_lambda_lr_does() -> None:
    rng = np.random.default_rng(3)
    features, labels = rng.normal(size=(12, 5)).astype(np.float32), rng.integers(0, 3, 12)
    weight, bias = rng.normal(size=(3, 5)).astype(np.float32), rng.normal(size=3).astype(np.float32)
    settings = HeadSettings(epochs=4, batch_size=12, learning_rate=0.1, momentum=0.9, lr_schedule="cosine")
    new_weight, new_bias, _ = train_classifier(features, labels, weight, bias, settings)
    layer = nn.Linear(5, 3).double()
    with torch.no_grad():
        layer.weight.copy_(torch.from_numpy(weight.astype(np.float64)))
        layer.bias.copy_(torch.from_numpy(bias.astype(np.float64)))
    optimiser = torch.optim.SGD(layer.parameters(), lr=0.1, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimiser, T_max=4)
    for _ in range(4):
        optimiser.zero_grad()
        nn.functional.cross_entropy(layer(torch.from_numpy(features).double()), torch.from_numpy(labels)).backward()
        optimiser.step()
        scheduler.step()
    assert np.allclose(new_weight, layer.weight.detach().numpy(), atol=1e-5)
    assert np.allclose(new_bias, layer.bias.detach().numpy(), atol=1e-5)
    constant = dataclasses.replace(settings, lr_schedule="constant")
    assert not np.allclose(train_classifier(features, labels, weight, bias, constant)[0], new_weight, atol=1e-4)


def test_the_schedule_travels_in_the_round_recipe_and_is_left_out_of_it_at_its_default() -> None:
    def announced(recipe: messages.Recipe) -> bytes:
        return wire.encode(messages.RoundAnnouncement("run", 1, "0" * 64, recipe, 0.0))

    cosine = messages.Recipe(lr_schedule="cosine")
    assert wire.decode(announced(cosine), messages.RoundAnnouncement).recipe.lr_schedule == "cosine"
    assert b"lr_schedule" not in announced(messages.Recipe()) and b"lr_schedule" in announced(cosine)
    assert TrainSettings.from_recipe(cosine, seed=1).lr_schedule == "cosine"
