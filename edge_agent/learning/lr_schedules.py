# Learning-rate schedules of one round's local training, as pure functions both trainers (torch, numpy) share.
from __future__ import annotations

import math

LR_SCHEDULES = ("constant", "cosine")


def schedule_problem(schedule: str) -> str | None:
    """Why a recipe's learning-rate schedule cannot be followed (a name this device does not know), or None."""
    if schedule in LR_SCHEDULES:
        return None
    return f"unknown learning-rate schedule {schedule[:40]!r}; known: {', '.join(LR_SCHEDULES)}"


def lr_factor(schedule: str, step: int, total_steps: int) -> float:
    """The multiple of the recipe's learning rate for mini-batch `step` (0-based) of a round's `total_steps`.

    constant: 1. cosine: 0.5 (1 + cos(pi step / total)), from 1 at the round's first step down towards 0 at its
    last, restarting each round from the received global model (SGDR's warm restart, one cycle per round).
    """
    problem = schedule_problem(schedule)
    if problem is not None:
        raise ValueError(problem)
    if schedule == "constant" or total_steps <= 0:
        return 1.0
    return 0.5 * (1.0 + math.cos(math.pi * min(step, total_steps) / total_steps))
