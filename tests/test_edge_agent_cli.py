# The device's command lines (`edge-agent run`, `fl-bench device`): a user's mistake is one line and exit 2, a bug
# shows its traceback, and the field command knows nothing of the bench's shards.
from __future__ import annotations

from pathlib import Path

import pytest
from fleet import announce_round, fleet_shards

from bench.cli import main as bench_main
from edge_agent.cli import main as agent_main
from edge_agent.loop.round_runner import RoundRunner
from protocol import messages


def run_argv(tmp_path: Path, *options: str) -> list[str]:
    """`edge-agent run` over an empty camera folder, with a broker nobody listens on, and `options` last."""
    (tmp_path / "camera").mkdir(exist_ok=True)
    return [
        *("run", "--broker", "mqtt://127.0.0.1:1", "--pool-dir", str(tmp_path / "camera")),
        *("--state-dir", str(tmp_path / "state"), *options),
    ]


@pytest.mark.parametrize(
    "options, message",
    [
        ((), "--device-id and --fleet are required without --credentials"),
        (("--fleet", "a/b", "--device-id", "d"), "fleet 'a/b' must be 1 to 64"),
        (("--fleet", "f", "--device-id", "d e"), "device id 'd e' must be 1 to 64"),
        (("--fleet", "f", "--device-id", "d", "--broker", "http://x"), "must look like mqtt://HOST:PORT"),
        (("--fleet", "f", "--device-id", "d", "--max-message-bytes", "10"), "--max-message-bytes must be at least"),
        (("--fleet", "f", "--device-id", "d", "--slowdown", "0.5"), "--slowdown must lie in [1, 1000]"),
        (("--fleet", "f", "--device-id", "d", "--profile", "none.toml"), "none.toml: device profile not found"),
        (("--fleet", "f", "--device-id", "d", "--label-ui", "x:y"), "--label-ui expects [HOST:]PORT"),
    ],
)
def test_a_bad_run_flag_is_one_line_and_exit_2(tmp_path: Path, capsys, options: tuple[str, ...], message: str) -> None:
    assert agent_main(run_argv(tmp_path, *options)) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("edge-agent: ") and message in lines[0], lines


def test_a_missing_pool_folder_is_one_line(tmp_path: Path, capsys) -> None:
    argv = run_argv(tmp_path, "--fleet", "f", "--device-id", "d", "--pool-dir", str(tmp_path / "none"))
    assert agent_main(argv) == 2
    assert capsys.readouterr().err.strip() == f"edge-agent: pool folder {tmp_path / 'none'} does not exist"


def test_the_field_command_takes_no_bench_shard(tmp_path: Path, capsys) -> None:
    """`--data` is the bench's (`fl-bench device`); `edge-agent run` does not know it."""
    with pytest.raises(SystemExit) as exit_:
        agent_main(run_argv(tmp_path, "--fleet", "f", "--device-id", "d", "--data", "x.npz"))
    assert exit_.value.code == 2 and "unrecognized arguments: --data" in capsys.readouterr().err


def test_a_bench_device_refuses_the_folder_only_options_in_one_line(tmp_path: Path, capsys) -> None:
    [launch] = fleet_shards(tmp_path, 1)
    argv = ["device", "--broker", "mqtt://127.0.0.1:1", "--fleet", "f", "--device-id", "d", "--data", str(launch.shard)]
    assert bench_main([*argv, "--state-dir", str(tmp_path / "state"), "--stream"]) == 2
    error = capsys.readouterr().err.strip()
    assert (
        error
        == "fl-bench: --stream, --label-ui and --labelling central need a folder pool (`edge-agent run --pool-dir`)"
    )


@pytest.mark.integration
def test_a_bug_in_the_round_work_shows_its_traceback_not_one_line(tmp_path: Path, broker, monkeypatch) -> None:
    """A ValueError the device's own round work raises is a bug, not a user's mistake: main lets it through (the
    interpreter prints its traceback) rather than printing one line and exiting 2."""

    def broken_round(*_: object) -> None:
        raise ValueError("a bug in the round work")

    monkeypatch.setattr(RoundRunner, "run", broken_round)
    [launch] = fleet_shards(tmp_path, 1)
    announce_round(broker.address, "bugs", messages.Recipe(labels_per_acquisition=5, epochs=1, mc_passes=2))
    argv = ["device", "--broker", broker.address.url, "--fleet", "bugs", "--device-id", launch.device_id]
    with pytest.raises(ValueError, match="a bug in the round work"):
        bench_main([*argv, "--data", str(launch.shard), "--state-dir", str(launch.state_dir)])
