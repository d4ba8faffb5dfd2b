# Method options declared once: their checks, the registries, the generated flags, the reference table, a toy method.
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from bench.cli import main
from coordinator.commands.method_flags import TABLE_BEGIN, TABLE_END, options_table
from coordinator.dashboard.views import recipe_view
from edge_agent.learning.heuristics import AcquisitionContext, Sampler
from edge_agent.learning.sampling import SAMPLERS
from protocol import messages
from protocol.options import Method, Option, Registry

REFERENCE = Path(__file__).resolve().parent.parent / "docs" / "reference.md"


class ToySampler(Sampler):
    """A sampler a test adds: scores every sample by its index times a declared weight."""

    name = "toy-index"
    summary = "index times a weight (a test's toy)"
    options = (Option("toy_weight", float, 2.0, "toy: weight of the index", 0.5, 4.0, flag="--toy-weight"),)

    def score_pool(self, context: AcquisitionContext) -> np.ndarray:
        return np.arange(context.num_samples) * self.option_value(context.options, "toy_weight")


@pytest.fixture
def toy_sampler() -> Iterator[type[Sampler]]:
    """The toy sampler registered for one test, and gone after it."""
    SAMPLERS.register(ToySampler)
    yield ToySampler
    SAMPLERS.unregister(ToySampler.name)


def test_an_option_checks_type_range_and_caps_what_it_shows() -> None:
    option = Option("k", int, 3, "neighbours", low=1, flag="--k")
    assert option.check(5) == 5.0 and option.read({}) == 3.0 and option.read({"k": 7}) == 7.0
    with pytest.raises(ValueError, match="^--k must be at least 1, got 0$"):
        option.check(0)
    with pytest.raises(ValueError, match="^--k must be an integer, got 2.5$"):
        option.check(2.5)
    with pytest.raises(ValueError, match="^--k must be a finite number, got True$"):
        option.check(True)
    with pytest.raises(ValueError) as error:
        option.check("x" * 10_000)
    assert len(str(error.value)) < 100
    half_open = Option("trim", float, 0.2, "trim", 0.0, 0.5, high_open=True)
    assert half_open.range_text == "[0, 0.5)" and half_open.check(0.49) == 0.49
    with pytest.raises(ValueError, match=r"--trim must lie in \[0, 0.5\), got 0.5"):
        half_open.check(0.5)


def test_a_registry_refuses_a_taken_name_and_lists_the_known_ones() -> None:
    registry: Registry[type[Method]] = Registry("toy")
    registry.register(ToySampler)
    assert registry.names() == ["toy-index"] and registry["toy-index"] is ToySampler

    class Other(ToySampler):
        pass

    with pytest.raises(ValueError, match="toy 'toy-index' is registered already"):
        registry.register(Other)
    with pytest.raises(ValueError, match="unknown toy 'nope'; known: toy-index"):
        registry.get("nope")


def test_a_toy_sampler_is_one_class_and_one_registration_away_from_the_cli(toy_sampler, capsys, tmp_path) -> None:
    with pytest.raises(SystemExit):
        main(["simulate", "--help"])
    simulate_help = capsys.readouterr().out
    assert "options of sampler toy-index" in simulate_help and "--toy-weight" in simulate_help
    assert SAMPLERS.names()[-1] == "toy-index"
    assert f"sampler:{','.join(SAMPLERS.names())}" in "".join(simulate_help.split())
    run = ["simulate", "--devices", "1", "--rounds", "1", "--run-dir", str(tmp_path / "run")]
    assert main([*run, "--sampler", "toy-index", "--toy-weight", "9"]) == 2
    assert "--toy-weight must lie in [0.5, 4], got 9.0" in capsys.readouterr().err
    assert main([*run, "--toy-weight", "1"]) == 2
    assert (
        f"--toy-weight is an option of sampler 'toy-index'; this run uses {messages.Recipe.sampler!r}"
        in capsys.readouterr().err
    )
    assert not (tmp_path / "run" / "devices").exists()


def test_the_reference_page_table_is_the_generated_one() -> None:
    text = REFERENCE.read_text()
    assert text.count(TABLE_BEGIN) == 1 and text.count(TABLE_END) == 1
    assert text.split(TABLE_BEGIN)[1].split(TABLE_END)[0].strip() == options_table()


def test_the_dashboard_view_shows_each_chosen_method_with_its_option_values() -> None:
    view = recipe_view("ksas", "kcfu", "cadis", {"lambda": 0.5})
    assert [(m["kind"], m["method"]) for m in view] == [
        ("sampler", "ksas"),
        ("local rule", "kcfu"),
        ("strategy", "cadis"),
    ]
    cold_start, ksas_lambda = view[0]["options"]
    assert cold_start["flag"] == "--cold-start-labels" and cold_start["value"] == cold_start["default"] == 0
    assert ksas_lambda == {
        "flag": "--ksas-lambda",
        "value": 0.5,
        "default": 1.0,
        "help": "KSAS knowledge weight lambda",
    }
    assert view[1]["options"][0]["value"] == 0.5 and view[2]["options"][0]["flag"] == "--cadis-threshold"
    assert recipe_view("gone", "kcfu", "avefl", {})[0] == {
        "kind": "sampler",
        "method": "gone",
        "summary": "",
        "options": [],
    }
