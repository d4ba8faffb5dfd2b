# The three kinds of method a run chooses, by registry: the devices' samplers and local rules, the strategies.
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from coordinator.strategies.registry import STRATEGIES
from edge_agent.learning.local_rules import LOCAL_RULES
from edge_agent.learning.sampling import SAMPLERS
from protocol import messages
from protocol.options import Registry


@dataclass(frozen=True)
class MethodKind:
    """One registry as the command line sees it: its flag, its default and where its options go."""

    label: str
    flag: str
    default: str
    registry: Registry[Any]
    in_recipe: bool

    @property
    def dest(self) -> str:
        """The argparse destination of the kind's flag (e.g. local_rule)."""
        return self.flag.removeprefix("--").replace("-", "_")


def method_kinds() -> tuple[MethodKind, ...]:
    """The three kinds of method a run chooses, read from their registries at call time (so tests may add one)."""
    return (
        MethodKind("sampler", "--sampler", messages.Recipe.sampler, SAMPLERS, True),
        MethodKind("local rule", "--local-rule", messages.Recipe.local_rule, LOCAL_RULES, True),
        MethodKind("strategy", "--strategy", "avefl", STRATEGIES, False),
    )
