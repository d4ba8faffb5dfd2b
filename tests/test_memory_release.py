# A board's memory: the agent holds glibc's mmap threshold, so a round's freed arrays leave its resident set.
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# A round in miniature: a large array freed (glibc then raises its threshold to its size), 30 arrays of 4 MB made
# while a small one made after them stays, then the 30 freed; prints the MB still held of the 120.
ROUND = """
import numpy as np, sys
from edge_agent.loop.memory_budget import keep_large_frees_returnable
def resident() -> float:
    return int(open("/proc/self/statm").read().split()[1]) * 4096 / 2**20
if sys.argv[1] == "held":
    assert keep_large_frees_returnable()
large = np.ones(16 * 2**20 // 8); del large
before = resident()
blocks = [np.ones(4 * 2**20 // 8) for _ in range(30)]
stays = np.ones(2**20 // 8)
del blocks
print(round(resident() - before))
"""


def still_held_mb(mode: str) -> int:
    """MB of the 120 freed that the round's process still holds."""
    done = subprocess.run(
        [sys.executable, "-c", ROUND, mode], cwd=ROOT, capture_output=True, text=True, timeout=60, check=True
    )
    return int(done.stdout.split()[-1])


@pytest.mark.skipif(not Path("/proc/self/statm").exists() or sys.platform != "linux", reason="glibc and /proc only")
def test_the_agents_freed_arrays_leave_its_resident_set_where_glibc_would_keep_them() -> None:
    assert still_held_mb("plain") >= 100  # glibc's own way: the freed blocks stay in the heap
    assert still_held_mb("held") <= 5


def test_every_agent_command_holds_the_threshold_before_it_runs(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    from edge_agent import cli

    calls: list[str] = []
    monkeypatch.setattr(cli, "keep_large_frees_returnable", lambda: calls.append("held") or True)
    with pytest.raises(SystemExit):
        cli.main(["--version"])
    assert calls == ["held"] and capsys.readouterr().out.startswith("edge-agent")
