# `make arm64-check`: the device install on emulated arm64 boards scores and trains as on the host, or names what died.
"""Proves: the '[agent]' install that pip picks for aarch64 (Debian bookworm's Python 3.11 and trixie's 3.13) runs on
the instruction sets of the Cortex-A53 (Pi Zero 2 W, Pi 3) and Cortex-A72 (Pi 4), with the host's numerics:
`edge-agent score` selects the same files as the host with a paper-CNN bundle and an EfficientNet-Lite0 head-only
bundle, and every emulated board serves one field round over MQTT that a coordinator on the host accepts.
Cannot prove: speed or memory (qemu emulates instructions, not timings; its memory use is inflated).

A package that dies (SIGILL: an instruction the core lacks) fails the check in one line naming the board, the
release, the package and its version. The check tests itself each run: with onnxruntime 1.21.0 forced into a
bookworm install, the A53 must fail with exactly that line. `--onnxruntime VERSION` forces a version into the
whole check (`--onnxruntime 1.21.0` fails it with that line). Without binfmt_misc support the check skips.

Usage (as root): python .ci/arm64_check.py [--releases bookworm trixie] [--boards cortex-a53 cortex-a72]
       [--onnxruntime VERSION] [--keep DIR]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import tomllib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(Path(__file__).resolve().parent)]

from arm64_roots import BOARDS, CACHE, RELEASES, Board, Died, Emulated, binfmt_problem, ensure_root  # noqa: E402

T = TypeVar("T")
PREFIX = "arm64 check:"
FLEET = "arm64"
PROFILE = ROOT / "firmware_configs" / "raspberry-pi-zero-2w.toml"
NATIVE = {
    "numpy": "numpy",
    "onnxruntime": "onnxruntime",
    "PIL": "pillow",
    "msgpack": "msgpack",
    "paho.mqtt": "paho-mqtt",
}
"""Module imported -> the distribution that ships it: every package of '[agent]' with compiled code, and paho."""
SCORE_SECONDS = 1200
ROUND_SECONDS = 1800
SELF_TEST = ("bookworm", "cortex-a53", "1.21.0")
SELF_TEST_LINE = "cortex-a53 (Pi Zero 2 W / Pi 3) bookworm: onnxruntime 1.21.0 died with SIGILL on import"


def say(text: str) -> None:
    """One progress line."""
    print(f"{PREFIX} {text}", flush=True)


def digest(*parts: bytes | str) -> str:
    """A short hash of what a cache entry is built from."""
    hashed = hashlib.sha256()
    for part in parts:
        hashed.update(part.encode() if isinstance(part, str) else part)
        hashed.update(b"\0")
    return hashed.hexdigest()[:12]


def signal_name(code: int) -> str:
    """A child's exit: 'SIGILL' for a signal, 'exit 3' otherwise."""
    return signal.Signals(-code).name if code < 0 else f"exit {code}"


def host_run(argv: list[str], log: Path, cwd: Path | None = None) -> str:
    """Runs a host command (nice 10), its stderr appended to `log`; its stdout, or Died naming it."""
    with open(log, "a") as stream:
        done = subprocess.run(["nice", "-n", "10", *argv], stdout=subprocess.PIPE, stderr=stream, text=True, cwd=cwd)
    if done.returncode != 0:
        raise Died(f"on the host, {shlex.join(argv[1:4])} failed ({signal_name(done.returncode)}; see {log})")
    return done.stdout


@dataclass
class HostSide:
    """What the host prepares once: the project's wheel, the fleet, the two bundles and the host's selections."""

    work: Path
    wheel: Path
    fleet: Path
    selections: dict[str, list]


SCORES = {
    "paper-CNN": ("bundle-cnn", "cnn-pool.npy", "indices"),
    "EfficientNet-Lite0 head-only": ("bundle-efficientnet", "scenes", "files"),
}
"""Bundle name -> (its folder, its pool, the JSON field the selections are compared on: files for an image folder)."""


def score_argv(edge_agent: str, work: Path, bundle: str) -> list[str]:
    """`edge-agent score` of one of SCORES's bundles over its pool: 10 MC-dropout passes, the top 10, seed 0."""
    folder, pool, _ = SCORES[bundle]
    return [edge_agent, "score", "--bundle", str(work / folder), "--pool", str(work / pool)] + [
        *("--passes", "10", "--top", "10", "--seed", "0", "--json")
    ]


def prepare_host(work: Path, log: Path) -> HostSide:
    """The project's wheel (built from a copy of the tree, so the clone stays clean), a camera fleet of one device
    per (release, board) with 20 scenes each (a round needs no more, and each costs a backbone pass under
    emulation), the paper-CNN bundle over 50 Fashion-MNIST images and the fleet's EfficientNet-Lite0 head-only
    bundle (96 px, the Pi Zero's size) over 50 test scenes, and the host's selection with each."""
    import numpy as np

    from bench.camera_fleet import SPEC_FILE, FleetSettings, build_fleet, write_pool
    from bench.camera_scenes import DEFAULT_CLASSES, pick_items, render_set
    from edge_agent.data.fashion_mnist import load_fashion_mnist
    from edge_agent.learning.models import build_model, get_weights
    from protocol.files import save_arrays

    source = work / "source"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(".git", "*.egg-info", "build", "runs", "__pycache__"))
    host_run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(work), "."],
        log,
        source,
    )
    (wheel,) = work.glob("edge_fal-*.whl")
    dataset = load_fashion_mnist()
    settings = FleetSettings(len(BOARDS) * len(RELEASES), per_class=4, test_per_class=10, server_per_class=12)
    build_fleet(work / "fleet", settings, dataset)
    items, labels = pick_items(dataset.test_labels, DEFAULT_CLASSES, 10, np.random.default_rng(0))
    write_pool(work / "scenes", render_set(dataset.test_images[items], labels, settings.size, 0, 0), "scene")
    np.save(work / "cnn-pool.npy", dataset.test_images[:50])
    save_arrays(work / "cnn-weights.npz", get_weights(build_model(seed=0)))
    export = [sys.executable, "-m", "export", "--out"]
    host_run([*export, str(work / "bundle-cnn"), "--weights", str(work / "cnn-weights.npz")], log)
    host_run([*export, str(work / "bundle-efficientnet"), "--model-spec", str(work / "fleet" / SPEC_FILE)], log)
    edge_agent = [sys.executable, "-m", "edge_agent"]
    selections = {
        bundle: json.loads(host_run([*edge_agent, *score_argv("", work, bundle)[1:]], log))[field]
        for bundle, (_, _, field) in SCORES.items()
    }
    return HostSide(work, wheel, work / "fleet", selections)


def agent_requirements(onnxruntime: str | None) -> list[str]:
    """What '[agent]' installs as pyproject.toml declares it (the base dependencies and the extra), with onnxruntime
    pinned to a forced version, which the declared floor may exclude (the self-test's 1.21.0)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = [*project["dependencies"], *project["optional-dependencies"]["agent"]]
    if onnxruntime is None:
        return declared
    return [r for r in declared if not r.startswith("onnxruntime")] + [f"onnxruntime=={onnxruntime}"]


def wheelhouse(release: str, requirements: list[str], log: Path) -> Path:
    """The aarch64 wheels of the requirements for the release's Python, downloaded by the host's pip (fast, native)
    into a cache keyed by the release, pyproject.toml and the requirements; the emulated pip installs from it
    offline."""
    folder = CACHE / f"wheels-{release}-{digest((ROOT / 'pyproject.toml').read_bytes(), *requirements)}"
    if (folder / ".complete").exists():
        return folder
    shutil.rmtree(folder, ignore_errors=True)
    version = RELEASES[release].replace(".", "")
    host_run(
        [
            *(sys.executable, "-m", "pip", "download", "-q", "--dest", str(folder), "--only-binary=:all:"),
            *("--platform", "manylinux_2_28_aarch64", "--platform", "manylinux2014_aarch64"),
            *("--python-version", version, "--implementation", "cp", "--abi", f"cp{version}", "--abi", "abi3"),
            *("--abi", "none", *requirements),
        ],
        log,
    )
    (folder / ".complete").write_text("")
    return folder


@dataclass(frozen=True)
class Install:
    """The '[agent]' install in one release's root: its virtual environment and the versions pip chose."""

    release: str
    root: Path
    venv: str
    versions: dict[str, str]

    def on(self, board: Board, work: Path) -> Emulated:
        """This root on an emulated board."""
        return Emulated(self.root, board, work)


def install(release: str, root: Path, host: HostSide, onnxruntime: str | None, log: Path) -> Install:
    """The venv for this pyproject.toml (and forced onnxruntime) in the root, its requirements installed from the
    wheelhouse once; the project's wheel (without its dependencies) reinstalled into it on every run. The release's own pip (its python3-pip-whl) installs, on the
    A53, without byte-compiling (ensurepip's and pip's compiling take minutes under emulation)."""
    requirements = agent_requirements(onnxruntime)
    wheels = wheelhouse(release, requirements, log)
    kind = f"agent-ort{onnxruntime}" if onnxruntime else "agent"
    venv = f"/opt/{kind}-{wheels.name.rsplit('-', 1)[1]}"
    emulated = Emulated(root, BOARDS[0], host.work)
    pip = f"{venv}/bin/python $(echo /usr/share/python-wheels/pip-*.whl)/pip install -q --no-compile --no-index"
    pip += f" --find-links {wheels}"
    installing = Emulated(root, BOARDS[0], host.work, (wheels,))
    if not (root / venv.lstrip("/") / ".complete").exists():
        for stale in (root / "opt").glob(f"{kind}-[0-9a-f]*"):  # an older pyproject.toml's
            shutil.rmtree(stale, ignore_errors=True)
        script = f"python3 -m venv --without-pip {venv} && {pip} {shlex.join(requirements)}"
        checked(installing.run(["sh", "-c", script], log), f"{release}: the '[agent]' install failed", log)
        (root / venv.lstrip("/") / ".complete").write_text("")
    script = f"{pip} --no-deps --force-reinstall '{host.wheel}'"
    checked(installing.run(["sh", "-c", script], log), f"{release}: installing the project's wheel failed", log)
    names = json.dumps(sorted(set(NATIVE.values())))
    versions = emulated.run(
        [
            f"{venv}/bin/python",
            "-c",
            f"import importlib.metadata as m, json; print(json.dumps({{n: m.version(n) for n in {names}}}))",
        ],
        log,
    )
    checked(versions, f"{release}: reading the installed versions failed", log)
    return Install(release, root, venv, json.loads(versions.stdout))


def checked(done: subprocess.CompletedProcess[str], what: str, log: Path) -> None:
    """Raises Died with `what` and the child's exit when it failed (the log holds its output)."""
    if done.returncode != 0:
        raise Died(f"{what} ({signal_name(done.returncode)}; see {log})")


def probe_imports(install: Install, board: Board, work: Path, log: Path) -> None:
    """Imports every compiled package of the install on the board; when the process dies, each alone, to name the
    one that killed it."""
    emulated = install.on(board, work)
    python = f"{install.venv}/bin/python"
    together = emulated.run([python, "-c", "; ".join(f"import {module}" for module in NATIVE)], log)
    if together.returncode == 0:
        return
    for module, package in NATIVE.items():
        alone = emulated.run([python, "-c", f"import {module}"], log)
        if alone.returncode < 0:
            version = install.versions[package]
            raise Died(
                f"{board.name} {install.release}: {package} {version} died with {signal_name(alone.returncode)} on import"
            )
        checked(alone, f"{board.name} {install.release}: importing {package}", log)
    checked(together, f"{board.name} {install.release}: importing the agent's packages", log)


def runtime_versions(install: Install) -> str:
    """'onnxruntime 1.32.0, numpy 2.4.6': the packages a death in scoring or a round is most likely in."""
    return ", ".join(f"{name} {install.versions[name]}" for name in ("onnxruntime", "numpy"))


def score_on(install: Install, board: Board, host: HostSide, log: Path) -> None:
    """`edge-agent score` with both bundles on the board: the same selection as the host's, file for file."""
    emulated = install.on(board, host.work)
    where = f"{board.name} {install.release}"
    for bundle, (_, _, field) in SCORES.items():
        done = emulated.run(score_argv(f"{install.venv}/bin/edge-agent", host.work, bundle), log, timeout=SCORE_SECONDS)
        if done.returncode < 0:
            raise Died(
                f"{where}: edge-agent score ({bundle}) died with {signal_name(done.returncode)} ({runtime_versions(install)})"
            )
        checked(done, f"{where}: edge-agent score ({bundle})", log)
        chosen = json.loads(done.stdout.strip().splitlines()[-1])[field]
        if chosen != host.selections[bundle]:
            raise Died(f"{where}: the {bundle} bundle selected {chosen}, the host {host.selections[bundle]}")


def field_round(installs: list[Install], boards: tuple[Board, ...], host: HostSide, log: Path) -> int:
    """One round of the camera fleet: a coordinator on the host (its own mosquitto on a loopback port), one field
    agent per (release, board) on the Pi Zero 2 W profile, the bench's people answering their queries; every
    device's update must be accepted. Returns the accepted updates."""
    from bench.camera_fleet import SERVER_FILE, SPEC_FILE, PeopleAtTheOracles, camera_agent_command, stop_site
    from coordinator.fleet.broker import EmbeddedBroker
    from coordinator.storage.store import RunStore
    from protocol.model_spec import load_model_spec

    devices = [(install, board) for install in installs for board in boards]
    states = [host.work / f"device-{number}" for number in range(len(devices))]
    run_dir = host.work / "run"
    shutil.copy(PROFILE, host.work / PROFILE.name)
    with EmbeddedBroker(host.work / "broker") as broker:
        coordinator = [
            *(sys.executable, "-m", "coordinator", "run", "--broker", broker.address.url, "--fleet", FLEET),
            *("--run-dir", str(run_dir), "--rounds", "1", "--model-spec", str(host.fleet / SPEC_FILE)),
            *("--dataset", str(host.fleet / SERVER_FILE), "--min-devices", str(len(devices))),
            *("--quorum", str(len(devices)), "--round-timeout", str(ROUND_SECONDS), "--init-samples", "50"),
            *("--init-epochs", "5", "--validation-samples", "10", "--labels-per-acquisition", "5"),
            *("--epochs", "5", "--sampler", "margin", "--mc-passes", "4", "--seed", "0", "--no-device-eval"),
        ]
        with open(host.work / "coordinator.log", "ab") as stream:
            processes = [subprocess.Popen(["nice", "-n", "10", *coordinator], stdout=stream, stderr=stream)]
        for number, ((install, board), state) in enumerate(zip(devices, states)):
            state.mkdir()
            agent = camera_agent_command(broker.address.url, FLEET, host.fleet, number, state, host.work / PROFILE.name)
            argv = [f"{install.venv}/bin/edge-agent", *agent[3:]]  # the emulated install's, not the host's Python
            processes.append(install.on(board, host.work).start(argv, host.work / f"device-{number}.log"))
        names = tuple(load_model_spec(host.fleet / SPEC_FILE).spec.class_names)
        people = PeopleAtTheOracles(host.fleet, states, names)
        people.start()
        try:
            watch(processes, devices, host.work)
        finally:
            stop_site(people, processes)
    records = RunStore(run_dir).device_rounds(1)
    refused = [f"{r.device_id}: {r.reason}" for r in records if not r.accepted]
    if refused or len(records) != len(devices):
        raise Died(f"the field round accepted {len(records) - len(refused)} of {len(devices)} updates {refused}")
    return len(records)


def watch(processes: list[subprocess.Popen[bytes]], devices: list[tuple[Install, Board]], work: Path) -> None:
    """Waits until the coordinator and every device have exited; a device that dies or fails ends the round in one
    line naming its board and release."""
    deadline = time.monotonic() + ROUND_SECONDS
    while any(process.poll() is None for process in processes):
        for number, (process, (install, board)) in enumerate(zip(processes[1:], devices)):
            code = process.poll()
            if code is not None and code != 0:
                raise Died(
                    f"{board.name} {install.release}: the field agent died with {signal_name(code)} "
                    f"({runtime_versions(install)}; see {work}/device-{number}.log)"
                )
        if time.monotonic() > deadline:
            raise Died(f"the field round did not end within {ROUND_SECONDS}s (see {work})")
        time.sleep(1)
    if processes[0].returncode != 0:
        raise Died(f"the coordinator exited with {signal_name(processes[0].returncode)} (see {work}/coordinator.log)")


def self_test(root: Path, host: HostSide, log: Path) -> None:
    """The check must see what it exists for: with onnxruntime 1.21.0 forced into a bookworm install, the imports
    on the A53 must die with SELF_TEST_LINE (were the CPU model not pinned, qemu's 'max' would hide the crash)."""
    release, cpu, version = SELF_TEST
    forced = install(release, root, host, version, log)
    try:
        probe_imports(forced, next(board for board in BOARDS if board.cpu == cpu), host.work, log)
    except Died as died:
        if str(died) == SELF_TEST_LINE:
            return
        raise Died(f"self-test: expected {SELF_TEST_LINE!r}, the check said {str(died)!r}") from None
    raise Died(f"self-test: with onnxruntime {version} forced in, the imports on {cpu} did not die")


def timed(what: str, action: Callable[..., T], *args: object) -> T:
    """Runs action(*args) and says how long it took."""
    started = time.monotonic()
    result = action(*args)
    say(f"{what} ({time.monotonic() - started:.0f}s)")
    return result


def built_roots(releases: list[str], work: Path, log: Path) -> tuple[dict[str, Path], HostSide]:
    """Each release's root (built by debootstrap where not cached, all at once) while the host prepares its side."""
    with ThreadPoolExecutor(max_workers=len(releases)) as pool:
        building = {release: pool.submit(ensure_root, release, log) for release in releases}
        host = timed("host: wheel, fleet, bundles and the host's selections", prepare_host, work, log)
        roots = {}
        for release, future in building.items():
            roots[release], seconds = future.result()
            state = f"built in {seconds:.0f}s" if seconds else "cached"
            say(f"{release}: root {state} ({roots[release].name})")
    return roots, host


def check(releases: list[str], boards: tuple[Board, ...], onnxruntime: str | None, work: Path) -> str:
    """The whole check; the verdict's text, or Died with the line that names what failed."""
    log = work / "check.log"
    roots, host = built_roots(sorted({*releases, SELF_TEST[0]}), work, log)
    installs = []
    for release in releases:
        done = timed(f"{release}: '[agent]' installed", install, release, roots[release], host, onnxruntime, log)
        say(f"{release}: " + ", ".join(f"{name} {version}" for name, version in sorted(done.versions.items())))
        installs.append(done)
    for done in installs:
        for board in boards:
            where = f"{board.name} {done.release}"
            timed(f"{where}: imports", probe_imports, done, board, work, log)
            timed(f"{where}: selections identical to the host's", score_on, done, board, host, log)
    accepted = timed("field round", field_round, installs, boards, host, log)
    timed(f"self-test: {SELF_TEST_LINE}", self_test, roots[SELF_TEST[0]], host, log)
    versions = "; ".join(f"{i.release}: {runtime_versions(i)}, pillow {i.versions['pillow']}" for i in installs)
    return (
        f"passed on {', '.join(b.name for b in boards)} x {', '.join(releases)} ({versions}): selections identical "
        f"to the host's, {accepted} field updates accepted, onnxruntime {SELF_TEST[2]} seen dying. Proves "
        "instructions and numerics on these cores; not speed or memory"
    )


def main() -> int:
    """Parses the options, skips without binfmt support, runs the check and prints the verdict (exit 0 or 1)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--releases", nargs="+", choices=sorted(RELEASES), default=list(RELEASES))
    parser.add_argument("--boards", nargs="+", choices=[b.cpu for b in BOARDS], default=[b.cpu for b in BOARDS])
    parser.add_argument("--onnxruntime", help="force this onnxruntime version into the emulated install")
    parser.add_argument("--keep", type=Path, help="work in this folder and keep it (default: a temporary one)")
    args = parser.parse_args()
    problem = binfmt_problem()
    if problem is not None:
        say(f"skipped: {problem}")
        return 0
    boards = tuple(board for board in BOARDS if board.cpu in args.boards)
    started = time.monotonic()
    work = args.keep or Path(tempfile.mkdtemp(prefix="arm64-check-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        verdict = check(args.releases, boards, args.onnxruntime, work)
    except Died as died:
        say(f"FAILED: {died} (after {time.monotonic() - started:.0f}s; work kept in {work})")
        return 1
    if args.keep is None:
        shutil.rmtree(work, ignore_errors=True)
    say(f"{verdict} ({time.monotonic() - started:.0f}s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
