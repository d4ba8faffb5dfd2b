# Process hygiene with real processes: an agent stops within 2 s of SIGTERM in every state; simulate takes its agents along.
from __future__ import annotations

import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from fleet import (
    TINY_RUN,
    announce_round,
    fleet_shards,
    log_text,
    start_agent,
    wait_exit,
    wait_for_state,
    wait_until,
    watch_status,
)

from coordinator.fleet.broker import free_loopback_port
from protocol import messages

FLEET = "hygiene"
ROOT = Path(__file__).resolve().parent.parent
STOP_SECONDS = 2.0
LONG_TRAINING = messages.Recipe(labels_per_acquisition=20, epochs=2000, batch_size=8, mc_passes=2)


def seconds_to_stop(process: subprocess.Popen, log_file: Path) -> float:
    """SIGTERM, then how long the process took to exit (it must exit cleanly; else its log's tail says how not)."""
    sent = time.monotonic()
    process.send_signal(signal.SIGTERM)
    assert wait_exit(process, "the agent after SIGTERM", timeout=30) == 0, log_text(log_file)[-3000:]
    return time.monotonic() - sent


@pytest.mark.integration
@pytest.mark.alone
@pytest.mark.parametrize("state", ["connecting", "idle", "reconnecting", "training"])
def test_an_agent_exits_within_two_seconds_of_sigterm(state: str, tmp_path: Path, broker, processes) -> None:
    [launch] = fleet_shards(tmp_path, 1)
    if state == "connecting":
        broker.stop()
        agent = start_agent(launch, broker.address, FLEET)
        processes.append(agent)
        wait_until(lambda: "mqtt connecting" in log_text(launch.log_file), "the agent trying its absent broker")
        time.sleep(1.0)
        assert seconds_to_stop(agent, launch.log_file) < STOP_SECONDS, log_text(launch.log_file)[-2000:]
        return
    watcher = watch_status(broker.address, FLEET)
    agent = start_agent(launch, broker.address, FLEET)
    processes.append(agent)
    wait_for_state(watcher, "online")
    if state == "training":
        announce_round(broker.address, FLEET, LONG_TRAINING)
        wait_for_state(watcher, "training")
        time.sleep(1.0)
    watcher.close()
    if state == "reconnecting":
        broker.stop()
        wait_until(lambda: "mqtt disconnected" in log_text(launch.log_file), "the agent noticing the broker is gone")
        time.sleep(1.5)
    assert seconds_to_stop(agent, launch.log_file) < STOP_SECONDS, log_text(launch.log_file)[-2000:]


def agent_pids(run_dir: Path) -> list[int]:
    """The pids of live agent processes whose command line names this run directory."""
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            command = (entry / "cmdline").read_bytes().replace(b"\0", b" ")
            state = (entry / "stat").read_text().split(") ")[1][0]
        except (FileNotFoundError, ProcessLookupError, PermissionError, IndexError, NotADirectoryError):
            continue
        is_agent = b"-m bench host" in command or b"-m bench device" in command
        if is_agent and str(run_dir).encode() in command and state != "Z":
            pids.append(int(entry.name))
    return pids


@pytest.mark.integration
def test_simulate_forwards_sigterm_to_its_agents_and_waits_for_them(tmp_path: Path, processes) -> None:
    run_dir = tmp_path / "run"
    command = [sys.executable, "-m", "bench", "simulate", "--devices", "2", "--rounds", "5"]
    command += ["--run-dir", str(run_dir), "--pool-size", "200", *TINY_RUN]
    with open(tmp_path / "simulate.log", "wb") as output:
        simulate = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT)
    processes.append(simulate)
    wait_until(lambda: len(agent_pids(run_dir)) == 2, "two agents running")
    agents = agent_pids(run_dir)
    wait_until(lambda: "round announced round=1" in log_text(tmp_path / "simulate.log"), "the first round")
    simulate.send_signal(signal.SIGTERM)
    assert wait_exit(simulate, "simulate after SIGTERM", timeout=30) == 143
    assert agent_pids(run_dir) == [], f"agents {agents} outlived simulate"


def unit_service_section(path: Path) -> dict[str, str]:
    """The [Service] keys of a systemd unit file (comments and other sections skipped)."""
    section, keys = "", {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if line.startswith("[") and line.endswith("]"):
            section = line
        elif section == "[Service]" and "=" in line and not line.startswith("#"):
            key, _, value = line.partition("=")
            keys[key] = value
    return keys


def unit_command(exec_start: str, environment: dict[str, str], paths: dict[str, Path]) -> list[str]:
    """The unit's ExecStart as this machine runs it: the installed entry point as `python -m edge_agent`, the
    environment file's variables expanded, the unit's fixed paths moved under the test's directory."""
    for name, value in environment.items():
        exec_start = exec_start.replace("${" + name + "}", value).replace("$" + name, value)
    for fixed, moved in paths.items():
        exec_start = exec_start.replace(fixed, str(moved))
    program, *arguments = shlex.split(exec_start)
    assert program == "/opt/edge-agent/bin/edge-agent", program
    return [sys.executable, "-m", "edge_agent", *arguments]


@pytest.mark.integration
def test_the_systemd_units_stop_ends_the_agent_it_runs_cleanly_and_in_time(tmp_path: Path, broker, processes) -> None:
    """No systemd here: the unit's own command line is run, then stopped as `systemctl stop` does (its KillSignal,
    its TimeoutStopSec); a clean exit (0) is what systemd records as a stop, not a failure to restart from."""
    service = unit_service_section(ROOT / "firmware_configs" / "edge-agent.service")
    assert service["KillSignal"] == "SIGTERM" and float(service["TimeoutStopSec"]) >= STOP_SECONDS
    (tmp_path / "camera").mkdir()
    paths = {
        "/etc/edge-agent/profile.toml": ROOT / "firmware_configs" / "raspberry-pi-zero-2w.toml",
        "/srv/camera": tmp_path / "camera",
        "/var/lib/edge-agent": tmp_path / "state",
    }
    environment = {"EDGE_BROKER": broker.address.url, "EDGE_FLEET": FLEET, "EDGE_DEVICE_ID": "cam-7"}
    environment["EDGE_AGENT_ARGS"] = "--log-level info"
    watcher = watch_status(broker.address, FLEET)
    with open(tmp_path / "agent.log", "wb") as log:
        agent = subprocess.Popen(unit_command(service["ExecStart"], environment, paths), stdout=log, stderr=log)
    processes.append(agent)
    wait_for_state(watcher, "online")
    watcher.close()
    sent = time.monotonic()
    agent.send_signal(getattr(signal, service["KillSignal"]))
    assert wait_exit(agent, "the unit's agent after its KillSignal", timeout=float(service["TimeoutStopSec"])) == 0
    assert time.monotonic() - sent < STOP_SECONDS, log_text(tmp_path / "agent.log")[-2000:]


@pytest.mark.integration
def test_the_systemd_units_doctor_lets_a_ready_board_start_and_names_what_stops_a_broken_one(
    tmp_path: Path, broker
) -> None:
    """The unit's ExecStartPre as this machine runs it: exit 0 on a board that can serve; with the broker's address
    wrong, exit 1 (systemd then does not start the agent) and one line naming the broker in the journal."""
    service = unit_service_section(ROOT / "firmware_configs" / "edge-agent.service")
    paths = {
        "/etc/edge-agent/profile.toml": ROOT / "firmware_configs" / "raspberry-pi-zero-2w.toml",
        "/var/lib/edge-agent": tmp_path / "state",
    }
    ready = {"EDGE_BROKER": broker.address.url, "EDGE_DOCTOR_ARGS": ""}
    done = subprocess.run(unit_command(service["ExecStartPre"], ready, paths), capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout.endswith("ready: this board can serve its fleet\n"), done.stdout
    dead = f"mqtt://127.0.0.1:{free_loopback_port()}"
    done = subprocess.run(
        unit_command(service["ExecStartPre"], {**ready, "EDGE_BROKER": dead}, paths), capture_output=True, text=True
    )
    assert done.returncode == 1
    assert [line for line in done.stdout.splitlines() if line.startswith("FAIL")] == [
        f"FAIL broker: {dead} cannot be reached: [Errno 111] Connection refused"
    ]
