# The command lines fail fast with one clear line on bad input, before starting any process.
from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import pytest

from coordinator.strategies.registry import STRATEGIES
from edge_agent.learning.local_rules import LOCAL_RULES


def run_cli(*args: str) -> subprocess.CompletedProcess:
    """Runs a console module the way a user does and captures its output."""
    return subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True, timeout=120)


def test_missing_dataset_says_how_to_install_it(tmp_path: Path) -> None:
    result = run_cli(
        "bench",
        "simulate",
        "--devices",
        "2",
        "--rounds",
        "1",
        "--data-dir",
        str(tmp_path / "none"),
        "--run-dir",
        str(tmp_path / "run"),
    )
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1
    assert "apt-get install dataset-fashion-mnist" in lines[0] and "--data-dir" in lines[0]


@pytest.mark.parametrize(
    ("option", "value", "message"),
    [
        ("--sampler", "psychic", "unknown sampler 'psychic'"),
        ("--strategy", "vote", "unknown strategy 'vote'"),
        ("--local-rule", "magic", "unknown local rule 'magic'"),
        ("--partition", "type9", "unknown partition 'type9'"),
        ("--broker", "http://x", "must look like mqtt://HOST:PORT"),
        ("--fleet", "a/b", "fleet 'a/b' must be 1 to 64"),
        ("--model-spec", "no-such-spec.toml", "no-such-spec.toml: no such model spec file"),
        ("--dataset", "own.npz", "simulate deals Fashion-MNIST shards to its bench devices"),
    ],
)
def test_bad_option_values_give_one_line(tmp_path: Path, option: str, value: str, message: str) -> None:
    result = run_cli(
        "bench", "simulate", "--devices", "2", "--rounds", "1", "--run-dir", str(tmp_path / "run"), option, value
    )
    assert result.returncode == 2, result.stderr
    assert message in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "run" / "devices").exists()


def test_bench_device_with_missing_shard_fails_cleanly(tmp_path: Path) -> None:
    result = run_cli(
        "bench",
        "device",
        "--broker",
        "mqtt://127.0.0.1:1",
        "--fleet",
        "f",
        "--device-id",
        "d1",
        "--data",
        str(tmp_path / "missing.npz"),
        "--state-dir",
        str(tmp_path / "state"),
    )
    assert result.returncode == 2
    assert "missing.npz" in result.stderr and len(result.stderr.strip().splitlines()) == 1


def test_suspect_options_reach_the_policy_by_name(tmp_path: Path) -> None:
    from bench.cli import FL_BENCH
    from coordinator.commands.run_settings import server_settings
    from coordinator.intake.round_aggregator import SuspectPolicy

    parser = FL_BENCH.parser("simulate")
    args = parser.parse_args(
        ["simulate", "--run-dir", str(tmp_path), "--suspect-threshold", "4.5", "--exclude-suspects"]
    )
    policy = server_settings(args, default_fleet="bench").suspects
    assert policy == SuspectPolicy(threshold=4.5, min_layer_fraction=SuspectPolicy.min_layer_fraction, exclude=True)
    default = server_settings(parser.parse_args(["simulate", "--run-dir", str(tmp_path)]), "bench").suspects
    assert default == SuspectPolicy()


COMMAND_LINES = [
    ("fl-coordinator", "coordinator.cli", ["run", "--rounds", "1"]),
    ("fl-bench", "bench.cli", ["simulate", "--devices", "1", "--rounds", "1"]),
]


@pytest.mark.parametrize(("prog", "module", "command"), COMMAND_LINES)
def test_an_out_of_range_recipe_flag_is_one_line_and_exit_2(tmp_path: Path, prog, module, command, capsys) -> None:
    main = importlib.import_module(module).main
    assert main([*command, "--run-dir", str(tmp_path / "run"), "--epochs", "0"]) == 2
    assert capsys.readouterr().err.strip() == f"{prog}: --epochs must be at least 1, got 0"


@pytest.mark.parametrize(("prog", "module", "command"), COMMAND_LINES)
@pytest.mark.parametrize(("registry", "name"), [(STRATEGIES, "avefl"), (LOCAL_RULES, "kept-labels")])
def test_a_bug_inside_a_method_escapes_with_its_traceback(
    tmp_path: Path, monkeypatch, prog, module, command, registry, name
) -> None:
    """A ValueError from inside a strategy or a local rule is a bug, not the user's mistake: main lets it escape."""

    def broken(self, *args, **kwargs) -> None:
        raise ValueError("a bug inside the method")

    monkeypatch.setattr(registry.get(name), "__init__", broken)
    main = importlib.import_module(module).main
    with pytest.raises(ValueError, match="a bug inside the method"):
        main([*command, "--run-dir", str(tmp_path / "run")])
