# The camera path of docs/first-camera-fleet.md as the bench runs it: the guide's own commands, a site's values put in.
from __future__ import annotations

import re
import secrets
import shlex
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from bench.camera_fleet import (
    POOL_DIR,
    SERVER_FILE,
    SPEC_FILE,
    BenchPeople,
    PeopleAtTheOracles,
    PeopleAtThePage,
    device_dir,
    stop_site,
)
from protocol.model_spec import load_model_spec

ROOT = Path(__file__).resolve().parent.parent
GUIDE = ROOT / "docs" / "first-camera-fleet.md"
PROGRAMS = {"fl-coordinator": "coordinator", "edge-agent": "edge_agent"}
PROFILE = ROOT / "firmware_configs" / "raspberry-pi-zero-2w.toml"
"""The board profile the guide's devices run (its copy is /etc/edge-agent/profile.toml on a Pi Zero 2 W)."""
AVERAGED_HEADS = "averaged-heads"  # the guide's block of flags that averaged heads take in place of the pooled head's
POOLED_HEAD = (("--strategy", None), ("--local-rule", None))
"""The guide's pooled-head flags, as a site's values leave them out (for the guide's averaged heads)."""


def guide_command(name: str, guide: Path = GUIDE) -> list[str]:
    """The words of the command in the fenced block right after `<!-- first-camera-fleet: NAME -->`; ValueError
    when the guide has no such block."""
    pattern = rf"<!-- first-camera-fleet: {re.escape(name)} -->\n```sh\n(.*?)```"
    found = re.search(pattern, guide.read_text(), re.DOTALL)
    if found is None:
        raise ValueError(f"{guide} has no sh block marked first-camera-fleet: {name}")
    return shlex.split(found.group(1).replace("\\\n", " "), comments=True)


def with_values(words: Sequence[str], values: Mapping[str, str | None]) -> list[str]:
    """The command with each named flag's value replaced, or the flag and its value left out for None (the flag
    must be there: a site changes values only), its program run by this Python (`python -m PACKAGE`)."""
    out = list(words)
    for flag, value in values.items():
        if flag not in out:
            raise ValueError(f"the guide's {words[0]} command has no {flag}")
        at = out.index(flag)
        out[at : at + 2] = [] if value is None else [flag, value]
    return [sys.executable, "-m", PROGRAMS[out[0]], *out[1:]]


@dataclass(frozen=True)
class CentralLabelling:
    """The field loop's labelling on a site: the coordinator's dashboard (loopback, this port, this token) serves
    the fleet's labelling page, devices send their queries there and publish their predictions."""

    port: int
    token: str = field(default_factory=lambda: secrets.token_hex(24))  # (never '-' first: argparse's flag)
    field_test_share: float = 0.0  # the queue's --field-test-share (0: every answer goes to its device)

    @property
    def url(self) -> str:
        """The dashboard's address."""
        return f"http://127.0.0.1:{self.port}"

    def coordinator_flags(self) -> tuple[str, ...]:
        """What the coordinator adds: the dashboard with its token, the labelling queue (with its share of field
        test queries), predictions published."""
        return (
            "--dashboard",
            f"127.0.0.1:{self.port}",
            "--dashboard-token",
            self.token,
            "--labelling",
            "--field-test-share",
            str(self.field_test_share),
            "--publish-predictions",
        )


BENCH_AGENT_FLAGS = ("--settle-seconds", "0", "--scan-interval", "0.5")  # the bench's cameras: no settling, quick scans


@dataclass(frozen=True)
class CameraSite:
    """Where the guide's commands run on one machine: a fleet folder (bench.camera_fleet), a work folder, the
    broker's loopback port, the rounds and labels a round, and flags a sweep adds to either side."""

    fleet_dir: Path
    work: Path
    port: int
    devices: int
    rounds: int
    labels: int
    coordinator_flags: tuple[str, ...] = ()
    coordinator_values: tuple[tuple[str, str | None], ...] = ()  # the guide's flags given other values (None: left out)
    agent_flags: tuple[str, ...] = field(default=BENCH_AGENT_FLAGS)
    own_flags: tuple[tuple[str, ...], ...] = ()  # per camera, by number: flags only it adds (one consents, one not)
    profile: Path | None = PROFILE  # None: no board profile (a from-scratch model's devices train it all in torch)
    central: CentralLabelling | None = None  # None: each device's person answers at its folder oracle
    averaged_heads: bool = False  # the guide's averaged heads in place of its pooled head

    def people(self, class_names: tuple[str, ...]) -> BenchPeople:
        """The bench's people: one person at the fleet's labelling page (central), else one at each device's
        folder oracle."""
        if self.central is not None:
            return PeopleAtThePage(self.fleet_dir, self.devices, class_names, self.central.url, self.central.token)
        return PeopleAtTheOracles(self.fleet_dir, [self.state_dir(n) for n in range(self.devices)], class_names)

    @property
    def run_dir(self) -> Path:
        """The coordinator's run folder."""
        return self.work / "run"

    def state_dir(self, number: int) -> Path:
        """Device NN's state folder."""
        return self.work / f"cam-{number}" / "state"

    def coordinator_command(self) -> list[str]:
        """The guide's `fl-coordinator run`, with this site's files, port, fleet size, rounds and labels (with
        averaged_heads, its pooled head's flags replaced by the guide's averaged-heads block)."""
        count = str(self.devices)
        values = {
            **{"--model-spec": str(self.fleet_dir / SPEC_FILE), "--dataset": str(self.fleet_dir / SERVER_FILE)},
            **{"--run-dir": str(self.run_dir), "--broker-listen": f"127.0.0.1:{self.port}"},
            **{"--wait-devices": count, "--min-devices": count, "--rounds": str(self.rounds)},
            "--labels-per-acquisition": str(self.labels),
            **dict(POOLED_HEAD if self.averaged_heads else ()),
            **dict(self.coordinator_values),
        }
        averaged = guide_command(AVERAGED_HEADS) if self.averaged_heads else []
        loop = () if self.central is None else self.central.coordinator_flags()
        return [*with_values(guide_command("coordinator"), values), *averaged, *self.coordinator_flags, *loop]

    def agent_command(self, number: int) -> list[str]:
        """The guide's `edge-agent run` of device NN: its camera folder, state folder, the fleet's spec, the board
        profile (if any), this site's broker."""
        values = {
            **{"--broker": f"mqtt://127.0.0.1:{self.port}", "--device-id": f"cam-{number}"},
            **{"--pool-dir": str(device_dir(self.fleet_dir, number) / POOL_DIR)},
            **{"--state-dir": str(self.state_dir(number)), "--model-spec": str(self.fleet_dir / SPEC_FILE)},
            "--profile": None if self.profile is None else str(self.profile),
        }
        loop = () if self.central is None else ("--labelling", "central")
        own = self.own_flags[number] if number < len(self.own_flags) else ()
        return [*with_values(guide_command("device"), values), *self.agent_flags, *own, *loop]

    def report_command(self) -> list[str]:
        """The guide's `fl-coordinator report` of this site's run."""
        words = guide_command("after")
        return [sys.executable, "-m", PROGRAMS[words[0]], *words[1:-1], str(self.run_dir)]


BROKER_LINE = "embedded broker listening at "  # the coordinator's line once its broker takes connections


def broker_listening(out: Path, coordinator: subprocess.Popen, timeout: float) -> bool:
    """Waits until the coordinator's stdout says its broker listens (as a person starts the devices after reading
    it); False when the coordinator exits first or the timeout passes."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and coordinator.poll() is None:
        if BROKER_LINE in out.read_text(errors="replace"):
            return True
        time.sleep(0.2)
    return False


def run_camera_site(site: CameraSite, timeout: float, people: BenchPeople | None = None) -> list[int]:
    """The coordinator, then (once its broker listens) one agent per device by the guide's commands (logs in the
    work folder: the coordinator's stdout in coordinator.out), with the bench's people answering (the site's
    own, unless given), until all exit; their exit codes (the coordinator's alone when it stopped before its
    broker listened)."""
    names = tuple(load_model_spec(site.fleet_dir / SPEC_FILE).spec.class_names)
    for number in range(site.devices):
        site.state_dir(number).mkdir(parents=True, exist_ok=True)
    out = site.work / "coordinator.out"
    with open(out, "ab") as stdout, open(site.work / "coordinator.log", "ab") as log:
        processes = [subprocess.Popen(site.coordinator_command(), stdout=stdout, stderr=log)]
    people = site.people(names) if people is None else people
    try:
        if broker_listening(out, processes[0], timeout):
            for number in range(site.devices):
                with open(site.work / f"cam-{number}.log", "ab") as log:
                    processes.append(subprocess.Popen(site.agent_command(number), stdout=log, stderr=log))
            people.start()
        return [process.wait(timeout=timeout) for process in processes]
    finally:
        stop_site(people, processes)
