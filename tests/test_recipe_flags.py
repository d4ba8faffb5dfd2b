# The round recipe's flags come from one declaration per field: the command line, its checks, the wire, the docs.
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from bench.cli import main as bench_main
from coordinator.commands.recipe_options import RECIPE_TABLE_BEGIN, RECIPE_TABLE_END, recipe_table
from protocol import messages, wire
from protocol.recipe_flags import declared_fields, recipe_field

REFERENCE = Path(__file__).resolve().parent.parent / "docs" / "reference.md"


@dataclass(frozen=True)
class ToyRecipe(messages.Recipe):
    """The recipe with one more field a test declares: everything else must follow from this one line."""

    toy_depth: int = recipe_field(3, "toy: how deep a test's toy goes", omitted_at_default=True, low=1, high=9)


@pytest.fixture
def toy_recipe() -> Iterator[type[messages.Recipe]]:
    """The wire and the command line use ToyRecipe for one test (the announcement's field types are resolved first,
    so the wire's rule for the recipe, which builds the patched class, stays the one it has)."""
    wire.type_hints(messages.RoundAnnouncement)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(messages, "Recipe", ToyRecipe)
        patch.setattr(wire, "Recipe", ToyRecipe)
        yield ToyRecipe


def test_the_reference_page_recipe_table_is_the_generated_one() -> None:
    text = REFERENCE.read_text()
    assert text.count(RECIPE_TABLE_BEGIN) == 1 and text.count(RECIPE_TABLE_END) == 1
    assert text.split(RECIPE_TABLE_BEGIN)[1].split(RECIPE_TABLE_END)[0].strip() == recipe_table()


def test_every_recipe_field_but_the_options_and_the_encoder_has_a_flag_and_its_default_is_the_fields() -> None:
    declared = {field.name: field for field in declared_fields(messages.Recipe)}
    assert set(declared) == {name for name in messages.Recipe.__dataclass_fields__} - {"options", "encoder"}
    assert declared["learning_rate"].cli_flag == "--lr" and declared["epochs"].default == messages.Recipe().epochs


def test_a_toy_recipe_field_reaches_the_help_the_table_the_checks_and_the_wire(toy_recipe, capsys, tmp_path) -> None:
    with pytest.raises(SystemExit):
        bench_main(["simulate", "--help"])
    assert "--toy-depth TOY_DEPTH" in capsys.readouterr().out
    assert "| `--toy-depth` | int | 3 | [1, 9] | toy: how deep a test's toy goes |" in recipe_table()
    run = ["simulate", "--devices", "1", "--rounds", "1", "--run-dir", str(tmp_path / "run")]
    assert bench_main([*run, "--toy-depth", "10"]) == 2
    assert capsys.readouterr().err.strip() == "fl-bench: --toy-depth must lie in [1, 9], got 10"
    assert not (tmp_path / "run" / "devices").exists()
    announcement = messages.RoundAnnouncement("run", 1, "hash", toy_recipe(toy_depth=7), 0.0)
    decoded = wire.decode(wire.encode(announcement), messages.RoundAnnouncement)
    assert decoded.recipe == toy_recipe(toy_depth=7)
    default = messages.RoundAnnouncement("run", 1, "hash", toy_recipe(), 0.0)
    assert b"toy_depth" not in wire.encode(default)


def test_a_registry_backed_field_refuses_an_unknown_name_listing_the_known_ones() -> None:
    sampler = next(field for field in declared_fields(messages.Recipe) if field.name == "sampler")
    with pytest.raises(ValueError, match="^unknown sampler 'psychic'; known: margin, random$"):
        sampler.check("psychic", ("margin", "random"))
    assert sampler.check("random", ("margin", "random")) == "random"
