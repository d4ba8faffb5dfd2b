# The house rules on imports: which rooms may import which, and which modules stay free of torch.
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FORBIDDEN = {
    "protocol": ("edge_agent", "export", "coordinator", "bench"),
    "edge_agent": ("coordinator", "export", "bench"),
    "export": ("coordinator",),
}
TORCH_FREE = (
    "coordinator.aggregation",
    "coordinator.cadis",
    "coordinator.server_optimizers",
    "edge_agent.learning.local_data",
    "coordinator.strategies",
    "coordinator.round_aggregator",
    "coordinator.buffered",
    "coordinator.async_intake",
    "coordinator.divergence",
    "coordinator.validation",
    "protocol.tensors",
    "protocol.options",
    "protocol.update_codec",
    "protocol.chunks",
    # a device that scores and trains its classifier only (the Pi Zero 2 W profile) runs without torch
    "edge_agent.loop.agent",
    "edge_agent.cli",
    "edge_agent.run_command",
    # the bench's device over a shard: how the tests run a device installed without torch
    "bench.device_command",
    "edge_agent.loop.round_runner",
    "edge_agent.loop.acquisition",
    "edge_agent.learning.learner",
    "edge_agent.learning.head_learner",
    "edge_agent.learning.head_training",
    "edge_agent.learning.local_data",
    "edge_agent.loop.outbox",
    "edge_agent.loop.footprint",
    "edge_agent.loop.memory_budget",
    "edge_agent.field.parts",
    # `edge-agent score` over an image folder
    "edge_agent.score_command",
    "edge_agent.data.image_files",
)


def imported_packages(path: Path) -> set[str]:
    """The top-level package of every import statement in a module, function-level imports included."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize("room", sorted(FORBIDDEN))
def test_a_room_imports_none_of_the_rooms_it_must_not(room: str) -> None:
    offences = {
        str(path.relative_to(ROOT)): sorted(imported_packages(path) & set(FORBIDDEN[room]))
        for path in sorted((ROOT / room).rglob("*.py"))
    }
    assert {path: found for path, found in offences.items() if found} == {}


def test_the_import_rule_sees_function_level_imports(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from coordinator.store import RunStore\n    import export.cli\n")
    assert imported_packages(module) == {"coordinator", "export"}


def test_the_pure_numpy_modules_do_not_import_torch() -> None:
    code = f"import sys\nfor name in {TORCH_FREE!r}:\n    __import__(name)\nprint('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"
