# Method options declared once, on the method class: name, type, default, range, help; registries by name.
from __future__ import annotations

import math
import numbers
from abc import ABC
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Generic, TypeVar

from protocol.errors import UsageError


@dataclass(frozen=True)
class Option:
    """One numeric parameter of a method (sampler, local rule, strategy).

    `key` is its name in the recipe's options map (or the strategy's constructor keyword); `flag` is the
    command-line flag that sets it. The command line, recipe validation, the docs' option table and the
    dashboard's recipe view all read this one declaration.
    """

    key: str
    kind: type[int] | type[float]
    default: float
    help: str
    low: float | None = None
    high: float | None = None
    flag: str = ""
    high_open: bool = False

    @property
    def cli_flag(self) -> str:
        """The flag that sets this option: the declared one, else --KEY with '_' as '-'."""
        return self.flag or "--" + self.key.replace("_", "-")

    @property
    def range_text(self) -> str:
        """The accepted range as a person reads it: [low, high], >= low, <= high, or any."""
        close = ")" if self.high_open else "]"
        if self.low is not None and self.high is not None:
            return f"[{self.low:g}, {self.high:g}{close}"
        if self.low is not None:
            return f">= {self.low:g}"
        if self.high is not None:
            return f"{'<' if self.high_open else '<='} {self.high:g}"
        return "any"

    def check(self, value: Any) -> float:
        """The value as a float when it is a finite number of this option's type within its range; else
        UsageError naming the flag, the range and the value (its text capped, so it cannot grow with input)."""
        shown = repr(value)[:40]
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(float(value)):
            raise UsageError(f"{self.cli_flag} must be a finite number, got {shown}")
        if self.kind is int and not float(value).is_integer():
            raise UsageError(f"{self.cli_flag} must be an integer, got {shown}")
        number = float(value)
        above = self.high is not None and (number >= self.high if self.high_open else number > self.high)
        if (self.low is not None and number < self.low) or above:
            raise UsageError(f"{self.cli_flag} must {self.requirement}, got {shown}")
        return number

    @property
    def requirement(self) -> str:
        """What a value must do, in words: 'lie in [0, 1]', 'be at least 1'."""
        if self.high is None and self.low is not None:
            return f"be at least {self.low:g}"
        if self.low is None and self.high is not None:
            return f"be {'below' if self.high_open else 'at most'} {self.high:g}"
        return f"lie in {self.range_text}"

    def read(self, options: Mapping[str, float]) -> float:
        """This option's checked value in an options map, or its default when the map does not set it."""
        return self.check(options.get(self.key, self.default))


class Method(ABC):
    """A method with declared options; subclasses list them in `options` and read them with `option_value`."""

    name: ClassVar[str]
    summary: ClassVar[str] = ""
    options: ClassVar[tuple[Option, ...]] = ()

    @classmethod
    def option(cls, key: str) -> Option:
        """The declared option with this key; KeyError names the method and what it declares."""
        for option in cls.options:
            if option.key == key:
                return option
        declared = ", ".join(o.key for o in cls.options) or "none"
        raise KeyError(f"{cls.name!r} declares no option {key!r} (declared: {declared})")

    @classmethod
    def option_value(cls, options: Mapping[str, float], key: str) -> float:
        """The checked value of one of this method's options in an options map (its default when absent)."""
        return cls.option(key).read(options)


MethodType = TypeVar("MethodType", bound=type[Method])


class Registry(Generic[MethodType]):
    """The methods of one kind (samplers, local rules, strategies) by name, in registration order."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._methods: dict[str, MethodType] = {}

    def register(self, method: MethodType) -> MethodType:
        """Adds a method class under its name (usable as a class decorator); a taken name is a ValueError."""
        if method.name in self._methods and self._methods[method.name] is not method:
            raise ValueError(f"{self.kind} {method.name!r} is registered already")
        self._methods[method.name] = method
        return method

    def unregister(self, name: str) -> None:
        """Removes a method by name (tests that register a toy method clean up with it)."""
        self._methods.pop(name, None)

    def __getitem__(self, name: str) -> MethodType:
        return self.get(name)

    def __contains__(self, name: object) -> bool:
        return name in self._methods

    def __iter__(self) -> Iterator[str]:
        return iter(self._methods)

    def names(self) -> list[str]:
        """Every registered name, in registration order."""
        return list(self._methods)

    def get(self, name: str) -> MethodType:
        """The class registered under a name; UsageError lists the known names."""
        if name not in self._methods:
            raise UsageError(f"unknown {self.kind} {name!r}; known: {', '.join(sorted(self._methods))}")
        return self._methods[name]

    def items(self) -> list[tuple[str, MethodType]]:
        """(name, class) pairs in registration order."""
        return list(self._methods.items())

    def select(self, keep: Callable[[MethodType], bool]) -> list[str]:
        """The names of the methods for which `keep(class)` holds."""
        return [name for name, method in self._methods.items() if keep(method)]
