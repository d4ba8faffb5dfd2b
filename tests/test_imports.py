# The house rules on imports: which rooms may import which, no import cycles, and which modules stay free of torch.
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
    "export": ("coordinator", "bench"),
    "coordinator": ("bench",),
}
TORCH_FREE = (
    # the protocol room, every module of it: a device that never trains in torch speaks the whole protocol
    *(
        ".".join(path.relative_to(ROOT).with_suffix("").parts)
        for path in sorted((ROOT / "protocol").rglob("*.py"))
        if path.stem != "__init__"
    ),
    # the command lines load a command's module only when it runs
    "coordinator.cli",
    "bench.cli",
    "coordinator.strategies.aggregate",
    "coordinator.strategies.cadis",
    "coordinator.strategies.server_optimizers",
    "edge_agent.learning.local_data",
    "coordinator.strategies.registry",
    "coordinator.strategies.contract",
    "coordinator.strategies.means",
    "coordinator.strategies.robust",
    "coordinator.strategies.optimizers",
    "coordinator.intake.round_aggregator",
    # the round loop's mode seam and the three modes that fill it
    "coordinator.rounds.mode",
    "coordinator.rounds.rules",
    "coordinator.privacy.mode",
    "coordinator.secure.mode",
    "coordinator.privacy.dp_aggregator",
    "coordinator.privacy.rounds",
    "coordinator.asynchronous.buffer",
    "coordinator.asynchronous.intake",
    "coordinator.intake.divergence",
    "coordinator.intake.validation",
    "coordinator.secure.secagg_server",
    "coordinator.secure.secagg_complaints",
    "coordinator.secure.secagg_unmask",
    "coordinator.secure.secagg_bounds",
    "coordinator.secure.secagg_round",
    "edge_agent.loop.secagg_device",
    "coordinator.commands.method_flags",
    "protocol.tensors",
    "protocol.options",
    "protocol.update_codec",
    "protocol.chunks",
    "protocol.reassembly",
    # a device that scores and trains its classifier only (the Pi Zero 2 W profile) runs without torch
    "edge_agent.loop.agent",
    "edge_agent.cli",
    "edge_agent.run_command",
    # the bench's device over a shard: how the tests run a device installed without torch
    "bench.device_command",
    "edge_agent.loop.round_runner",
    "edge_agent.loop.acquisition",
    "edge_agent.learning.learner",
    "edge_agent.learning.compute",
    "edge_agent.learning.learner_choice",
    "edge_agent.learning.local_rules",
    "edge_agent.learning.sampling",
    "edge_agent.learning.heuristics",
    "edge_agent.learning.batch_samplers",
    "edge_agent.learning.acquisition_scores",
    "edge_agent.learning.batch_selection",
    "edge_agent.learning.head_learner",
    "edge_agent.learning.cached_prefix",
    "edge_agent.data.feature_cache",
    "edge_agent.learning.head_training",
    "edge_agent.learning.local_data",
    "edge_agent.loop.outbox",
    "edge_agent.loop.footprint",
    "edge_agent.loop.memory_budget",
    "edge_agent.field.parts",
    # predictions on a device (the Pi Zero predicts with its serving model's bundle)
    "edge_agent.field.predicting",
    "edge_agent.learning.predict",
    "edge_agent.data.predictions_log",
    "edge_agent.loop.prediction_publisher",
    # `edge-agent score` and `edge-agent predict` over an image folder
    "edge_agent.score_command",
    "edge_agent.predict_command",
    "edge_agent.data.image_files",
    # `fl-coordinator dataset`: a team's photos into the server's data set, decoded as a device decodes them
    "coordinator.commands.dataset",
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
    module.write_text("def f():\n    from coordinator.storage.store import RunStore\n    import export.cli\n")
    assert imported_packages(module) == {"coordinator", "export"}


def test_the_pure_numpy_modules_do_not_import_torch() -> None:
    code = f"import sys\nfor name in {TORCH_FREE!r}:\n    __import__(name)\nprint('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"


RUNTIME_ROOMS = ("protocol", "edge_agent", "export", "coordinator", "bench")


def module_name(path: Path) -> str:
    """A file's dotted module name (a package's __init__ named as the package)."""
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def runtime_imports(tree: ast.AST, type_only: bool = False) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement of a module, function-level ones included, less those under `if TYPE_CHECKING:`
    (with `type_only`, those too)."""
    found: list[ast.Import | ast.ImportFrom] = []
    pending: list[ast.AST] = [tree]
    while pending:
        node = pending.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        elif not type_only and isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            pending.extend(node.orelse)
        else:
            pending.extend(ast.iter_child_nodes(node))
    return found


def imported_modules(name: str, tree: ast.AST, modules: set[str], package: bool, type_only: bool = False) -> set[str]:
    """The room modules a module imports: `import a.b` imports a and a.b, `from a import b` the module a.b when
    there is one (else a), a relative import resolved against the module's package (`type_only`: imports under
    `if TYPE_CHECKING:` count too)."""
    targets: set[str] = set()
    for node in runtime_imports(tree, type_only):
        if isinstance(node, ast.Import):
            dotted = [alias.name for alias in node.names]
            targets.update(".".join(each.split(".")[:depth]) for each in dotted for depth in range(1, 1 + len(each)))
            continue
        base = name.split(".")[: len(name.split(".")) - node.level + (1 if package else 0)] if node.level else []
        source = ".".join([*base, *([node.module] if node.module else [])])
        targets.update(".".join(source.split(".")[:depth]) for depth in range(1, source.count(".") + 2))
        targets.update(f"{source}.{alias.name}" for alias in node.names)
    return (targets & modules) - {name}


def import_graph(type_only: bool = False) -> dict[str, set[str]]:
    """Each module of the runtime rooms and the room modules it imports (`type_only`: type-only imports too)."""
    paths = {module_name(path): path for room in RUNTIME_ROOMS for path in (ROOT / room).rglob("*.py")}
    modules = set(paths)
    return {
        name: imported_modules(name, ast.parse(path.read_text()), modules, path.name == "__init__.py", type_only)
        for name, path in paths.items()
    }


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Import cycles, each its modules in import order with the first repeated at the end: the shortest through a
    module on a cycle, until every such module is in one that is reported."""
    cycles, done = [], set()
    for start in sorted(graph):
        if start in done:
            continue
        cycle = cycle_through(graph, start)
        if cycle:
            cycles.append(cycle)
            done.update(cycle)
    return cycles


def cycle_through(graph: dict[str, set[str]], start: str) -> list[str]:
    """The shortest import path from `start` back to itself (breadth first), or [] if there is none."""
    paths, seen = [[start]], {start}
    while paths:
        path = paths.pop(0)
        for target in sorted(graph[path[-1]]):
            if target == start:
                return [*path, start]
            if target not in seen:
                seen.add(target)
                paths.append([*path, target])
    return []


def test_the_runtime_rooms_have_no_import_cycle() -> None:
    cycles = import_cycles(import_graph())
    assert cycles == [], f"import cycles: {cycles}"


def test_the_cycle_finder_sees_function_level_and_from_imports(tmp_path: Path) -> None:
    modules = {"pkg", "pkg.a", "pkg.b", "pkg.c"}
    sources = {
        "pkg.a": "from pkg import b\n",
        "pkg.b": "def f():\n    import pkg.c\n",
        "pkg.c": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.a import x\nfrom .a import y\n",
    }
    graph = {name: imported_modules(name, ast.parse(code), modules, False) for name, code in sources.items()}
    assert graph == {"pkg.a": {"pkg", "pkg.b"}, "pkg.b": {"pkg", "pkg.c"}, "pkg.c": {"pkg", "pkg.a"}}
    assert import_cycles({**graph, "pkg": set()}) == [["pkg.a", "pkg.b", "pkg.c", "pkg.a"]]


# The coordinator's rooms, lowest first: a module imports its own room and earlier levels' rooms only (type-only
# imports included), so no import circle runs between rooms. The top level holds the two assemblies (server.py,
# relay.py) and the command line; every other module lives in a room.
COORDINATOR_LEVELS = (
    ("strategies", "storage", "fleet"),
    ("intake",),
    ("rounds", "labelling"),
    ("privacy", "secure", "asynchronous", "dashboard", "bridge"),
    ("setup",),
    ("server",),
    ("relay",),
    ("commands",),
    ("cli",),
    ("__main__",),
)
TOP_LEVEL = {"__init__.py", "__main__.py", "cli.py", "server.py", "relay.py"}
# Rooms inside a package that must not import another of its rooms (type-only imports included).
INNER_FORBIDDEN = {"edge_agent.learning": ("edge_agent.loop",)}


def coordinator_level(module: str) -> int | None:
    """The level of a coordinator module's room (None: the package itself, or not the coordinator's)."""
    parts = module.split(".")
    if parts[0] != "coordinator" or len(parts) == 1:
        return None
    return next(level for level, rooms in enumerate(COORDINATOR_LEVELS) if parts[1] in rooms)


def upward_imports(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """(module, imported) for every import of a coordinator module from another room at its own level or later."""
    found = []
    for module, targets in sorted(graph.items()):
        level = coordinator_level(module)
        for target in sorted(targets):
            other = coordinator_level(target)
            same_room = module.split(".")[:2] == target.split(".")[:2]
            if level is not None and other is not None and other >= level and not same_room:
                found.append((module, target))
    return found


def test_the_coordinator_top_level_holds_the_assemblies_and_rooms_only() -> None:
    top = ROOT / "coordinator"
    assert {path.name for path in top.glob("*.py")} == TOP_LEVEL
    folders = {path.name for path in top.iterdir() if path.is_dir() and (path / "__init__.py").exists()}
    assert folders == {room for rooms in COORDINATOR_LEVELS for room in rooms} - {"server", "relay", "cli", "__main__"}


def test_the_coordinator_rooms_import_only_earlier_rooms_type_only_imports_included() -> None:
    assert upward_imports(import_graph(type_only=True)) == []


def test_the_coordinator_has_no_import_cycle_type_only_imports_included() -> None:
    graph = import_graph(type_only=True)
    coordinator = {name: {t for t in targets if t.startswith("coordinator")} for name, targets in graph.items()}
    assert import_cycles({name: t for name, t in coordinator.items() if name.startswith("coordinator")}) == []


def test_the_room_order_sees_an_upward_import() -> None:
    graph = {"coordinator.intake.validation": {"coordinator.rounds.loop"}, "coordinator.rounds.loop": set()}
    assert upward_imports(graph) == [("coordinator.intake.validation", "coordinator.rounds.loop")]
    assert upward_imports({"coordinator.secure.mode": {"coordinator.privacy.mode"}}) != []
    assert (
        upward_imports({"coordinator.rounds.loop": {"coordinator.rounds.mode", "coordinator.intake.update_intake"}})
        == []
    )


@pytest.mark.parametrize("room", sorted(INNER_FORBIDDEN))
def test_an_inner_room_imports_none_of_its_siblings_it_must_not(room: str) -> None:
    graph = import_graph(type_only=True)
    offences = {
        (module, target)
        for module, targets in graph.items()
        if module.startswith(room + ".")
        for target in targets
        if target.startswith(INNER_FORBIDDEN[room])
    }
    assert sorted(offences) == []
