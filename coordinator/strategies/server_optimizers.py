# Server optimisers over the round's pseudo-gradient (Reddi et al., ICLR 2021; Hsu et al. 2019): pure numpy.
from __future__ import annotations

from collections.abc import Callable

import numpy as np

from protocol.tensors import Weights

SecondMoment = Callable[[np.ndarray, np.ndarray, float], np.ndarray]


def pseudo_gradient(base: Weights, aggregate: Weights) -> Weights:
    """Delta_t = aggregate - x_t per tensor in float64: the direction the round's average moved the global model."""
    if set(base) != set(aggregate):
        raise ValueError("the aggregate and the global model differ in tensor names")
    return {name: aggregate[name].astype(np.float64) - base[name].astype(np.float64) for name in base}


def applied(base: Weights, steps: Weights) -> Weights:
    """x_t + step per tensor, cast back to the global model's dtypes."""
    return {name: (base[name].astype(np.float64) + steps[name]).astype(base[name].dtype) for name in base}


def momentum_step(base: Weights, delta: Weights, momentum: Weights, lr: float, beta: float) -> tuple[Weights, Weights]:
    """FedAvgM: m_t = beta m_{t-1} + Delta_t, x_{t+1} = x_t + lr m_t; an absent momentum starts at 0.
    With lr = 1 and beta = 0 this is plain averaging; lr = 1 - beta keeps FedAvg's step in the steady state."""
    following = {name: beta * momentum.get(name, 0.0) + delta[name] for name in delta}
    return applied(base, {name: lr * value for name, value in following.items()}), following


def adagrad_moment(v: np.ndarray, squared: np.ndarray, beta2: float) -> np.ndarray:
    """FedAdagrad: v_t = v_{t-1} + Delta_t^2 (beta2 unused)."""
    return v + squared


def adam_moment(v: np.ndarray, squared: np.ndarray, beta2: float) -> np.ndarray:
    """FedAdam: v_t = beta2 v_{t-1} + (1 - beta2) Delta_t^2."""
    return beta2 * v + (1.0 - beta2) * squared


def yogi_moment(v: np.ndarray, squared: np.ndarray, beta2: float) -> np.ndarray:
    """FedYogi: v_t = v_{t-1} - (1 - beta2) Delta_t^2 sign(v_{t-1} - Delta_t^2) (v grows no faster than Adam's)."""
    return v - (1.0 - beta2) * squared * np.sign(v - squared)


def adaptive_step(
    base: Weights,
    delta: Weights,
    moments: Weights,
    second_moment: SecondMoment,
    hyper: tuple[float, float, float, float],
) -> tuple[Weights, Weights]:
    """One FedOpt step (Reddi et al., Algorithm 2): m_t = b1 m + (1 - b1) Delta, v_t = second_moment(v, Delta^2),
    x_{t+1} = x_t + lr m_t / (sqrt(v_t) + tau). `moments` holds 'm.NAME' and 'v.NAME' (m starts at 0, v at tau^2,
    as the paper's v_{-1} >= tau^2); `hyper` is (lr, beta1, beta2, tau). Returns the new model and moments."""
    lr, beta1, beta2, tau = hyper
    following: Weights = {}
    steps: Weights = {}
    for name, change in delta.items():
        m = beta1 * moments.get(f"m.{name}", 0.0) + (1.0 - beta1) * change
        v = second_moment(moments.get(f"v.{name}", np.full_like(change, tau * tau)), change * change, beta2)
        following[f"m.{name}"], following[f"v.{name}"] = m, v
        steps[name] = lr * m / (np.sqrt(v) + tau)
    return applied(base, steps), following
