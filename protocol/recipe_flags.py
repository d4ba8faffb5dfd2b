# The round recipe's flags declared once, on the recipe's own fields: flag, help, range or the registry of choices.
from __future__ import annotations

import dataclasses
import typing
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from protocol.errors import UsageError
from protocol.options import Option

FLAG_KEY = "recipe_flag"
OMITTED_KEY = "omitted_at_default"  # the field metadata key protocol.wire reads


@dataclass(frozen=True)
class RecipeFlag:
    """How the command line sets one recipe field: its help, its flag (default --NAME with '_' as '-'), its range
    (numbers) or `choices`, the name of the registry its valid values come from (strings), which also names the
    value in messages ('unknown sampler ...'). The field's type and default are the dataclass field's own."""

    help: str
    flag: str = ""
    low: float | None = None
    high: float | None = None
    high_open: bool = False
    choices: str = ""


def recipe_field(default: Any, help: str, *, omitted_at_default: bool = False, **flag: Any) -> Any:
    """A recipe dataclass field with its flag declared beside its default. `omitted_at_default` leaves the field out
    of the message while it holds its default, so recipes that do not use it keep the bytes they had before it."""
    metadata: dict[str, Any] = {FLAG_KEY: RecipeFlag(help, **flag)}
    if omitted_at_default:
        metadata[OMITTED_KEY] = True
    return dataclasses.field(default=default, metadata=metadata)


@dataclass(frozen=True)
class DeclaredField:
    """One recipe field that has a flag: its name, type and default (from the dataclass) and its declaration."""

    name: str
    kind: type
    default: Any
    flag: RecipeFlag

    @property
    def cli_flag(self) -> str:
        """The flag that sets this field."""
        return self.flag.flag or "--" + self.name.replace("_", "-")

    @property
    def option(self) -> Option:
        """A numeric field as an Option, whose range text and check it shares with method options."""
        flag = self.flag
        return Option(self.name, self.kind, self.default, flag.help, flag.low, flag.high, self.cli_flag, flag.high_open)

    def range_text(self, choices: Sequence[str]) -> str:
        """The accepted values as a person reads them: a number range, or the registry's names."""
        return ", ".join(choices) if self.flag.choices else self.option.range_text

    def check(self, value: Any, choices: Sequence[str]) -> Any:
        """The value when it is one of `choices` (a registry-backed field) or within the field's range; else a
        UsageError naming the flag or the registry, the accepted values and the value (capped)."""
        if not self.flag.choices:
            checked = self.option.check(value)
            return int(checked) if self.kind is int else checked
        if value not in choices:
            raise UsageError(f"unknown {self.flag.choices} {repr(value)[:40]}; known: {', '.join(choices)}")
        return value


def declared_fields(recipe_type: type) -> list[DeclaredField]:
    """Every field of a recipe dataclass that declares a flag, in field order."""
    hints = typing.get_type_hints(recipe_type)
    return [
        DeclaredField(f.name, hints[f.name], f.default, f.metadata[FLAG_KEY])
        for f in dataclasses.fields(recipe_type)
        if FLAG_KEY in f.metadata
    ]
