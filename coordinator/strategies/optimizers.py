# The server optimisers (Reddi et al., "Adaptive Federated Optimization"): FedAvg's average as a pseudo-gradient,
# then a FedAvgM, FedAdam, FedYogi or FedAdagrad step from the global model.
from __future__ import annotations

from abc import abstractmethod
from collections.abc import Sequence
from typing import Any

import numpy as np

from coordinator.strategies.aggregate import ClientUpdate, RunningSum
from coordinator.strategies.contract import Evaluate
from coordinator.strategies.means import FedAvg
from coordinator.strategies.server_optimizers import (
    adagrad_moment,
    adam_moment,
    adaptive_step,
    momentum_step,
    pseudo_gradient,
    yogi_moment,
)
from protocol.dp import l2_norm
from protocol.options import Option
from protocol.tensors import Weights


class ServerOptimizer(FedAvg):
    """FedAvg's sample-weighted average as a pseudo-gradient, then a server optimiser's step from the global model
    (Reddi et al., "Adaptive Federated Optimization"); its moments are committed with every round."""

    def __init__(self, **options: float) -> None:
        self.hyper = {option.key: float(options.get(option.key, option.default)) for option in self.options}
        self.moments: Weights = {}
        self.rounds = 0

    @abstractmethod
    def step(self, base: Weights, delta: Weights) -> Weights:
        """The next global model from the current one and the pseudo-gradient; updates self.moments."""

    def aggregate(
        self, global_weights: Weights, updates: Sequence[ClientUpdate], evaluate: Evaluate | None
    ) -> tuple[Weights, dict[str, Any]]:
        """The server step toward the weighted average of the updates."""
        return self.server_step(global_weights, *super().aggregate(global_weights, updates, evaluate))

    def finish(self, running: RunningSum, base: Weights) -> tuple[Weights, dict[str, Any]]:
        """The server step toward the streamed weighted average."""
        return self.server_step(base, *super().finish(running, base))

    def server_step(self, base: Weights, averaged: Weights, report: dict[str, Any]) -> tuple[Weights, dict[str, Any]]:
        """Steps and reports the step's size next to the pseudo-gradient's (both L2 over every tensor)."""
        delta = pseudo_gradient(base, averaged)
        following = self.step(base, delta)
        self.rounds += 1
        sizes = {
            "pseudo_gradient_norm": l2_norm(delta),
            "step_norm": l2_norm(pseudo_gradient(base, following)),
            "server_steps": self.rounds,
        }
        return following, {**report, "server_optimizer": sizes}

    def state(self) -> dict[str, Any]:
        """How many steps were taken (the moments travel as tensors())."""
        return {"rounds": self.rounds}

    def tensors(self) -> Weights:
        """The optimiser's moments, float64."""
        return dict(self.moments)

    def load_state(self, state: dict[str, Any], tensors: Weights) -> None:
        """Restores the step count and the moments; a malformed state is a ValueError."""
        rounds = state.get("rounds") if isinstance(state, dict) else None
        if not isinstance(rounds, int) or isinstance(rounds, bool) or rounds < 0:
            raise ValueError(f"strategy {self.name!r}: stored state needs a non-negative 'rounds', got {state!r:.80}")
        self.rounds = rounds
        self.moments = {name: np.asarray(array, dtype=np.float64) for name, array in tensors.items()}


SERVER_LR_HELP = "server learning rate (eta)"


class FedAvgM(ServerOptimizer):
    """Hsu et al.'s FedAvgM: server momentum over the rounds' pseudo-gradients."""

    name = "fedavgm"
    summary = "FedAvg with server momentum (Hsu et al. 2019)"
    options = (
        Option("server_lr", float, 1.0, SERVER_LR_HELP, low=0.0, flag="--server-lr"),
        Option("server_momentum", float, 0.5, "server momentum beta", 0.0, 1.0, high_open=True),
    )

    def step(self, base: Weights, delta: Weights) -> Weights:
        """momentum_step with the declared lr and beta."""
        following, self.moments = momentum_step(
            base, delta, self.moments, self.hyper["server_lr"], self.hyper["server_momentum"]
        )
        return following


class AdaptiveServerOptimizer(ServerOptimizer):
    """FedAdam, FedYogi and FedAdagrad: one adaptive step; each declares its second-moment rule."""

    @abstractmethod
    def second_moment(self, v: np.ndarray, squared: np.ndarray, beta2: float) -> np.ndarray:
        """The next second moment v_t from v_{t-1} and Delta_t^2 (the rule that tells the three apart)."""

    def step(self, base: Weights, delta: Weights) -> Weights:
        """adaptive_step with this class's second-moment rule and its declared hyperparameters."""
        hyper = (self.hyper["server_lr"], self.hyper["beta1"], self.hyper.get("beta2", 0.0), self.hyper["tau"])
        following, self.moments = adaptive_step(base, delta, self.moments, self.second_moment, hyper)
        return following


def adaptive_options(lr: float, tau: float, decays_v: bool = True) -> tuple[Option, ...]:
    """The hyperparameters of an adaptive server optimiser with its defaults for lr and tau; beta2 only where the
    second moment decays (not Adagrad's, which only grows)."""
    beta2 = Option("beta2", float, 0.99, "second-moment decay", 0.0, 1.0, high_open=True, flag="--server-beta2")
    return (
        Option("server_lr", float, lr, SERVER_LR_HELP, low=0.0, flag="--server-lr"),
        Option("beta1", float, 0.9, "first-moment decay", 0.0, 1.0, high_open=True, flag="--server-beta1"),
        *((beta2,) if decays_v else ()),
        Option("tau", float, tau, "adaptivity (added to sqrt v)", low=1e-12, flag="--server-tau"),
    )


class FedAdam(AdaptiveServerOptimizer):
    """Reddi et al.'s FedAdam."""

    name = "fedadam"
    summary = "FedAvg's pseudo-gradient through a server Adam step (Reddi et al. 2021)"
    options = adaptive_options(0.003, 1e-3)

    def second_moment(self, v: np.ndarray, squared: np.ndarray, beta2: float) -> np.ndarray:
        """adam_moment."""
        return adam_moment(v, squared, beta2)


class FedYogi(AdaptiveServerOptimizer):
    """Reddi et al.'s FedYogi."""

    name = "fedyogi"
    summary = "FedAvg's pseudo-gradient through a server Yogi step (Reddi et al. 2021)"
    options = adaptive_options(0.003, 1e-3)

    def second_moment(self, v: np.ndarray, squared: np.ndarray, beta2: float) -> np.ndarray:
        """yogi_moment."""
        return yogi_moment(v, squared, beta2)


class FedAdagrad(AdaptiveServerOptimizer):
    """Reddi et al.'s FedAdagrad."""

    name = "fedadagrad"
    summary = "FedAvg's pseudo-gradient through a server Adagrad step (Reddi et al. 2021)"
    options = adaptive_options(0.03, 1e-2, decays_v=False)

    def second_moment(self, v: np.ndarray, squared: np.ndarray, beta2: float) -> np.ndarray:
        """adagrad_moment."""
        return adagrad_moment(v, squared, beta2)
